"""``no-final-norm``: a Pre-LN (or sandwich) stack whose stream reaches the head unnormalized."""

from __future__ import annotations

from ..result import Finding
from .base import Check, CheckResult, Context

CODE = "no-final-norm"


def check(ctx: Context) -> CheckResult:
    stacks = ctx.add_stacks(("pre-ln", "sandwich"))
    if not stacks:
        return [], "no Pre-LN stack"
    if any(n.role == "final" for n in ctx.model_map.norms):
        return [], None
    evidence = []
    for s in stacks:
        growth = ctx.scalar("resid_growth", s.path)
        grows = (
            f"; its stream grows {growth:.2f}x from the first block to the last" if growth else ""
        )
        evidence.append(f"stack `{s.path or '<root>'}`: {s.depth} {s.placement} blocks{grows}")
    head = ctx.model_map.head
    evidence.append(
        "no norm has the role 'final'"
        + (f": the output layer `{head}` reads the residual stream unnormalized" if head else "")
    )
    return [
        Finding(
            CODE,
            "Pre-LN stack without a final norm",
            tuple(evidence),
            "add a LayerNorm/RMSNorm after the last block, before the head: in Pre-LN the stream "
            "is never normalized, and its magnitude grows with depth (about sqrt(depth)).",
            tuple(s.path for s in stacks),
        )
    ], None


# a check of the model's structure: no threshold
CHECK = Check(CODE, "Pre-LN stack without a final norm before the output", {}, check)
