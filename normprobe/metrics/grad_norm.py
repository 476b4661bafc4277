"""``grad_norm``: each block's gradient, and how it is spread over depth."""

from __future__ import annotations

import math
import statistics

import torch

from .. import probes, tags
from .base import Family, Flag, Out, Plan, Run, Series, Values
from .params import BlockParams

# grad_ratio (last / first block), the tutorial's check [d]: Post-LN reads 2.35 (top-heavy, the
# reason it needs warmup) and DeepNorm brings it to 1.02, so 2.0 flags the first and not the
# second. Pre-LN reads 0.40 there, which the tutorial calls better conditioned (each block's
# scale shrinks evenly with depth): only a skew well past it, 4x, is flagged as bottom-heavy.
TOP_LIMIT = 2.0
BOTTOM_LIMIT = 0.25


class GradNorm(Family):
    name = "grad_norm"
    requires = "no stacks of blocks"
    description = (
        "L2 norm of each block's parameter gradients just before the optimizer step "
        "(after accumulation and AMP unscaling); per stack also the top/bottom ratio "
        "(last block / first block)"
    )
    series = (Series("grad_norm", "block", "mean"), Series("grad_ratio", "stack"))

    def plan(self, plan: Plan) -> None:
        params = BlockParams.of(plan)
        if not params.params:
            return
        slots = {s.path: plan.slot(s.depth, plan.param_reduce) for s in plan.stacks()}
        zeros: dict[torch.device, torch.Tensor] = {}

        def read() -> None:
            device = params.params[0].device
            zero = zeros.setdefault(device, torch.zeros((), device=device))
            grads = [zero if p.grad is None else p.grad for p in params.params]
            with torch.no_grad():
                squares = probes.group_sums(
                    probes.squared_norms(grads), params.index(device), params.count
                )
            for stack, blocks in params.blocks.items():
                plan.measured.put(slots[stack], squares[blocks])

        def record(values: Values, out: Out) -> None:
            for stack, slot in slots.items():
                squares = values.get(slot)
                if squares is None:
                    continue
                norms = {b: math.sqrt(v) for b, v in enumerate(squares)}
                out.per_block("grad_norm", stack, norms)
                first, last = norms[0], norms[len(norms) - 1]
                if first:
                    out.scalar("grad_ratio", plan.stack_name(stack), last / first)

        plan.before_step(read)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        for stack in sorted({t.stack for t in run.tags if t.parsed.series == "grad_ratio"}):
            flag = _skew(stack, run.scalars.get(tags.format("grad_ratio", stack), []))
            if flag is not None:
                found.append(flag)
        return found


def _skew(stack: str, points: list[tuple[int, float]]) -> Flag | None:
    series = [(s, v) for s, v in points if math.isfinite(v) and v > 0]
    if not series:
        return None
    # the median over the run (one noisy step does not make a skew), then the first logged
    # step (where the tutorial measures: Post-LN's skew at init is why it needs warmup)
    median = statistics.median(v for _, v in series)
    when = "(median over the logged steps)" if len(series) > 1 else "at the only logged step"
    checks = [(series[-1][0], median, when)]
    if len(series) > 1:
        checks.append((series[0][0], series[0][1], "at the first logged step"))
    for step, ratio, when in checks:
        if ratio >= TOP_LIMIT:
            return Flag(
                "top-heavy gradients",
                stack,
                step,
                ratio,
                TOP_LIMIT,
                f"grad_ratio (last / first block) {ratio:.3g} {when} >= {TOP_LIMIT:g}: "
                "gradients pile up near the output, as in Post-LN (2.35 in the tutorial); "
                "warm the learning rate up, or use DeepNorm (normprobe.reinit(model, 'deepnorm'))",
            )
        if ratio <= BOTTOM_LIMIT:
            return Flag(
                "bottom-heavy gradients",
                stack,
                step,
                ratio,
                BOTTOM_LIMIT,
                f"grad_ratio (last / first block) {ratio:.3g} {when} <= {BOTTOM_LIMIT:g}: the "
                f"first block's gradient is {1 / ratio:.3g}x the last one's (the direction of "
                "Pre-LN's skew, 2.5x in the tutorial); deep blocks learn slowly: scale the "
                "residual branches or give deep blocks a larger learning rate",
            )
    return None
