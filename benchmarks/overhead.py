"""What the probe costs a training step, against a bare step and the hooks people write today.

    python benchmarks/overhead.py [--rounds 7] [--steps 8] [--case mlp gpt2 stack] [--families]
                                  [--parts] [--device cuda] [--bf16]

Every variant trains its own copy of the same weights; the variants take turns (interleaved
rounds in a shuffled order, in one process) so that machine noise hits them alike. On a CPU a
step is timed in process CPU time (``time.process_time``: every thread of this process, not the
other jobs of a shared machine); on CUDA in wall time, synchronized. Prints the median time
per step over the rounds, and the median and quartiles of its ratio to the bare step of the same
round.

Cases (the targets of the overhead goals, see the README):
  mlp    12 Pre-LN feed-forward blocks, width 256 (hidden 1024), batch 64, 1 torch thread
  gpt2   the GPT-2-style TinyTransformer, 12 blocks, width 256, 8x128 tokens, 2 torch threads
  stack  the 48-block ResidualStack of sanity check [d], width 64, batch 16, 1 torch thread

Variants:
  bare             the training step alone
  bare again       a second bare copy: its ratio is what this run's noise alone reads
  every=50         normprobe.attach(..., every=50) with the defaults: every metric, the spike
                   detector on (the loop hands it the loss with probe.observe_loss), TensorBoard
  every=50 exact   the same with a spike detector that reads every gradient entry
                   (Spikes(sample=None): misses nothing)
  no spikes        every=50 with spikes=None
  every=1          every metric logged every step into TensorBoard (scalars, histograms, the
                   flags judged every 10th step); the heatmaps are drawn at removal only: on
                   their own thread, held to 1% of the wall time, they would otherwise land on
                   whichever variant is being timed when they are drawn
  every=1 memory   the same into a MemorySink alone (no TensorBoard)
  naive hooks      a forward hook on every module logging the output RMS with .item()
  lightning        Lightning's grad_norm() every step, values logged as floats
  -<family>        (--families) every=1 into a MemorySink without that family: its
                   cost is what leaving it out saves

--parts (CPU) times instead what each family's own code costs a logged step (every=1, a
MemorySink) on the training thread (``time.thread_time``: the process clock folds other
threads' time in at scheduler ticks, too coarse for parts of a millisecond), and the
probe's runtime apart from them (its hooks' Python, the attention mode, the spike detector,
the flush); the torch threads a part's operations run on besides are not counted. The
residual stream's reductions, which several families share, count as the first's
(``resid_rms``).

The every=50 rows are the median round: a round of 8 steps rarely holds the one logged step in
50, so they read what an unlogged step costs.

On CUDA it also counts the host syncs of each step of a probe logging every 3rd step, with
``torch.cuda.set_sync_debug_mode``: one (the transfer) on a logged step, none otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import math
import random
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import normprobe
from normprobe.models import MLPStack, ResidualStack, TinyTransformer
from normprobe.runtime import hooks, modes, plan

Step = Callable[[], None]
Loss = Callable[[nn.Module], torch.Tensor]
BF16 = False  # forward under bf16 autocast (--bf16)


@dataclass
class Case:
    title: str
    make: Callable[[], nn.Module]
    loss: Loss
    threads: int


def cases(device: torch.device) -> dict[str, Case]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (8, 128), device=device)
    rows = torch.randn(64, 256, device=device)
    stack_rows = torch.randn(16, 64, device=device)
    return {
        "mlp": Case(
            "MLPStack: 12 Pre-LN blocks, width 256, hidden 1024, batch 64, 1 thread",
            MLPStack,
            lambda m: m(rows).pow(2).mean(),
            1,
        ),
        "gpt2": Case(
            "GPT-2-style TinyTransformer: 12 blocks, width 256, 8x128 tokens, 2 threads",
            lambda: TinyTransformer(width=256, depth=12, context=128),
            lambda m: m.loss(tokens, tokens),  # type: ignore[operator]
            2,
        ),
        "stack": Case(
            "ResidualStack: 48 blocks, width 64, batch 16, 1 thread",
            lambda: ResidualStack(48, 64),
            lambda m: m(stack_rows).pow(2).mean(),
            1,
        ),
    }


def _trainer(model: nn.Module, loss: Loss, **attach: Any) -> Step:
    """One AdamW step of ``model``; with ``attach`` arguments, under a probe handed the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probe = normprobe.attach(model, opt, **attach) if attach else None
    device = next(model.parameters()).device.type

    def step() -> None:
        with torch.autocast(device, torch.bfloat16, enabled=BF16):
            value = loss(model)
        if probe is not None:
            probe.observe_loss(value)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _naive_hooks(model: nn.Module) -> nn.Module:
    logged: dict[str, float] = {}
    for name, module in model.named_modules():

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                logged[name] = out.detach().float().pow(2).mean().sqrt().item()

        module.register_forward_hook(hook)
    return model


def _lightning(model: nn.Module, loss: Loss) -> Step:
    from lightning.pytorch.utilities import grad_norm

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = next(model.parameters()).device.type

    def step() -> None:
        with torch.autocast(device, torch.bfloat16, enabled=BF16):
            value = loss(model)
        value.backward()
        logged = {k: float(v) for k, v in grad_norm(model, norm_type=2).items()}
        assert logged
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _log_dir() -> str:
    return tempfile.mkdtemp(prefix="normprobe-bench-")


def variants(case: Case, device: torch.device, families: bool) -> dict[str, Step]:
    base = case.make().to(device)

    def fresh() -> nn.Module:
        return copy.deepcopy(base)

    exact = normprobe.Spikes(sample=None)
    out: dict[str, Step] = {"bare": _trainer(fresh(), case.loss)}
    out["bare again"] = _trainer(fresh(), case.loss)
    out["every=50"] = _trainer(fresh(), case.loss, every=50, log_dir=_log_dir())
    out["every=50 exact"] = _trainer(fresh(), case.loss, every=50, log_dir=_log_dir(), spikes=exact)
    out["no spikes"] = _trainer(fresh(), case.loss, every=50, log_dir=_log_dir(), spikes=None)
    # heatmaps at removal only: drawn on a thread of their own within 1% of the wall time, they
    # would land on whichever variant is being timed when they are drawn
    no_drawing = normprobe.TensorBoardSink(log_dir=_log_dir(), heatmap_seconds=math.inf)
    out["every=1"] = _trainer(fresh(), case.loss, every=1, sinks=[no_drawing])
    out["every=1 memory"] = _trainer(fresh(), case.loss, every=1, sinks=[normprobe.MemorySink()])
    if families:
        every = [name for name in normprobe.METRICS if name != "spikes"]
        for left_out in every:
            kept = [name for name in normprobe.METRICS if name != left_out]
            sinks = [normprobe.MemorySink()]
            out[f"-{left_out}"] = _trainer(fresh(), case.loss, every=1, sinks=sinks, metrics=kept)
    out["naive hooks"] = _trainer(_naive_hooks(fresh()), case.loss)
    out["lightning"] = _lightning(fresh(), case.loss)
    return out


def measure(
    steps: dict[str, Step], rounds: int, per_round: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per step of each variant in each round: process CPU time on a CPU, wall time on
    CUDA. Each round starts from a collected heap, so that a variant pays for the garbage
    collections its own allocations cause, not those of the variant before it."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step in steps.values():  # warm-up, and lazy discovery on the first forward
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    turns = list(steps.items())
    for r in range(rounds):
        random.Random(r).shuffle(turns)  # no variant always runs after the same one
        for name, step in turns:
            gc.collect()
            sync()
            start = clock()
            for _ in range(per_round):
                step()
            sync()
            times[name].append((clock() - start) / per_round)
    return times


def ratios(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Each variant's time over the bare step's in the same round (the machine's speed drifts
    between rounds, far less within one): the quartiles over the rounds."""
    bare = times["bare"]
    out = {}
    for name, seconds in times.items():
        q1, median, q3 = statistics.quantiles(
            [s / b for s, b in zip(seconds, bare, strict=True)], n=4
        )
        out[name] = (q1, median, q3)
    return out


class PartTimes:
    """Training-thread CPU seconds by part, each part's own (time in parts it calls left out)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open part: the time of the parts it called

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.seconds[part] += spent - self._inner.pop()
                if self._inner:
                    self._inner[-1] += spent

        return run


@contextlib.contextmanager
def _timing_parts(times: PartTimes) -> Iterator[None]:
    """Within: each family's callables timed under its name, the hooks and the attention mode
    under ``runtime`` (the model's own operations inside the mode left out)."""
    owner = plan.ProbePlan
    saved: dict[str, Callable[..., Any]] = {}  # the methods replaced, as they were
    family: list[str] = ["runtime"]

    def install(self: Any, families: Any) -> None:
        for f in families:
            family[0] = f.name
            saved["install"](self, [f])
        family[0] = "runtime"

    def registering(name: str, index: int) -> Callable[..., Any]:
        def register(self: Any, *args: Any, **kwargs: Any) -> Any:
            args = tuple(times.timed(family[0], a) if i == index else a for i, a in enumerate(args))
            if "action" in kwargs:
                kwargs["action"] = times.timed(family[0], kwargs["action"])
            return saved[name](self, *args, **kwargs)

        return register

    def shared(self: Any, key: str, make: Callable[[], Any]) -> Any:
        return saved["shared"](self, key, times.timed(family[0], make))

    call, mode = hooks.ProbeHook.__call__, modes.AttentionLogits.__torch_function__

    def in_mode(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # the model's operation inside is the model's: timed as a part of its own, dropped
        return mode(self, times.timed("model", func), types, args, kwargs)

    replaced = {
        "install": install,
        "shared": shared,
        "read": registering("read", 2),
        "read_attention": registering("read_attention", 1),
        **{name: registering(name, 0) for name in _CALLABLES},
    }
    for name, fn in replaced.items():
        saved[name] = getattr(owner, name)
        setattr(owner, name, fn)
    hooks.ProbeHook.__call__ = times.timed("runtime", call)  # type: ignore[method-assign]
    modes.AttentionLogits.__torch_function__ = times.timed("runtime", in_mode)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(owner, name, fn)
        hooks.ProbeHook.__call__ = call  # type: ignore[method-assign]
        modes.AttentionLogits.__torch_function__ = mode  # type: ignore[method-assign]


# where families hand the probe a callable as the first argument (called on logged steps)
_CALLABLES = (
    "read_add",
    "read_outputs",
    "read_gradients",
    "at_forward_start",
    "at_forward_end",
    "on_gradients",
    "before_step",
    "after_step",
    "at_flush",
    "on_clear",
    "on_record",
)


def parts(
    case: Case, device: torch.device, steps: int = 10
) -> tuple[float, float, dict[str, float]]:
    """The training thread's seconds per bare step and per logged step (every=1, a MemorySink;
    the two in turn), and each part's of the logged one."""
    times = PartTimes()
    with _timing_parts(times):
        bare = _trainer(case.make().to(device), case.loss)
        sinks = [normprobe.MemorySink()]
        logged = _trainer(case.make().to(device), case.loss, every=1, sinks=sinks)
        for _ in range(3):  # discovery and the first logged steps
            bare()
            logged()
        times.seconds.clear()
        spent = {bare: 0.0, logged: 0.0}
        for _ in range(steps):
            for step in spent:
                start = time.thread_time()
                step()
                spent[step] += time.thread_time() - start
    times.seconds.pop("model", None)
    per_part = {part: s / steps for part, s in times.seconds.items()}
    return spent[bare] / steps, spent[logged] / steps, per_part


def syncs_per_step(case: Case, device: torch.device) -> list[int]:
    """Host syncs of steps 3..8 of a probe logging every 3rd step (CUDA only)."""
    step = _trainer(case.make().to(device), case.loss, every=3, log_dir=_log_dir())
    for _ in range(2):  # discovery and the first logged step
        step()
    counts = []
    for _ in range(6):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--case", nargs="+", default=["mlp", "gpt2", "stack"])
    parser.add_argument("--families", action="store_true", help="what each family costs")
    parser.add_argument(
        "--parts", action="store_true", help="each family's own time on a logged step (CPU)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast")
    args = parser.parse_args()
    global BF16
    BF16 = args.bf16
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message="normprobe: ")  # spikes of the first steps
    every = cases(device)
    unknown = [name for name in args.case if name not in every]
    if unknown:
        parser.error(f"unknown --case {unknown}: choose from {list(every)}")
    clock = "wall time" if device.type == "cuda" else "process CPU time"
    if args.parts:
        print(f"{device}: each part's own training-thread CPU time on a logged step")
    else:
        rounds = f"median of {args.rounds} rounds"
        print(f"{device}{' (bf16 autocast)' if BF16 else ''}, {clock}, {rounds}")
    for name in args.case:
        case = every[name]
        if device.type == "cpu":
            torch.set_num_threads(case.threads)
        if args.parts:
            bare, total, spent = parts(case, device)
            print(
                f"\n{case.title}\n  training thread: a bare step {bare * 1e3:.1f} ms, "
                f"a logged step {total * 1e3:.1f} ms"
            )
            for part, seconds in sorted(spent.items(), key=lambda item: -item[1]):
                print(f"  {part:<18} {seconds * 1e3:7.2f} ms  {seconds / bare:6.1%} of a bare step")
            continue
        steps = variants(case, device, args.families)
        times = measure(steps, args.rounds, args.steps, device)
        print(f"\n{case.title}")
        print(f"  {'variant':<18} {'ms/step':>8} {'x bare':>7}  quartiles")
        for variant, (q1, median, q3) in ratios(times).items():
            ms = statistics.median(times[variant]) * 1e3
            print(f"  {variant:<18} {ms:>8.2f} {median:>7.3f}  {q1:.3f}-{q3:.3f}")
        if device.type == "cuda":
            print(f"  host syncs, steps 3-8 (every=3): {syncs_per_step(case, device)}")


if __name__ == "__main__":
    main()
