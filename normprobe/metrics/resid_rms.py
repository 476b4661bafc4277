"""``resid_rms``: how the residual stream grows with depth."""

from __future__ import annotations

import math

from .. import probes, tags
from .base import SUSTAIN, Family, Flag, Out, Plan, Run, Series, Values, sustained
from .streams import Streams, stream_rms

# Residual growth needs both a shape and a size. Shape: log RMS against log depth rising with a
# slope of at least 0.3; Pre-LN's sqrt(l) growth (seed tutorial §5.3) is 0.5, and the tutorial's
# 48-block Pre-LN stack reads 0.37 at init (its input already has RMS 1, which flattens the
# start). Size: the last block's RMS at least 3x the first one's, so that a deep block's write
# weighs a third of the first block's; that stack reads 3.5, a 4-block Pre-LN model under 2.
SLOPE_LIMIT = 0.3
GROWTH_MIN = 3.0
# Any shape: an unscaled stream of 50 layers grows its std x10 (variance x101, the tutorial's
# check [f]); a stack growing that much is flagged whatever its slope.
GROWTH_LIMIT = 10.0
# `diagnose` checks the slope only on stacks this deep: over fewer blocks it is mostly the first
# block's noise.
MIN_DEPTH = 4


class ResidRms(Family):
    name = "resid_rms"
    requires = "no residual adds in a stack of blocks"
    description = (
        "RMS of the residual stream after each block (the output of the block's last "
        "residual add, or of the norm right after it in Post-LN); per stack also its growth "
        "(last block / first) and the slope of log RMS against log depth (0.5 for sqrt(l) growth)"
    )
    series = (
        Series("resid_rms", "block", "last"),  # the stream leaving the stack
        Series("resid_growth", "stack"),
        Series("resid_slope", "stack"),
    )

    def plan(self, plan: Plan) -> None:
        streams = Streams.of(plan)
        depth = {s.path: s.depth for s in plan.model_map.stacks}
        slots = {stack: plan.slot(depth[stack], "rms") for stack in streams.blocks}

        def finish() -> None:
            for stack, reads in streams.reads.items():
                if reads and stack in slots:
                    positions = [slots[stack].offset + r.block for r in reads]
                    plan.measured.put_at(positions, stream_rms(reads))

        def record(values: Values, out: Out) -> None:
            for stack, slot in slots.items():
                blocks = values.measured(slot)
                if not blocks:
                    continue
                out.per_block("resid_rms", stack, blocks)
                first, last = blocks.get(0), blocks.get(depth[stack] - 1)
                if first and last is not None:
                    name = plan.stack_name(stack)
                    out.scalar("resid_growth", name, last / first)
                    slope = probes.loglog_slope([blocks[b] for b in sorted(blocks)])
                    out.scalar("resid_slope", name, slope)

        plan.at_flush(finish)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        for stack in sorted({t.stack for t in run.tags if t.parsed.series == "resid_growth"}):
            growth = run.scalars.get(tags.format("resid_growth", stack), [])
            slopes = dict(run.scalars.get(tags.format("resid_slope", stack), []))

            # growth past the limit, or past the minimum with a rising slope (-1: neither)
            marked = [
                (
                    s,
                    g
                    if g >= GROWTH_LIMIT or (g >= GROWTH_MIN and slopes.get(s, 0) >= SLOPE_LIMIT)
                    else -1,
                )
                for s, g in growth
            ]
            hits = sustained(marked, lambda g: g >= 0)
            if len(hits) < SUSTAIN:
                continue
            step, g = hits[-1]
            s = slopes.get(step, math.nan)
            if g >= GROWTH_LIMIT:
                why = f"resid_growth {g:.3g} >= {GROWTH_LIMIT:g}"
            else:
                why = (
                    f"resid_growth {g:.3g} >= {GROWTH_MIN:g} and resid_slope {s:.3g} >= "
                    f"{SLOPE_LIMIT} (0.5 is Pre-LN's sqrt(l) growth)"
                )
            found.append(
                Flag(
                    "residual growth",
                    stack,
                    step,
                    g,
                    GROWTH_LIMIT if g >= GROWTH_LIMIT else GROWTH_MIN,
                    f"{why} at {len(hits)} logged steps: the last block's stream has {g:.3g}x the "
                    "RMS of the first block's, so deep blocks' writes are diluted; keep a final "
                    "norm before the head, or scale the residual branches "
                    "(normprobe.reinit(model, 'gpt2'), "
                    "normprobe.insert_branch_scale(model, 'layerscale'))",
                )
            )
        return found
