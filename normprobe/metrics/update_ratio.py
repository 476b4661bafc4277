"""``update_ratio``: how far the optimizer step moves each block's weights."""

from __future__ import annotations

import math
import statistics

from .core.base import PROBLEM, Family, Flag, Out, Plan, Run, Series, Values
from .core.params import SAMPLE_FRACTION, SAMPLE_MIN, BlockParams, WeightSample, write_root_ratios

# A stack's update ratio (its blocks' mean) at or past this at any logged step: the optimizer
# step moved its weights by a tenth of their norm. Adam's first steps move every weight by about
# the learning rate, so there the ratio reads lr / weight RMS, the learning rate against the
# init's scale (trained models sit near 1e-3, Karpathy's rule of thumb). Healthy runs of
# benchmarks/calibration.py peak at 0.013-0.057 (lr 3e-3 on weights of std 0.02, at step 0)
# and end at 3e-6-0.01, the learning rate 10x too high peaks at 0.55; one logged step counts,
# as a learning rate that high moves the weights at the first steps and the ratio falls back
# as they grow (0.06 at step 10, 0.008 at step 30).
LIMIT = 0.1


class UpdateRatio(Family):
    name = "update_ratio"
    requires = "no stacks of blocks"
    description = (
        "||new - old|| / ||old|| of each block's parameters across the optimizer "
        f"step (exact up to {SAMPLE_MIN} entries per tensor; beyond, from a sample of "
        f"{SAMPLE_FRACTION:.0%} of the entries in runs of 16 evenly spread, so the copy it "
        "needs stays small: within 2.5% of the exact ratio: up to 0.55% for the worst block "
        "of a 12-block MLP and a GPT-2-style model at init, 1.2-2.2% after 30 AdamW steps, "
        "three seeds)"
    )
    series = (Series("update_ratio", "block", "mean"),)

    def plan(self, plan: Plan) -> None:
        params = BlockParams.of(plan)
        if not params.params:
            return
        stacks = plan.stacks()
        change_slots = {s.path: plan.slot(s.depth, plan.param_reduce) for s in stacks}
        old_slots = {s.path: plan.slot(s.depth, plan.param_reduce) for s in stacks}
        sample = WeightSample.of(plan)

        def measure() -> None:
            change = sample.change_squares()
            if change is None:
                return
            old = sample.old_squares()
            for stack, blocks in params.blocks.items():
                plan.measured.put(change_slots[stack], change[blocks])
                plan.measured.put(old_slots[stack], old[blocks])

        def record(values: Values, out: Out) -> None:
            write_root_ratios(values, out, "update_ratio", change_slots, old_slots)

        plan.before_step(sample.take)
        plan.after_step(measure)
        plan.on_clear(sample.clear)  # the step is written (or dropped): its copy with it
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        for stack in sorted({t.stack for t in run.tags if t.parsed.series == "update_ratio"}):
            by_step: dict[int, list[float]] = {}
            for t in run.tags:
                if t.parsed.series == "update_ratio" and t.stack == stack:
                    for s, v in run.scalars[t.tag]:
                        if math.isfinite(v):
                            by_step.setdefault(s, []).append(v)
            means = [(s, statistics.fmean(vs)) for s, vs in sorted(by_step.items())]
            past = [(s, m) for s, m in means if m >= LIMIT]
            if not past:
                continue
            step, ratio = max(past, key=lambda p: p[1])
            found.append(
                Flag(
                    "update too large",
                    stack,
                    step,
                    ratio,
                    LIMIT,
                    f"the optimizer step moved the blocks' weights by {ratio:.3g}x their norm "
                    f"(update_ratio, mean over blocks; >= {LIMIT:g} at {len(past)} of "
                    f"{len(means)} logged steps, first at step {past[0][0]}): the learning "
                    "rate is large for the weights' scale (Adam moves each weight by about the "
                    "learning rate; ~1e-3 of the norm is the usual rule of thumb); lower it or "
                    "warm it up",
                    PROBLEM,
                )
            )
        return found
