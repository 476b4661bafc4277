"""Pre-LN's representation collapse: deep Pre-LN blocks barely change the stream (Xie et al. 2023,
"ResiDual: Transformer with Dual Residual Connections").

    python examples/claims/representation_collapse.py [--quick] [--seeds 3] [--steps 300]

A 24-block `TinyTransformer` (width 32, 4 heads, context 32) is trained on the built-in character
corpus with AdamW (lr 1e-3, batch 16, linear warmup over the first sixth of the steps) as Pre-LN,
as Post-LN, and as Post-LN re-initialized by ``normprobe.reinit(model, "deepnorm")``, from the
same seeds. The probe (``metrics=["resid_rms", "resid_cos"]``) reads, at the first step and at the
last, ``resid_cos``, the cosine between consecutive blocks' residual streams (averaged over
positions; near 1: the block changed little), and ``resid_rms``/``resid_growth``, the stream's RMS
after each block and its last / first ratio. "Deeper-half cosine": the mean ``resid_cos`` over
the upper half of the blocks but the last (in Post-LN the last block's norm is also the final
norm, which the head trains, unlike Pre-LN's separate final norm).

Decision rule ("apart": the means differ by more than the two spreads together,
`_claims.apart`):

* reproduced: after training, Pre-LN's deeper-half cosine is apart above Post-LN's, and so is
  its residual growth (the stream growing with depth is why each block's share shrinks);
* contradicted: Post-LN's deeper-half cosine is apart above Pre-LN's;
* otherwise not reproduced at this scale.

DeepNorm is measured alongside and reported, not judged: it is a Post-LN made trainable at depth
(Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers"), so it should keep Post-LN's
behaviour.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import _claims
import torch

from normprobe import plots, tags
from normprobe.corpus import CharCorpus

CLAIM = _claims.Claim(
    key="representation_collapse",
    statement="Pre-LN's deep blocks collapse: consecutive blocks' streams are nearly parallel",
    source="Xie et al. 2023, ResiDual",
    setting="",
)
VARIANTS = ("Pre-LN", "Post-LN", "DeepNorm")
LR = 1e-3


FULL = _claims.Size(width=32, depth=24, heads=4, context=32, batch=16, steps=300)
QUICK = _claims.Size(width=16, depth=6, heads=2, context=16, batch=4, steps=20)


@dataclass
class Profiles:
    """One variant over the seeds: per seed, the depth profiles at init and after training."""

    variant: str
    cos_init: list[list[float]]
    cos_end: list[list[float]]
    rms_end: list[list[float]]
    growth_end: list[float]
    final: list[float]
    losses: list[list[float]]

    @staticmethod
    def deep_cos(profiles: list[list[float]]) -> list[float]:
        """Per seed, the mean cosine over blocks depth // 2 to depth - 2 (a cosine profile starts
        at block 1)."""
        return [statistics.fmean(p[(len(p) + 1) // 2 - 1 : -1]) for p in profiles]


def at_step(trained: _claims.Trained, tag: str, step: int) -> float:
    return dict(trained.series(tag))[step]


def measure(variant: str, size: _claims.Size, seeds: int) -> Profiles:
    vocab = CharCorpus(context=size.context).vocab_size
    found = Profiles(variant, [], [], [], [], [], [])
    last = size.steps - 1
    cos_tags = [
        tags.format("resid_cos", "blocks", b, depth=size.depth) for b in range(1, size.depth)
    ]
    rms_tags = [tags.format("resid_rms", "blocks", b, depth=size.depth) for b in range(size.depth)]
    for seed in range(seeds):
        torch.manual_seed(seed)
        trained = _claims.train_char_lm(
            _claims.placed_transformer(
                variant, vocab, size.width, size.depth, size.heads, size.context
            ),
            steps=size.steps,
            lr=LR,
            seed=seed,
            batch=size.batch,
            context=size.context,
            warmup=size.steps // 6,
            probe_every=last,  # logs the first step and the last
            metrics=["resid_rms", "resid_cos"],
        )
        found.cos_init.append([at_step(trained, t, 0) for t in cos_tags])
        found.cos_end.append([at_step(trained, t, last) for t in cos_tags])
        found.rms_end.append([at_step(trained, t, last) for t in rms_tags])
        found.growth_end.append(at_step(trained, tags.format("resid_growth", "blocks"), last))
        found.final.append(trained.final_loss())
        found.losses.append(trained.losses)
    return found


def mean_profile(label: str, profiles: list[list[float]], first_block: int, i: int) -> plots.Line:
    """The mean over seeds of a depth profile starting at ``first_block``."""
    points = [
        (float(first_block + b), statistics.fmean(values))
        for b, values in enumerate(zip(*profiles, strict=True))
    ]
    return plots.Line(label, points, plots.PALETTE[i])


def verdict(found: dict[str, Profiles]) -> tuple[_claims.Verdict, str]:
    """The rule of the module docstring."""
    pre, post = found["Pre-LN"], found["Post-LN"]
    cos = {v: p.deep_cos(p.cos_end) for v, p in found.items()}
    mean = {v: _claims.mean_spread(c)[0] for v, c in cos.items()}
    cos_apart = _claims.apart(cos["Pre-LN"], cos["Post-LN"])
    growth_apart = _claims.apart(pre.growth_end, post.growth_end)
    pre_growth, post_growth = (_claims.mean_spread(p.growth_end)[0] for p in (pre, post))
    why = (
        f"deeper-half cosine after training: Pre-LN {mean['Pre-LN']:.4f}, Post-LN "
        f"{mean['Post-LN']:.4f} ({'apart' if cos_apart else 'within the spreads'}), DeepNorm "
        f"{mean['DeepNorm']:.4f} ("
        f"{'apart from' if _claims.apart(cos['DeepNorm'], cos['Post-LN']) else 'within'} "
        f"Post-LN's spread); residual growth Pre-LN {pre_growth:.2f}, Post-LN {post_growth:.2f} "
        f"({'apart' if growth_apart else 'within the spreads'})"
    )
    if cos_apart and mean["Post-LN"] > mean["Pre-LN"]:
        return "contradicted", why
    if cos_apart and mean["Pre-LN"] > mean["Post-LN"] and growth_apart and pre_growth > post_growth:
        return "reproduced", why
    return "not reproduced at this scale", why


def main() -> None:
    parser = _claims.options(CLAIM)
    parser.add_argument("--steps", type=int, help=f"training steps (default {FULL.steps})")
    args = parser.parse_args()
    _claims.torch_threads()
    size = QUICK if args.quick else FULL
    if args.steps:
        size = replace(size, steps=args.steps)

    found = {variant: measure(variant, size, args.seeds) for variant in VARIANTS}
    rows = [
        [
            variant,
            _claims.fmt(p.deep_cos(p.cos_init), 5),
            _claims.fmt(p.deep_cos(p.cos_end), 5),
            _claims.fmt(p.growth_end, 3),
            _claims.fmt(p.final),
        ]
        for variant, p in found.items()
    ]
    chosen, why = verdict(found)

    def one_minus(profiles: list[list[float]]) -> list[list[float]]:
        return [[1 - c for c in seed] for seed in profiles]

    panels = [
        plots.Panel(
            "1 - consecutive-block cosine, after training",
            [mean_profile(v, one_minus(found[v].cos_end), 1, i) for i, v in enumerate(VARIANTS)],
            xlabel="block",
            ylabel="1 - resid_cos (mean of seeds)",
            ylog=True,
        ),
        plots.Panel(
            "1 - consecutive-block cosine, at init",
            [mean_profile(v, one_minus(found[v].cos_init), 1, i) for i, v in enumerate(VARIANTS)],
            xlabel="block",
            ylabel="1 - resid_cos (mean of seeds)",
            ylog=True,
        ),
        plots.Panel(
            "Residual-stream RMS after each block, after training",
            [mean_profile(v, found[v].rms_end, 0, i) for i, v in enumerate(VARIANTS)],
            xlabel="block",
            ylabel="resid_rms (mean of seeds)",
        ),
        plots.Panel(
            "Loss (mean of seeds, running mean of 10)",
            _claims.curve_lines({v: p.losses for v, p in found.items()}),
            xlabel="step",
            ylabel="loss",
        ),
    ]
    setting = (
        f"TinyTransformer width {size.width}, {size.depth} blocks, {size.heads} heads, char corpus "
        f"(context {size.context}, batch {size.batch}), AdamW lr {LR:g}, {size.steps} steps, "
        f"warmup {size.steps // 6}, {args.seeds} seeds; DeepNorm = Post-LN + reinit('deepnorm'); "
        f"deeper-half cosine = probe's resid_cos averaged over blocks {size.depth // 2}.."
        f"{size.depth - 2}"
    )
    numbers: dict[str, object] = {
        v: {
            "deep_cos_init": _claims.mean_spread(p.deep_cos(p.cos_init)),
            "deep_cos_end": _claims.mean_spread(p.deep_cos(p.cos_end)),
            "resid_growth_end": _claims.mean_spread(p.growth_end),
            "final_loss": _claims.mean_spread(p.final),
        }
        for v, p in found.items()
    }
    result = _claims.Result(
        replace(CLAIM, setting=setting),
        [
            "variant",
            "deeper-half cosine at init",
            "deeper-half cosine after training",
            "residual growth after training",
            "final loss",
        ],
        rows,
        chosen,
        why,
        numbers,
        quick=args.quick,
    )
    _claims.finish(result, args.out, panels)


if __name__ == "__main__":
    main()
