"""Post-LN needs learning-rate warmup; Pre-LN does not (Xiong et al. 2020).

    python examples/claims/post_ln_warmup.py [--quick] [--seeds 3] [--lr 3e-3] [--steps 400]

One `TinyTransformer` (width 64, 6 blocks, 4 heads, context 32) is trained on the built-in
character corpus with AdamW (batch 16) at one learning rate, Pre-LN and Post-LN, with a linear
warmup over the first quarter of the steps and without, from the same seeds. The probe
(``metrics=["grad_norm"]``) logs ``grad_ratio/blocks``, the last block's gradient norm over the
first block's, at step 0 (the initialization) and every 25 steps after.

Decision rule, fixed before measuring (final loss: the mean of the last 20 steps; "apart": the
means differ by more than the two spreads together, `_claims.apart`):

* reproduced: Post-LN without warmup ends higher than with it, apart, while Pre-LN without
  warmup does not end apart above Pre-LN with warmup;
* contradicted: Post-LN without warmup ends apart below Post-LN with warmup, or Pre-LN without
  warmup ends apart above its warmed-up run by more than Post-LN does above its own;
* otherwise not reproduced at this scale.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import _claims
import torch

from normprobe import plots, tags
from normprobe.corpus import CharCorpus
from normprobe.models import Placement, TinyTransformer

CLAIM = _claims.Claim(
    key="post_ln_warmup",
    statement="Post-LN needs learning-rate warmup; Pre-LN does not",
    source="Xiong et al. 2020",
    setting="",
)
PROBE_EVERY = 25
FINAL_STEPS = 20


FULL = _claims.Size(width=64, depth=6, heads=4, context=32, batch=16, steps=400)
QUICK = _claims.Size(width=16, depth=2, heads=2, context=16, batch=4, steps=30)
PLACEMENTS: dict[str, Placement] = {"Post-LN": "post", "Pre-LN": "pre"}


@dataclass
class Runs:
    """One setting's runs over the seeds."""

    label: str
    final: list[float]
    losses: list[list[float]]
    ratio_at_init: list[float]
    ratio_at_end: list[float]
    ratio_series: list[list[tuple[int, float]]]


def train(
    size: _claims.Size, placement: Placement, warmup: int, lr: float, seeds: int, label: str
) -> Runs:
    vocab = CharCorpus(context=size.context).vocab_size
    runs = Runs(label, [], [], [], [], [])
    ratio_tag = tags.format("grad_ratio", "blocks")
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = TinyTransformer(
            vocab, size.width, size.depth, size.heads, size.context, placement=placement
        )
        trained = _claims.train_char_lm(
            model,
            steps=size.steps,
            lr=lr,
            seed=seed,
            batch=size.batch,
            context=size.context,
            warmup=warmup,
            probe_every=PROBE_EVERY,
            metrics=["grad_norm"],
        )
        ratios = trained.series(ratio_tag)
        runs.final.append(trained.final_loss(FINAL_STEPS))
        runs.losses.append(trained.losses)
        runs.ratio_at_init.append(ratios[0][1])
        runs.ratio_at_end.append(ratios[-1][1])
        runs.ratio_series.append(ratios)
    return runs


def mean_ratio_line(runs: Runs, color: plots.RGB) -> plots.Line:
    """The mean over seeds of the gradient ratio at every step all seeds logged (a gradient
    spike makes the probe log extra steps in one run only)."""
    per_step: dict[int, list[float]] = {}
    for series in runs.ratio_series:
        for step, value in series:
            per_step.setdefault(step, []).append(value)
    points = [
        (float(step), statistics.fmean(values))
        for step, values in sorted(per_step.items())
        if len(values) == len(runs.ratio_series)
    ]
    return plots.Line(runs.label, points, color)


def verdict(post: tuple[Runs, Runs], pre: tuple[Runs, Runs]) -> tuple[_claims.Verdict, str]:
    """The rule of the module docstring; each pair is (without warmup, with warmup)."""

    def cost(pair: tuple[Runs, Runs]) -> tuple[float, bool]:
        """How much higher the final loss ends without warmup, and whether that is apart."""
        without, warmed = (_claims.mean_spread(r.final)[0] for r in pair)
        return without - warmed, _claims.apart(pair[0].final, pair[1].final)

    (post_cost, post_apart), (pre_cost, pre_apart) = cost(post), cost(pre)
    why = (
        f"final loss without warmup minus with: Post-LN {post_cost:+.3f} "
        f"({'apart' if post_apart else 'within the spreads'}), Pre-LN {pre_cost:+.3f} "
        f"({'apart' if pre_apart else 'within the spreads'})"
    )
    pre_needs = pre_apart and pre_cost > 0
    if (post_apart and post_cost < 0) or (pre_needs and pre_cost > post_cost):
        return "contradicted", why
    if post_apart and post_cost > 0 and not pre_needs:
        return "reproduced", why
    if post_apart and post_cost > 0:
        return "not reproduced at this scale", why + ": Pre-LN needs warmup here too, if less"
    return (
        "not reproduced at this scale",
        why + ": Post-LN does not end apart above its warmed-up run",
    )


def main() -> None:
    parser = _claims.options(CLAIM)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--steps", type=int, help=f"training steps (default {FULL.steps})")
    args = parser.parse_args()
    _claims.torch_threads()
    size = QUICK if args.quick else FULL
    if args.steps:
        size = replace(size, steps=args.steps)
    warmup = size.steps // 4

    without = {
        name: train(size, placement, 0, args.lr, args.seeds, f"{name}, no warmup")
        for name, placement in PLACEMENTS.items()
    }
    warmed = {
        name: train(size, placement, warmup, args.lr, args.seeds, f"{name}, warmup {warmup}")
        for name, placement in PLACEMENTS.items()
    }
    every = [r for name in PLACEMENTS for r in (without[name], warmed[name])]

    rows = [
        [r.label, _claims.fmt(r.final), _claims.fmt(r.ratio_at_init), _claims.fmt(r.ratio_at_end)]
        for r in every
    ]
    chosen, why = verdict(
        (without["Post-LN"], warmed["Post-LN"]), (without["Pre-LN"], warmed["Pre-LN"])
    )
    colors = dict(zip((r.label for r in every), plots.PALETTE, strict=False))
    panels = [
        plots.Panel(
            "Loss (mean of seeds, running mean of 10)",
            _claims.curve_lines({r.label: r.losses for r in every}),
            xlabel="step",
            ylabel="loss",
        ),
        plots.Panel(
            "Gradient ratio, last / first block",
            [mean_ratio_line(r, colors[r.label]) for r in every],
            xlabel="step",
            ylabel="grad_ratio/blocks (mean of seeds)",
        ),
    ]
    setting = (
        f"TinyTransformer width {size.width}, {size.depth} blocks, {size.heads} heads, char corpus "
        f"(context {size.context}, batch {size.batch}), AdamW lr {args.lr:g}, {size.steps} steps, "
        f"linear warmup over {warmup} steps or none, {args.seeds} seeds; final loss = mean of the "
        f"last {FINAL_STEPS} steps; grad ratio = the probe's grad_ratio/blocks (last / first "
        f"block) at step 0 and at the last logged step (every {PROBE_EVERY})"
    )
    numbers: dict[str, object] = {
        "lr": args.lr,
        "steps": size.steps,
        "warmup": warmup,
        **{
            r.label: {
                "final_loss": _claims.mean_spread(r.final),
                "grad_ratio_init": _claims.mean_spread(r.ratio_at_init),
                "grad_ratio_end": _claims.mean_spread(r.ratio_at_end),
            }
            for r in every
        },
    }
    result = _claims.Result(
        replace(CLAIM, setting=setting),
        ["setting", "final loss", "grad ratio at init", "grad ratio at end"],
        rows,
        chosen,
        why,
        numbers,
        quick=args.quick,
    )
    _claims.finish(result, args.out, panels)


if __name__ == "__main__":
    main()
