"""`normprobe.HYBRIDNORM` (LayerNorm right after attention, RMSNorm everywhere else) trains as well
as LayerNorm-only, at less cost.

    python examples/claims/hybridnorm.py [--quick] [--seeds 3] [--steps 500] [--rounds 20]
                                         [--out DIR]

Three versions of one Pre-LN TinyTransformer, from the same init per seed: LayerNorm-only (as
built), RMSNorm-only (``convert_norms(model, "rmsnorm")``) and HybridNorm
(``convert_norms(model, normprobe.HYBRIDNORM, example_inputs=...)``: the norm the attention
output meets first, each block's ``ln_2``, stays a LayerNorm). Each trains on the built-in
corpus with AdamW; its final loss is the mean loss of the last 20 steps. Step time: one AdamW
step on a fixed batch, the three models eager and compiled (six calls) interleaved in rounds as
in ``rmsnorm_cost.py``, the median of ``--rounds`` rounds per repeat, one repeat per seed
(``--quick`` compiles with the ``eager`` backend, as there).

Decision rule, fixed before measuring: contradicted when HybridNorm's final loss is above
LayerNorm-only's by more than both seed spreads, or its compiled step is slower than
LayerNorm-only's by more than the spread of the ratio; reproduced when its loss is not worse
that way and its compiled step is faster by more than the spread; otherwise not reproduced at
this scale. Cost is judged compiled, as in ``rmsnorm_cost.py`` (eager torch runs LayerNorm and
RMSNorm through different hand-written CPU kernels); the eager step is reported beside it.

The policy mixes norm kinds by position and is named after HybridNorm (Zhuo et al. 2025,
"HybridNorm: Towards Stable and Efficient Transformer Training via Hybrid Normalization"), whose
block mixes placements instead (QKV normalization in attention, Post-Norm in the FFN); that block
is not what is measured here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import _claims
import torch
from rmsnorm_cost import QUICK_BACKEND, compiled, machine, train_step
from torch import nn

import normprobe
from normprobe import plots
from normprobe.corpus import CharCorpus
from normprobe.models import TinyTransformer

CLAIM = _claims.Claim(
    key="hybridnorm",
    statement=(
        "HybridNorm (LayerNorm after attention, RMSNorm elsewhere) trains as well as "
        "LayerNorm-only at less cost"
    ),
    source="a mixed-kind reading of Zhuo et al. 2025, HybridNorm",
    setting=(
        "Pre-LN TinyTransformer (width 64, depth 4, context 32), AdamW lr 1e-3, batch 16, "
        "built-in corpus; step time on the CPU, eager and torch.compile, interleaved"
    ),
)
VARIANTS = ("LayerNorm-only", "RMSNorm-only", "HybridNorm")
MODES = ("eager", "compiled")
LR = 1e-3
LAST = 20  # steps averaged into the final loss


def build(variant: str, seed: int, depth: int, context: int) -> nn.Module:
    """The model of ``variant``; the same init for a seed whatever the variant."""
    vocab = CharCorpus(context=context).vocab_size
    torch.manual_seed(seed)
    model = TinyTransformer(vocab, width=64, depth=depth, context=context)
    if variant == "RMSNorm-only":
        return normprobe.convert_norms(model, "rmsnorm")
    if variant == "HybridNorm":
        example = torch.zeros(1, context, dtype=torch.long)
        return normprobe.convert_norms(model, normprobe.HYBRIDNORM, example_inputs=(example,))
    return model


def step_calls(
    depth: int, context: int, batch: int, backend: str
) -> dict[str, Callable[[], object]]:
    """One AdamW step of each variant, eager and compiled, on one fixed batch."""
    inputs, targets = CharCorpus(context=context, seed=0).batch(batch)
    calls: dict[str, Callable[[], object]] = {}
    for variant in VARIANTS:
        for mode in MODES:
            model = build(variant, 0, depth, context)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            run = compiled(model, backend) if mode == "compiled" else model
            calls[f"{variant} {mode}"] = train_step(run, opt, inputs, targets)
    return calls


def main() -> None:
    parser = _claims.options(CLAIM)
    parser.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per repeat")
    args = parser.parse_args()
    _claims.torch_threads()
    depth, context, batch = (2, 16, 4) if args.quick else (4, 32, 16)
    steps = 30 if args.quick else args.steps
    rounds = 3 if args.quick else args.rounds

    losses: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    final: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for seed in range(args.seeds):
        for variant in VARIANTS:
            model = build(variant, seed, depth, context)
            run = _claims.train_char_lm(
                model, steps=steps, lr=LR, seed=seed, batch=batch, context=context
            )
            losses[variant].append(run.losses)
            final[variant].append(run.final_loss(LAST))

    calls = step_calls(depth, context, batch, QUICK_BACKEND if args.quick else "inductor")
    step_ms: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(args.seeds):
        seconds = _claims.interleaved(calls, rounds, warmup=3 if repeat == 0 else 1)
        for name, times in seconds.items():
            step_ms[name].append(statistics.median(times) * 1e3)
    timed_on = machine()

    ratios = {
        (variant, mode): [
            t / base
            for t, base in zip(
                step_ms[f"{variant} {mode}"], step_ms[f"LayerNorm-only {mode}"], strict=True
            )
        ]
        for variant in VARIANTS
        for mode in MODES
    }
    rows = [
        [
            variant,
            _claims.fmt(final[variant]),
            *(
                f"{_claims.fmt(step_ms[f'{variant} {mode}'], 3)} "
                f"(x{statistics.fmean(ratios[variant, mode]):.2f})"
                for mode in MODES
            ),
        ]
        for variant in VARIANTS
    ]
    verdict, why = judge(final, ratios, timed_on)
    numbers = {
        "final_loss": {v: _claims.mean_spread(final[v]) for v in VARIANTS},
        "step_ms": {name: _claims.mean_spread(ms)[0] for name, ms in step_ms.items()},
        "step_ratio_to_layernorm": {
            f"{v} {m}": statistics.fmean(r) for (v, m), r in ratios.items()
        },
        "timed_on": timed_on,
    }
    result = _claims.Result(
        CLAIM,
        ["norms", f"final loss ({args.seeds} seeds)", "step eager ms", "step compiled ms"],
        rows,
        verdict,
        why,
        numbers,
        args.quick,
    )
    _claims.finish(result, args.out, panels(losses, final, step_ms))


def judge(
    final: dict[str, list[float]], ratios: dict[tuple[str, str], list[float]], timed_on: str
) -> tuple[_claims.Verdict, str]:
    """The verdict by the rule in the docstring, and why."""
    hybrid, layernorm, rmsnorm = final["HybridNorm"], final["LayerNorm-only"], final["RMSNorm-only"]
    loss_worse = _claims.apart(hybrid, layernorm) and statistics.fmean(hybrid) > statistics.fmean(
        layernorm
    )
    speed = {mode: _claims.mean_spread(ratios["HybridNorm", mode]) for mode in MODES}
    ratio, spread = speed["compiled"]
    faster, slower = ratio < 1 - spread, ratio > 1 + spread

    def vs(other: list[float], name: str) -> str:
        gap = statistics.fmean(hybrid) - statistics.fmean(other)
        inside = "" if _claims.apart(hybrid, other) else ", inside the seed spread"
        return f"{gap:+.3f} against {name}{inside}"

    loss_text = (
        f"HybridNorm's final loss is {_claims.fmt(hybrid)}: {vs(layernorm, 'LayerNorm-only')}, "
        f"{vs(rmsnorm, 'RMSNorm-only')}"
    )
    cost_text = (
        ", ".join(f"{mode} x{r:.2f} ± {s:.2g}" for mode, (r, s) in speed.items())
        + f" of LayerNorm-only's step time ({timed_on})"
    )
    verdict: _claims.Verdict
    if loss_worse or slower:
        verdict = "contradicted"
        found = "HybridNorm " + " and ".join(
            what
            for what, happened in (
                ("trains to a worse loss than LayerNorm-only", loss_worse),
                (f"steps {ratio - 1:.0%} slower than LayerNorm-only compiled", slower),
            )
            if happened
        )
    elif faster:
        verdict = "reproduced"
        found = f"HybridNorm keeps LayerNorm-only's loss and steps {1 - ratio:.0%} faster compiled"
    else:
        verdict = "not reproduced at this scale"
        found = (
            "HybridNorm keeps LayerNorm-only's loss, but its compiled step is not faster beyond "
            "the spread"
        )
    return verdict, f"{found}. {loss_text}; step time {cost_text}."


def panels(
    losses: dict[str, list[list[float]]],
    final: dict[str, list[float]],
    step_ms: dict[str, list[float]],
) -> list[plots.Panel]:
    ticks = [(float(i), v) for i, v in enumerate(VARIANTS)]
    seeds = len(next(iter(final.values())))
    per_seed = [
        plots.Line(
            f"seed {s}",
            [(float(i), final[v][s]) for i, v in enumerate(VARIANTS)],
            plots.ramp(s, seeds),
        )
        for s in range(seeds)
    ]
    step_lines = [
        plots.Line(
            mode,
            [(float(i), statistics.fmean(step_ms[f"{v} {mode}"])) for i, v in enumerate(VARIANTS)],
            plots.PALETTE[m],
        )
        for m, mode in enumerate(MODES)
    ]
    return [
        plots.Panel("training loss (mean of seeds)", _claims.curve_lines(losses), "step", "loss"),
        plots.Panel(f"final loss (last {LAST} steps)", per_seed, "", "loss", ticks),
        plots.Panel("training step time", step_lines, "", "ms", ticks),
    ]


if __name__ == "__main__":
    main()
