"""RMSNorm is cheaper than LayerNorm (about 20%; Zhang & Sennrich 2019 report 7%-64% less running
time, depending on the model), per layer and per training step, eager and under
``torch.compile``, on the CPU (2 threads; fewer where torch is limited to fewer).

    python examples/claims/rmsnorm_cost.py [--quick] [--seeds 3] [--rounds 20] [--out DIR]

Per layer: ``nn.LayerNorm`` against ``nn.RMSNorm`` (what ``convert_norms(model, "rmsnorm")``
builds), forward + backward of a (4096, 768) float32 input. Per step: one AdamW step of a
TinyTransformer with LayerNorm against the same model (same init) after
``convert_norms(model, "rmsnorm")``, on a fixed batch. Each is timed eager and compiled (the
layer, the whole model). The four layer calls (two kinds, eager and compiled) run interleaved
in one process, one call each per round in a rotating order, and so do the four models' steps;
a repeat ("seed") is the median of ``--rounds`` rounds, and the table gives mean ± spread over
repeats. ``--quick`` compiles with torch.compile's ``eager`` backend (graph capture only, no
generated kernels) to run in seconds. The verdict names the threads and the machine's load.

Decision rule, fixed before measuring: the claim is about the arithmetic RMSNorm leaves out (the
mean), so it is judged where both layers are kernels generated the same way, under
``torch.compile``; eager torch runs each through its own hand-written CPU kernels (and RMSNorm's
backward as several operations), which compares two implementations. The comparison is the ratio
of RMSNorm's time to LayerNorm's within a repeat (both timed in the same rounds, so a busier
machine slows both). Reproduced when the compiled layers' ratio is below 1 by more than its
spread over repeats and at most 0.9 (a saving of at least half the claimed 20%); contradicted
when above 1 by more than its spread; otherwise (no difference beyond the spread, or a smaller
saving) not reproduced at this scale. In each mode, converting makes training faster (slower)
when the step-time ratio is below (above) 1 by more than its spread.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import cast

import _claims
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import plots
from normprobe.corpus import CharCorpus
from normprobe.models import TinyTransformer

CLAIM = _claims.Claim(
    key="rmsnorm_cost",
    statement="RMSNorm is cheaper than LayerNorm (about 20%)",
    source="Zhang & Sennrich 2019 report 7%-64% less running time, by model",
    setting=(
        "float32 on the CPU; one layer (4096 x 768) forward+backward, and one AdamW step of a "
        "TinyTransformer (width 128, depth 4, 16 x 64 tokens) before and after "
        "convert_norms(model, 'rmsnorm'); eager and torch.compile, interleaved"
    ),
)
KINDS = ("LayerNorm", "RMSNorm")
CLAIMED_SAVING = 0.2  # the saving tested: RMSNorm costs about 20% less than LayerNorm
SMALLEST_REPRODUCING_SAVING = 0.1  # half the claimed one
# --quick only captures graphs: inductor's C++ compile would take it past its few seconds
QUICK_BACKEND = "eager"
MODES = ("eager", "compiled")


def machine() -> str:
    """The threads torch runs on and how busy the machine is: timings depend on both."""
    threads = torch.get_num_threads()
    return (
        f"torch on {threads} thread{'s' * (threads != 1)}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )


def compiled(module: nn.Module, backend: str) -> nn.Module:
    """``module`` under torch.compile for one input shape (no dynamic-shape kernels)."""
    return cast(nn.Module, torch.compile(module, dynamic=False, backend=backend))


def layer_calls(tokens: int, width: int, backend: str) -> dict[str, Callable[[], object]]:
    """Forward + backward of each kind of layer, eager and compiled."""
    x = torch.randn(tokens, width, requires_grad=True)
    grad = torch.randn_like(x)
    built = {"LayerNorm": nn.LayerNorm(width), "RMSNorm": nn.RMSNorm(width)}

    def call(layer: nn.Module) -> Callable[[], object]:
        def run() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(grad)

        return run

    return {
        f"{kind} {mode}": call(compiled(layer, backend) if mode == "compiled" else layer)
        for kind, layer in built.items()
        for mode in MODES
    }


def step_calls(
    width: int, depth: int, context: int, batch: int, backend: str
) -> dict[str, Callable[[], object]]:
    """One AdamW training step of the LayerNorm model and of its RMSNorm conversion, eager and
    compiled (four models from the same init)."""
    corpus = CharCorpus(context=context, seed=0)
    inputs, targets = corpus.batch(batch)
    calls: dict[str, Callable[[], object]] = {}
    for kind in KINDS:
        for mode in MODES:
            torch.manual_seed(0)
            model: nn.Module = TinyTransformer(corpus.vocab_size, width, depth, context=context)
            if kind == "RMSNorm":
                model = normprobe.convert_norms(model, "rmsnorm")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            calls[f"{kind} {mode}"] = train_step(
                compiled(model, backend) if mode == "compiled" else model, opt, inputs, targets
            )
    return calls


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> Callable[[], object]:
    """A call that runs one training step of ``model`` on the batch."""

    def run() -> None:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def repeats(
    calls: dict[str, Callable[[], object]], seeds: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Milliseconds: each call's median per repeat, and every round of the last repeat."""
    medians: dict[str, list[float]] = {name: [] for name in calls}
    last: dict[str, list[float]] = {}
    for repeat in range(seeds):
        seconds = _claims.interleaved(calls, rounds, warmup=3 if repeat == 0 else 1)
        last = {name: [s * 1e3 for s in times] for name, times in seconds.items()}
        for name, times in last.items():
            medians[name].append(statistics.median(times))
    return medians, last


def compare(ms: dict[str, list[float]], mode: str) -> tuple[list[float], str]:
    """RMSNorm's time over LayerNorm's per repeat, and what that says beyond its spread."""
    ln, rms = ms[f"LayerNorm {mode}"], ms[f"RMSNorm {mode}"]
    ratios = [r / n for r, n in zip(rms, ln, strict=True)]
    ratio, spread = _claims.mean_spread(ratios)
    if abs(ratio - 1) <= spread:
        return ratios, f"no different (x{ratio:.2f}, within the spread)"
    return ratios, f"{1 - ratio:.0%} cheaper" if ratio < 1 else f"{ratio:.2f}x slower"


def step_effect(ms: dict[str, list[float]], mode: str) -> str:
    ratios, said = compare(ms, mode)
    ratio = statistics.fmean(ratios)
    if said.startswith("no different"):
        return f"neither faster nor slower {mode} (x{ratio:.2f}, within the spread)"
    return f"{'faster' if ratio < 1 else 'slower'} {mode} (a step takes x{ratio:.2f})"


def judge(
    layer_ms: dict[str, list[float]], step_ms: dict[str, list[float]], timed_on: str
) -> tuple[_claims.Verdict, str]:
    """The verdict by the rule in the docstring, and why."""
    ratios, said = compare(layer_ms, "compiled")
    ratio = statistics.fmean(ratios)
    verdict: _claims.Verdict
    if said.startswith("no different"):
        verdict = "not reproduced at this scale"
        found = f"compiled, RMSNorm's layer time is within the spread of LayerNorm's (x{ratio:.2f})"
    elif ratio < 1:
        saving = 1 - ratio
        verdict = (
            "reproduced"
            if saving >= SMALLEST_REPRODUCING_SAVING
            else "not reproduced at this scale"
        )
        found = (
            f"compiled, an RMSNorm layer costs {saving:.0%} less than a LayerNorm "
            f"({_claims.fmt(ratios, 3)} of its time)"
        )
    else:
        verdict = "contradicted"
        found = f"compiled, an RMSNorm layer takes x{ratio:.2f} a LayerNorm's time"
    _, eager_said = compare(layer_ms, "eager")
    eager = f"eager, nn.RMSNorm is {eager_said} with torch {torch.__version__} on this CPU"
    ms = {name: statistics.fmean(times) for name, times in layer_ms.items()}
    fastest = ", ".join(
        f"the fastest {kind} takes {min(ms[f'{kind} {mode}'] for mode in MODES):.3g} ms"
        for kind in KINDS
    )
    converting = (
        f"convert_norms(model, 'rmsnorm') makes training {step_effect(step_ms, 'eager')} and "
        f"{step_effect(step_ms, 'compiled')}"
    )
    return (
        verdict,
        f"{found}, the claim is about {CLAIMED_SAVING:.0%}; {eager}; {fastest}. "
        f"{converting} ({timed_on}).",
    )


def main() -> None:
    parser = _claims.options(CLAIM)
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per repeat")
    args = parser.parse_args()
    _claims.torch_threads()
    tokens, width = (512, 256) if args.quick else (4096, 768)
    model_size = (
        dict(width=64, depth=2, context=32, batch=4)
        if args.quick
        else dict(width=128, depth=4, context=64, batch=16)
    )
    rounds = 3 if args.quick else args.rounds
    backend = QUICK_BACKEND if args.quick else "inductor"
    layer_ms, layer_rounds = repeats(layer_calls(tokens, width, backend), args.seeds, rounds)
    step_ms, step_rounds = repeats(step_calls(**model_size, backend=backend), args.seeds, rounds)

    rows: list[list[str]] = []
    numbers: dict[str, object] = {}
    for what, ms in (("layer", layer_ms), ("step", step_ms)):
        label = (
            f"one layer ({tokens} x {width})"
            if what == "layer"
            else f"training step (width {model_size['width']}, depth {model_size['depth']})"
        )
        for mode in MODES:
            ratios, said = compare(ms, mode)
            ln, rms = ms[f"LayerNorm {mode}"], ms[f"RMSNorm {mode}"]
            rows.append(
                [label, mode, _claims.fmt(ln, 3), _claims.fmt(rms, 3), _claims.fmt(ratios, 3), said]
            )
            numbers[f"{what}_{mode}_ms"] = {
                "LayerNorm": _claims.mean_spread(ln)[0],
                "RMSNorm": _claims.mean_spread(rms)[0],
            }
            numbers[f"{what}_{mode}_ratio"] = statistics.fmean(ratios)

    timed_on = machine()
    numbers["timed_on"] = timed_on
    verdict, why = judge(layer_ms, step_ms, timed_on)
    result = _claims.Result(
        CLAIM,
        ["measured", "mode", "LayerNorm ms", "RMSNorm ms", "RMSNorm / LayerNorm", "RMSNorm is"],
        rows,
        verdict,
        why,
        numbers,
        args.quick,
    )
    _claims.finish(result, args.out, panels(layer_ms, step_ms, layer_rounds, step_rounds))


def panels(
    layer_ms: dict[str, list[float]],
    step_ms: dict[str, list[float]],
    layer_rounds: dict[str, list[float]],
    step_rounds: dict[str, list[float]],
) -> list[plots.Panel]:
    ticks = [(float(i), mode) for i, mode in enumerate(MODES)]

    def by_mode(ms: dict[str, list[float]]) -> list[plots.Line]:
        return [
            plots.Line(
                kind,
                [(float(i), statistics.fmean(ms[f"{kind} {m}"])) for i, m in enumerate(MODES)],
                plots.PALETTE[k],
            )
            for k, kind in enumerate(KINDS)
        ]

    def by_round(ms: dict[str, list[float]]) -> list[plots.Line]:
        return [
            plots.Line(name, [(float(r), t) for r, t in enumerate(times)], plots.PALETTE[i])
            for i, (name, times) in enumerate(ms.items())
        ]

    return [
        plots.Panel("one layer, forward+backward", by_mode(layer_ms), "", "ms", ticks),
        plots.Panel("one training step", by_mode(step_ms), "", "ms", ticks),
        plots.Panel(
            "one layer, each round of the last repeat", by_round(layer_rounds), "round", "ms"
        ),
        plots.Panel(
            "training step, each round of the last repeat", by_round(step_rounds), "round", "ms"
        ),
    ]


if __name__ == "__main__":
    main()
