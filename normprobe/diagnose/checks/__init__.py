"""`diagnose`'s checks: one file each, named for its code, listed here in the order they run.

A check's file holds its title, its thresholds and its logic, declared once as ``CHECK`` (a
`Check`); `REGISTRY` lists them, and `diagnose` runs them and reports their findings in this
order. `CHECKS` (code -> title) comes from it.
"""

from __future__ import annotations

from . import (
    attention_logits,
    batchnorm_batch,
    eps_outside_sqrt,
    layer_jump,
    low_precision_norm,
    no_final_norm,
    no_residual_scaling,
    post_ln_top_heavy,
    post_ln_warmup,
    relu_init,
    residual_growth,
)
from .base import Check, CheckResult, Context

REGISTRY: tuple[Check, ...] = (
    layer_jump.CHECK,
    no_final_norm.CHECK,
    post_ln_top_heavy.CHECK,
    post_ln_warmup.CHECK,
    residual_growth.CHECK,
    attention_logits.CHECK,
    batchnorm_batch.CHECK,
    low_precision_norm.CHECK,
    eps_outside_sqrt.CHECK,
    relu_init.CHECK,
    no_residual_scaling.CHECK,
)
CHECKS: dict[str, str] = {c.code: c.title for c in REGISTRY}

__all__ = ["CHECKS", "REGISTRY", "Check", "CheckResult", "Context"]
