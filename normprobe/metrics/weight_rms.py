"""``weight_rms``: the size of each block's weights, and how training changes it."""

from __future__ import annotations

import torch

from .. import probes
from .core.base import Family, Out, Plan, Series, Values
from .core.params import SAMPLE_FRACTION, SAMPLE_MIN, BlockParams, WeightSample, write_root_ratios


class WeightRms(Family):
    name = "weight_rms"
    description = (
        "RMS of each block's parameters before the optimizer step: weights growing without "
        "bound (too little weight decay) or shrinking towards zero show here first (exact up "
        f"to {SAMPLE_MIN} entries per tensor; beyond, from the sample of {SAMPLE_FRACTION:.0%} "
        "of the entries update_ratio keeps: within 0.8% of the exact RMS on the models tried)"
    )
    requires = "no stacks of blocks"
    series = (Series("weight_rms", "block", "mean"),)

    def plan(self, plan: Plan) -> None:
        params = BlockParams.of(plan)
        if not params.params:
            return
        stacks = plan.stacks()
        # sums of squares and entry counts, reduced alike across ranks (summed over shards)
        squares = {s.path: plan.slot(s.depth, plan.param_reduce) for s in stacks}
        counts = {s.path: plan.slot(s.depth, plan.param_reduce) for s in stacks}
        numels: dict[torch.device, torch.Tensor] = {}
        sample = WeightSample.of(plan)

        def read() -> None:
            device = params.params[0].device
            index = params.index(device)
            if device not in numels:
                held = zip(params.weights(), params.shares(), strict=True)
                sizes = [probes.local(w).numel() * share for w, share in held]
                numel = torch.tensor(sizes, dtype=torch.float32, device=device)
                numels[device] = probes.group_sums(numel, index, params.count)
            sample.take()  # the copy update_ratio compares against, if it runs too
            sums = sample.old_squares()
            for stack, blocks in params.blocks.items():
                plan.measured.put(squares[stack], sums[blocks])
                plan.measured.put(counts[stack], numels[device][blocks])

        def record(values: Values, out: Out) -> None:
            write_root_ratios(values, out, "weight_rms", squares, counts)

        plan.before_step(read)
        plan.on_clear(sample.clear)
        plan.on_record(record)
