"""``post-ln-top-heavy``: a Post-LN stack whose last block gets far more gradient than its first.

The threshold is the one `normprobe report` flags ``grad_ratio`` with
(`normprobe.metrics.grad_norm`).
"""

from __future__ import annotations

from typing import Any

from ...metrics import grad_norm
from ..result import Finding
from .base import Check, CheckResult, Context

CODE = "post-ln-top-heavy"

POSTLN_GRAD_RATIO_MAX = grad_norm.TOP_LIMIT


def top_heavy(ctx: Context, s: Any) -> float | None:
    """Stack ``s``'s last/first block gradient ratio when above the limit, else None."""
    ratio = ctx.scalar("grad_ratio", s.path)
    measurable = ctx.model_map.head is not None or ctx.own_loss
    return ratio if measurable and ratio is not None and ratio > POSTLN_GRAD_RATIO_MAX else None


def check(ctx: Context) -> CheckResult:
    # a stack discovery calls "deepnorm" already carries the fix
    stacks = ctx.add_stacks(("post-ln",))
    if not stacks:
        return [], "no Post-LN stack"
    if ctx.model_map.head is None and not ctx.own_loss:
        # mean(out²) of a freshly normalized output is about constant (why check [d]'s stack
        # ends in a linear head)
        return [], "no output head: pass loss_fn, the default loss flattens Post-LN gradients"
    found = []
    for s in stacks:
        ratio = top_heavy(ctx, s)
        if ratio is None:
            continue
        found.append(
            Finding(
                CODE,
                f"Post-LN gradients pile up at the top of `{s.path or '<root>'}`",
                (
                    f"gradient norm of block {s.depth - 1} / block 0 = {ratio:.2f} over {s.depth} "
                    f"{s.placement} blocks (threshold {POSTLN_GRAD_RATIO_MAX}; a 48-block Post-LN "
                    "ResidualStack: 2.35, after DeepNorm init: 1.02)",
                ),
                "train with a learning-rate warmup, or re-initialize for DeepNorm: "
                "normprobe.reinit(model, 'deepnorm', example_inputs=...); or move to Pre-LN.",
                (s.path,),
            )
        )
    return found, None


CHECK = Check(
    CODE,
    "Post-LN stack with top-heavy gradients",
    {"POSTLN_GRAD_RATIO_MAX": POSTLN_GRAD_RATIO_MAX},
    check,
)
