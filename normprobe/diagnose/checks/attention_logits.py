"""``attention-logits``: attention modules whose largest logit is past the soft cap.

The threshold is the one `normprobe report` flags ``attn_logit_max`` with
(`normprobe.metrics.attn_logits`).
"""

from __future__ import annotations

from ...metrics import attn_logits
from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "attention-logits"

ATTN_LOGIT_MAX = attn_logits.SOFT_CAP


def check(ctx: Context) -> CheckResult:
    if not ctx.model_map.attention:
        return [], "no attention modules"
    big = []
    for a in ctx.model_map.attention:
        value = ctx.scalars.get(ctx.attention_tags[a.path])
        if value is not None and value > ATTN_LOGIT_MAX:
            big.append((a.path, value))
    if not big:
        return [], None
    qk = {s.path: s.qk_norm for s in ctx.model_map.stacks}
    has_qk = any(qk.get(a.stack or "", False) for a in ctx.model_map.attention)
    worst = max(big, key=lambda pv: pv[1])
    suggestion = (
        "the queries and keys are already normalized: check the QK-norm gains and the "
        "attention scale, and lower the learning rate."
        if has_qk
        else "normalize queries and keys before the dot product (QK-norm: a LayerNorm/RMSNorm "
        "over each head's q and k), or soft-cap the logits."
    )
    return [
        Finding(
            CODE,
            "large attention logits",
            (
                f"max |q·k|·scale = {worst[1]:.1f} at {worst[0]} (threshold {ATTN_LOGIT_MAX:g}); "
                f"{len(big)} of {len(ctx.model_map.attention)} attention modules above: "
                f"{collapse_paths([p for p, _ in big])}",
            ),
            suggestion,
            tuple(p for p, _ in big),
        )
    ], None


CHECK = Check(CODE, "large attention logits", {"ATTN_LOGIT_MAX": ATTN_LOGIT_MAX}, check)
