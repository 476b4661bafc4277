"""What the probe costs a training step, against a bare step and the hooks people write today.

    python benchmarks/overhead.py [--rounds 7] [--steps 10] [--device cuda] [--bf16]

For each model, every variant trains its own copy of the same weights; the variants take turns
(interleaved rounds, in one process) so that machine noise hits them alike. Prints the median
time per step and its ratio to the bare step.

Variants:
  bare           the training step alone
  every=50       normprobe.attach(..., every=50), all metrics, the spike detector on (the
                 default; the loop hands it the loss with probe.observe_loss)
  no spikes      the same with spikes=None
  every=1        normprobe.attach(..., every=1), all metrics on every step
  every=50 avg   every=50 with its logged step spread over the 50 steps: every=50 + (every=1 -
                 every=50) / 50 (derived: the median of the rounds leaves out the rare round
                 that holds a logged step, so every=50 alone is what an unlogged step costs)
  naive hooks    a forward hook on every module logging the output RMS with .item()
  lightning      lightning's grad_norm() utility every step, values logged as floats

On CUDA it also counts the host syncs of each step of a probe logging every 3rd step, with
``torch.cuda.set_sync_debug_mode``: one (the transfer) on a logged step, none otherwise.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import normprobe
from normprobe.models import ResidualStack, TinyTransformer

Step = Callable[[], None]
BF16 = False  # forward under bf16 autocast (--bf16)


def _trainer(model: nn.Module, batch: torch.Tensor, loss: Callable[[nn.Module], Any]) -> Step:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probe: list[normprobe.Probe] = []  # the probe a variant attaches, handed the loss

    def step() -> None:
        with torch.autocast(batch.device.type, torch.bfloat16, enabled=BF16):
            value = loss(model)
        for p in probe:
            p.observe_loss(value)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.opt = opt  # type: ignore[attr-defined]
    step.probe = probe  # type: ignore[attr-defined]
    return step


def _naive_hooks(model: nn.Module) -> dict[str, float]:
    logged: dict[str, float] = {}
    for name, module in model.named_modules():

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                logged[name] = out.detach().float().pow(2).mean().sqrt().item()

        module.register_forward_hook(hook)
    return logged


def variants(
    make: Callable[[], nn.Module], batch: torch.Tensor, loss: Callable[[nn.Module], Any]
) -> dict[str, Step]:
    from lightning.pytorch.utilities import grad_norm

    base = make().to(batch.device)
    out: dict[str, Step] = {}
    out["bare"] = _trainer(copy.deepcopy(base), batch, loss)
    for name, every, spikes in (
        ("every=50", 50, normprobe.Spikes()),
        ("no spikes", 50, None),
        ("every=1", 1, normprobe.Spikes()),
    ):
        model = copy.deepcopy(base)
        step = _trainer(model, batch, loss)
        log_dir = tempfile.mkdtemp(prefix="normprobe-bench-")
        opt = step.opt  # type: ignore[attr-defined]
        probe = normprobe.attach(model, opt, log_dir=log_dir, every=every, spikes=spikes)
        step.probe.append(probe)  # type: ignore[attr-defined]
        out[name] = step
    naive = copy.deepcopy(base)
    _naive_hooks(naive)
    out["naive hooks"] = _trainer(naive, batch, loss)
    lit = copy.deepcopy(base)
    opt = torch.optim.AdamW(lit.parameters(), lr=1e-4)

    def lightning_step() -> None:
        with torch.autocast(batch.device.type, torch.bfloat16, enabled=BF16):
            value = loss(lit)
        value.backward()
        logged = {k: float(v) for k, v in grad_norm(lit, norm_type=2).items()}
        assert logged
        opt.step()
        opt.zero_grad(set_to_none=True)

    out["lightning"] = lightning_step
    return out


def measure(
    steps: dict[str, Step], rounds: int, per_round: int, device: torch.device
) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():  # warm-up, and lazy discovery on the first forward
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            sync()
            times[name].append((time.perf_counter() - start) / per_round)
    return {name: statistics.median(t) for name, t in times.items()}


def syncs_per_step(
    make: Callable[[], nn.Module], batch: torch.Tensor, loss: Callable[[nn.Module], Any]
) -> list[int]:
    """Host syncs of steps 2..7 of a probe logging every 3rd step (CUDA only)."""
    model = make().to(batch.device)
    step = _trainer(model, batch, loss)
    probe = normprobe.attach(model, step.opt, log_dir=tempfile.mkdtemp(), every=3)  # type: ignore[attr-defined]
    step.probe.append(probe)  # type: ignore[attr-defined]
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast")
    args = parser.parse_args()
    global BF16
    BF16 = args.bf16
    device = torch.device(args.device)
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (8, 128), device=device)
    rows = torch.randn(1024, 64, device=device)
    cases: dict[str, tuple[Callable[[], nn.Module], torch.Tensor, Callable[[nn.Module], Any]]] = {
        "GPT-2-style, 12 blocks, width 256, 8x128 tokens": (
            lambda: TinyTransformer(width=256, depth=12, context=128),
            tokens,
            lambda m: m.loss(tokens, tokens),
        ),
        "ResidualStack, 48 blocks, width 64, 1024 rows": (
            lambda: ResidualStack(48, 64),
            rows,
            lambda m: m(rows).pow(2).mean(),
        ),
    }
    print(f"{device}{' (bf16 autocast)' if BF16 else ''}")
    for title, (make, batch, loss) in cases.items():
        result = measure(variants(make, batch, loss), args.rounds, args.steps, device)
        unlogged, logged = result["every=50"], result["every=1"]
        result["every=50 avg"] = unlogged + (logged - unlogged) / 50
        bare = result["bare"]
        print(f"\n{title}")
        print(f"  {'variant':<13} {'ms/step':>8} {'x bare':>7}")
        for name, seconds in result.items():
            print(f"  {name:<13} {seconds * 1e3:>8.2f} {seconds / bare:>7.3f}")
        if device.type == "cuda":
            print(f"  host syncs, steps 2-7 (every=3): {syncs_per_step(make, batch, loss)}")


if __name__ == "__main__":
    main()
