"""``resid_cos``: whether consecutive blocks still change the representation."""

from __future__ import annotations

import math
import statistics

from .. import probes
from .core.base import (
    NOTE,
    PROBLEM,
    SUSTAIN,
    Family,
    Flag,
    Out,
    Plan,
    Run,
    Series,
    Values,
    branch_gains,
    placement,
    sustained,
)
from .core.streams import Streams, rowwise

# Representation collapse (consecutive blocks' streams nearly parallel): the mean cosine of the
# deep half past 0.999, i.e. each block turns the stream by under 2.6 degrees. Healthy small
# models end at 0.88-0.994 (benchmarks/calibration.py: make demo's 6-block Pre-LN 0.98, a ViT
# 0.994), a Pre-LN stack whose stream dwarfs its writes at 0.99999. A problem in
# Pre-LN stacks, whose stream can outgrow the blocks' writes for good; a note in Post-LN and
# DeepNorm ones, which renormalize the stream every block and start near 1 whenever their
# branches start small (0.9999 at init, 0.997-0.999 after 60 steps in the calibration set).
COLLAPSE_COS = 0.999
# A stack still leaving collapse is a note too: its turn (1 - cosine) at the end at least RECEDING
# times the turn at the middle logged step. timm's ConvNeXt-atto, whose branches start behind
# layer scales of 1e-6, stays past 0.999 in a healthy run while its turn grows 1.5-3x over the
# second half (benchmarks/calibration_unseen.py); the collapsing run of the calibration set
# holds its turn at 1.0x.
RECEDING = 1.25
# Collapse is a matter of depth (Xie et al. 2023, ResiDual); below 4 blocks there is no deep half
# to speak of.
COLLAPSE_MIN_DEPTH = 4
# A stack collapsed since the first logged step is a note for its first JUDGED_AFTER logged steps:
# branches whose writes start small at initialization start collapsed and turn the stream more as
# training starts (timm's EVA-02 Tiny, its output projections scaled down with depth, logged every
# step at a learning rate warming up to 1e-3: 0.99931 at step 1, 0.99941 at step 5, 0.99904 at
# step 8, clear of 0.999 from step 9); one whose turn stays flat that long is a problem.
JUDGED_AFTER = 10


class ResidCos(Family):
    name = "resid_cos"
    requires = "no residual adds in a stack of blocks"
    description = (
        "cosine similarity of consecutive blocks' residual streams along the feature "
        "axis, averaged over positions; near 1 when blocks stop changing the representation"
    )
    # the mean over the deep half of the blocks: what collapse looks at
    series = (Series("resid_cos", "block", "deep", first_block=1, scale="linear"),)

    def plan(self, plan: Plan) -> None:
        streams = Streams.of(plan)
        streams.cosines = True
        depth = {s.path: s.depth for s in plan.model_map.stacks}
        slots = {stack: plan.slot(depth[stack], "mean") for stack in streams.blocks}

        def finish() -> None:
            for stack, reads in streams.reads.items():
                pairs = [r for r in reads if r.dots is not None]
                if pairs and stack in slots:
                    rows = [[r.dots, r.prev_norms, r.norms] for r in pairs]
                    cosines = rowwise(probes.cosines_from_rows, rows)  # type: ignore[arg-type]
                    plan.measured.put_at([slots[stack].offset + r.block for r in pairs], cosines)

        def record(values: Values, out: Out) -> None:
            for stack, slot in slots.items():
                blocks = values.measured(slot)
                if blocks:
                    out.per_block("resid_cos", stack, blocks)

        plan.at_flush(finish)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        stacks = sorted({t.stack for t in run.tags if t.parsed.series == "resid_cos"})
        for stack in stacks:
            cos = [t for t in run.tags if t.parsed.series == "resid_cos" and t.stack == stack]
            depth = max(t.parsed.block or 0 for t in cos) + 1
            if depth < COLLAPSE_MIN_DEPTH:
                continue
            deep = [t for t in cos if (t.parsed.block or 0) >= depth // 2]
            by_step: dict[int, list[float]] = {}
            for t in deep:
                for s, v in run.scalars[t.tag]:
                    if math.isfinite(v):
                        by_step.setdefault(s, []).append(v)
            means = [(s, statistics.fmean(vs)) for s, vs in sorted(by_step.items())]
            hits = sustained(means, lambda m: m > COLLAPSE_COS)
            if len(hits) < SUSTAIN:
                continue
            step, mean = hits[-1]
            blocks = sorted(t.parsed.block or 0 for t in deep)
            where = placement(run, stack)
            growth = (1 - mean) / max(1 - means[len(means) // 2][1], 1e-12)
            receding = growth >= RECEDING
            # every branch behind a learned gain that may start small or at zero (CaiT's layer
            # scales of 1e-5, the last BatchNorm's gamma of timm's ResNets and RegNets, SwinV2-CR's
            # post norms, the adaLN-Zero gates of DiT and Flux): collapsed by design until the
            # gains grow, a note from the first step
            # (timm's CaiT-XXS24 reads 0.99999 at first; its turn grows 1.25x only after tens of
            # healthy steps). Gains near 1 hardly collapse such a stack: each block writes at the
            # scale of its gain, which a stream of sqrt(l) such writes dwarfs past 0.999 only some
            # 500 blocks deep.
            gains = branch_gains(run, stack)
            young = hits[0][0] == means[0][0] and len(hits) < JUDGED_AFTER
            note = receding or young or gains is not None or where in ("post-ln", "deepnorm")
            found.append(
                Flag(
                    "representation collapse",
                    stack,
                    step,
                    mean,
                    COLLAPSE_COS,
                    f"consecutive blocks' streams have cosine {mean:.5f} > {COLLAPSE_COS} on "
                    f"average over blocks {blocks[0]}..{blocks[-1]} (the deep half) at "
                    f"{len(hits)} logged steps: those blocks barely change the "
                    f"representation{_advice(where, growth, gains, young)}",
                    NOTE if note else PROBLEM,
                )
            )
        return found


def _advice(where: str | None, growth: float, gains: str | None, young: bool) -> str:
    """Why the stream may be collapsed, and the way out; ``growth``: the turn's, since mid-run;
    ``gains``: what every branch writes through last (`branch_gains`), if a learned gain;
    ``young``: collapsed since the first logged step, fewer than `JUDGED_AFTER` of them."""
    if growth >= RECEDING:
        return (
            f" yet, but their turn (1 - cosine) is {growth:.3g}x what it was mid-run: branches "
            "that start small (layer scales) are growing; watch that it keeps growing"
        )
    if gains is not None:
        what = {
            "norm gain": "the gain of the norm ending it",
            "condition gate": "a gate computed from the condition (adaLN-Zero's)",
        }.get(gains, f"a learned {gains}")
        return (
            f" yet: every branch writes through {what}, which may start small or at zero by "
            "design; watch that their turn (1 - cosine) grows as the gains do (if it stays "
            "flat, the gains are not growing: weight decay on them, or too low a learning rate)"
        )
    if young:
        return (
            " since the first logged step: branches whose writes start small at initialization "
            "(output projections scaled down with depth) start this way and turn the stream "
            f"more as training starts; judged after {JUDGED_AFTER} logged steps, a problem if "
            "their turn (1 - cosine) stays flat"
        )
    why = " (typical of Pre-LN, whose stream outgrows each block's write)"
    return (
        f"{why if where == 'pre-ln' else ''}; scale the residual branches "
        "(normprobe.insert_branch_scale(model, 'layerscale')), use sandwich norms "
        "(normprobe.convert_norms with a policy), or a Post-LN stack with "
        "normprobe.reinit(model, 'deepnorm')"
    )
