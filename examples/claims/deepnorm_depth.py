"""DeepNorm lets Post-LN go deep (Wang et al. 2022).

    python examples/claims/deepnorm_depth.py [--quick] [--seeds 3] [--lr 2e-3] [--steps 150]

`TinyTransformer` stacks of 6, 12, 24 and 48 blocks (width 32, 4 heads, context 32) are trained on
the built-in character corpus with AdamW (batch 8, no warmup) as Post-LN, as Post-LN
re-initialized by ``normprobe.reinit(model, "deepnorm", ...)`` (Xavier gains beta = (8N)^(-1/4)
on the branches, and alpha = (2N)^(1/4) on the skip realized as a fixed 1/alpha scale on each
branch, the same function since a LayerNorm follows the add), and as Pre-LN, from the same seeds.
The probe (``metrics=["grad_norm"]``) logs ``grad_ratio/blocks``, the last block's gradient norm
over the first block's, at step 0 (the initialization) and at the last step.

A run *fails* when its loss turns non-finite, its final loss (mean of the last 10 steps) is above
its first step's (diverged), or it is not below the corpus's unigram entropy (stuck: it learned
the character frequencies and nothing from the context). A variant *breaks* at a depth when most
of its seeds fail there.

Decision rule, fixed before measuring:

* reproduced: Post-LN breaks at some depth, and DeepNorm fails no seed at any depth;
* contradicted: DeepNorm breaks at a depth where Post-LN does not;
* otherwise not reproduced at this scale (Post-LN trains at every depth, or DeepNorm fails too).

Pre-LN is the reference and is not judged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import _claims
import torch

from normprobe import plots, tags
from normprobe.corpus import CharCorpus

CLAIM = _claims.Claim(
    key="deepnorm_depth",
    statement="DeepNorm lets Post-LN go deep",
    source="Wang et al. 2022",
    setting="",
)
VARIANTS = ("Post-LN", "DeepNorm", "Pre-LN")


@dataclass(frozen=True)
class Size:
    depths: tuple[int, ...]
    width: int
    heads: int
    context: int
    batch: int
    steps: int


FULL = Size(depths=(6, 12, 24, 48), width=32, heads=4, context=32, batch=8, steps=150)
QUICK = Size(depths=(2, 4), width=16, heads=2, context=16, batch=4, steps=12)


@dataclass
class Runs:
    """One variant at one depth, over the seeds."""

    first: list[float]
    final: list[float]
    ratio_at_init: list[float]
    ratio_at_end: list[float]
    losses: list[list[float]]

    def failed(self, unigram: float) -> list[bool]:
        return [
            not (math.isfinite(final) and final <= first and final < unigram)
            for first, final in zip(self.first, self.final, strict=True)
        ]

    def breaks(self, unigram: float) -> bool:
        return sum(self.failed(unigram)) > len(self.final) / 2


def train(variant: str, depth: int, size: Size, lr: float, seeds: int, vocab: int) -> Runs:
    runs = Runs([], [], [], [], [])
    ratio_tag = tags.format("grad_ratio", "blocks")
    for seed in range(seeds):
        torch.manual_seed(seed)
        trained = _claims.train_char_lm(
            _claims.placed_transformer(variant, vocab, size.width, depth, size.heads, size.context),
            steps=size.steps,
            lr=lr,
            seed=seed,
            batch=size.batch,
            context=size.context,
            probe_every=size.steps - 1,  # logs the first step and the last
            metrics=["grad_norm"],
        )
        ratios = dict(trained.series(ratio_tag))
        runs.first.append(trained.losses[0])
        runs.final.append(trained.final_loss())
        runs.ratio_at_init.append(ratios[0])
        runs.ratio_at_end.append(ratios[size.steps - 1])
        runs.losses.append(trained.losses)
    return runs


def verdict(
    found: dict[tuple[str, int], Runs], depths: tuple[int, ...], unigram: float
) -> tuple[_claims.Verdict, str]:
    """The rule of the module docstring."""
    post_breaks = [d for d in depths if found["Post-LN", d].breaks(unigram)]
    deepnorm_breaks = [d for d in depths if found["DeepNorm", d].breaks(unigram)]
    deepnorm_failed = {d: sum(found["DeepNorm", d].failed(unigram)) for d in depths}
    why = (
        f"Post-LN breaks at depths {post_breaks or 'none'}; DeepNorm's failed seeds per depth "
        f"{deepnorm_failed}"
    )
    if any(d not in post_breaks for d in deepnorm_breaks):
        return "contradicted", why + ": DeepNorm breaks where plain Post-LN trains"
    if post_breaks and not any(deepnorm_failed.values()):
        return "reproduced", why
    if not post_breaks:
        return "not reproduced at this scale", why + ": Post-LN trains at every depth here"
    return "not reproduced at this scale", why + ": DeepNorm fails too"


def depth_line(variant: str, values: dict[int, list[float]], color: plots.RGB) -> plots.Line:
    """Mean over the seeds' finite values at each depth."""
    points = [(float(d), _claims.mean_spread(v)[0]) for d, v in values.items()]
    return plots.Line(variant, points, color)


def main() -> None:
    parser = _claims.options(CLAIM)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--steps", type=int, help=f"training steps (default {FULL.steps})")
    args = parser.parse_args()
    _claims.torch_threads()
    size = QUICK if args.quick else FULL
    if args.steps:
        size = replace(size, steps=args.steps)
    corpus = CharCorpus(context=size.context)
    unigram = _claims.unigram_entropy()

    found = {
        (variant, depth): train(variant, depth, size, args.lr, args.seeds, corpus.vocab_size)
        for depth in size.depths
        for variant in VARIANTS
    }
    rows = [
        [
            str(depth),
            variant,
            _claims.fmt(runs.final),
            f"{sum(runs.failed(unigram))}/{len(runs.final)}",
            _claims.fmt(runs.ratio_at_init, 3),
            _claims.fmt(runs.ratio_at_end, 3),
        ]
        for (variant, depth), runs in found.items()
    ]
    chosen, why = verdict(found, size.depths, unigram)
    colors = dict(zip(VARIANTS, plots.PALETTE, strict=False))
    ticks = [(float(d), str(d)) for d in size.depths]

    def over_depth(title: str, ylabel: str, pick: Callable[[Runs], list[float]]) -> plots.Panel:
        lines = [
            depth_line(v, {d: pick(found[v, d]) for d in size.depths}, colors[v]) for v in VARIANTS
        ]
        return plots.Panel(title, lines, "blocks", ylabel, xticks=ticks, xlog=True)

    deepest = size.depths[-1]
    panels = [
        over_depth("Final loss (mean of seeds)", "loss", lambda r: r.final),
        plots.Panel(
            f"Loss at {deepest} blocks (mean of seeds, running mean of 10)",
            _claims.curve_lines({v: found[v, deepest].losses for v in VARIANTS}),
            "step",
            "loss",
        ),
        over_depth(
            "Gradient ratio at init", "grad_ratio/blocks, last / first", lambda r: r.ratio_at_init
        ),
        over_depth(
            "Gradient ratio at the last step", "grad_ratio/blocks", lambda r: r.ratio_at_end
        ),
    ]
    setting = (
        f"TinyTransformer width {size.width}, {size.heads} heads, depths "
        f"{', '.join(map(str, size.depths))}, char corpus (context {size.context}, batch "
        f"{size.batch}), AdamW lr {args.lr:g}, no warmup, {size.steps} steps, {args.seeds} seeds; "
        f"DeepNorm = Post-LN + reinit('deepnorm'); failed = NaN, final loss above the first, or "
        f"not below the unigram entropy {unigram:.3f}"
    )
    numbers: dict[str, object] = {
        "lr": args.lr,
        "steps": size.steps,
        "unigram_entropy": unigram,
        **{
            f"{variant} {depth}": {
                "final_loss": _claims.mean_spread(runs.final),
                "failed": sum(runs.failed(unigram)),
                "grad_ratio_init": _claims.mean_spread(runs.ratio_at_init),
                "grad_ratio_end": _claims.mean_spread(runs.ratio_at_end),
            }
            for (variant, depth), runs in found.items()
        },
    }
    result = _claims.Result(
        replace(CLAIM, setting=setting),
        ["blocks", "variant", "final loss", "failed", "grad ratio at init", "grad ratio at end"],
        rows,
        chosen,
        why,
        numbers,
        quick=args.quick,
    )
    _claims.finish(result, args.out, panels)


if __name__ == "__main__":
    main()
