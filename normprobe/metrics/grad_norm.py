"""``grad_norm``: each block's gradient, and how it is spread over depth."""

from __future__ import annotations

import math
import statistics

from .. import probes, tags
from .base import (
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
    placement,
    sustained,
)
from .params import BlockParams

# grad_ratio (last / first block), sanity check [d]: Post-LN reads 2.35 at init (top-heavy, the
# reason it needs warmup: Xiong et al. 2020) and DeepNorm 1.02, so 2.0 is a note. A problem when
# it stays past 10 to the end: in benchmarks/calibration.py a Post-LN stack 4x make demo's depth
# without warmup ends at 100-600 (16 blocks, 60 steps) or 3e11 (24 blocks, 300 steps: its first
# block's gradient vanishes), while healthy runs end at 0.14-0.93 (DeepNorm twice as deep
# passes 3.5-14 for a few steps early on, then falls back). A problem only in a stack whose
# blocks share a residual stream (resid_rms logged for it, when it is logged at all): timm's
# ConvNeXt-atto `stages`, four stages of widths 40..320 joined by downsampling, reads 190-2300
# in a healthy run (benchmarks/calibration_unseen.py: its first stage's weights sit behind
# layer scales of 1e-6, the last stage starts with a plain downsampling conv).
TOP_LIMIT = 2.0
TOP_PROBLEM = 10.0
# Pre-LN reads 0.40 at init in check [d] (each block's scale shrinks evenly with depth), and
# its healthy runs in the calibration set end at 0.14-0.93: bottom-heavy gradients past 4x are
# a note, never a problem.
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

        def read() -> None:
            shared = plan.block_grad_squares
            if shared is not None and len(shared) == params.count:
                squares = shared.clone()  # the spike detector's buffer is its own
            else:
                device = params.params[0].device
                grads = params.grads()
                squares = probes.group_sums(
                    params.by_shape.squared_norms(grads, device), params.index(device), params.count
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
        streams = {t.stack for t in run.tags if t.parsed.series == "resid_rms"}
        for stack in sorted({t.stack for t in run.tags if t.parsed.series == "grad_ratio"}):
            where = placement(run, stack)
            if where == "no-residual":
                continue  # the skew of Pre-LN and Post-LN is one of residual streams
            points = run.scalars.get(tags.format("grad_ratio", stack), [])
            flag = _skew(stack, points, where, stream=not streams or stack in streams)
            if flag is not None:
                found.append(flag)
        return found


def _skew(
    stack: str, points: list[tuple[int, float]], where: str | None, stream: bool
) -> Flag | None:
    """The skew flag of ``stack``'s ``grad_ratio`` points; a problem only when ``stream``."""
    top = sustained(points, lambda v: v >= TOP_LIMIT)
    bottom = sustained(points, lambda v: 0 < v <= BOTTOM_LIMIT)
    for hits, kind, limit in ((top, "top", TOP_LIMIT), (bottom, "bottom", BOTTOM_LIMIT)):
        if len(hits) < SUSTAIN:
            continue
        ratio = statistics.median(v for _, v in hits)
        when = f"(median of the {len(hits)} logged steps at which it is past {limit:g})"
        if kind == "top":
            like = ", as in Post-LN (2.35 over 48 blocks at init)" if where == "post-ln" else ""
            if not stream:
                like = " (its blocks share no residual stream: they may differ in width)"
            problem = stream and len(sustained(points, lambda v: v >= TOP_PROBLEM)) >= SUSTAIN
            return Flag(
                "top-heavy gradients",
                stack,
                hits[-1][0],
                ratio,
                TOP_PROBLEM if problem else TOP_LIMIT,
                f"grad_ratio (last / first block) {ratio:.3g} {when}: gradients pile up near the "
                f"output{like}; warm the learning rate up, or re-initialize a Post-LN stack "
                "for DeepNorm (normprobe.reinit(model, 'deepnorm'))",
                PROBLEM if problem else NOTE,
            )
        like = (
            " (the direction of Pre-LN's skew, 2.5x over 48 blocks at init)"
            if where == "pre-ln"
            else ""
        )
        return Flag(
            "bottom-heavy gradients",
            stack,
            hits[-1][0],
            ratio,
            BOTTOM_LIMIT,
            f"grad_ratio (last / first block) {ratio:.3g} {when}: the first block's gradient is "
            f"{1 / ratio:.3g}x the last one's{like}; deep blocks learn slowly: scale the residual "
            "branches (normprobe.reinit(model, 'gpt2'), normprobe.insert_branch_scale(model, "
            "'layerscale')) or give deep blocks a larger learning rate",
            NOTE,
        )
    return None
