"""``post-ln-warmup``: a Post-LN stack without DeepNorm's init, or top-heavy despite it.

A Post-LN stack trained from a standard init needs a learning-rate warmup (Xiong et al. 2020);
DeepNorm's init (its fixed branch scales) removes that need, unless the gradients are top-heavy
all the same (then ``post-ln-top-heavy`` flags the stack too, on the same threshold).
"""

from __future__ import annotations

from typing import Any

from ... import tags
from ..result import Finding
from ..weights import deepnorm_scaled
from .base import Check, CheckResult, Context
from .post_ln_top_heavy import POSTLN_GRAD_RATIO_MAX, top_heavy

CODE = "post-ln-warmup"


def check(ctx: Context) -> CheckResult:
    stacks = ctx.add_stacks(("post-ln",))
    if not stacks:
        return [], "no Post-LN stack"
    deepnorm = deepnorm_scaled(ctx.model)
    found = []
    for s in stacks:
        writers = {w for a in ctx.model_map.adds_in(s.path) for w in a.writers}
        scaled = any(w == d or w.startswith(d + ".") for w in writers for d in deepnorm)
        heavy = top_heavy(ctx, s)
        if scaled and heavy is None:
            continue
        found.append(_finding(ctx, s, scaled, heavy))
    return found, None


def _finding(ctx: Context, s: Any, scaled: bool, heavy: float | None) -> Finding:
    ratio = ctx.scalar("grad_ratio", s.path)
    norms = [
        ctx.scalars.get(tags.format("grad_norm", s.path or "root", b, depth=s.depth))
        for b in range(s.depth)
    ]
    profile = ", ".join("-" if v is None else f"{v:.3g}" for v in norms)
    name = s.path or "<root>"
    evidence = [
        f"{s.depth} {s.placement} blocks at `{name}`, "
        + ("with DeepNorm's scales" if scaled else "no DeepNorm scales")
    ]
    if ratio is not None:
        evidence.append(
            f"gradient norm per block at this batch: {profile} (last / first {ratio:.3g}"
            + (", top-heavy: post-ln-top-heavy)" if heavy else ")")
            + "; Post-LN renormalizes after every add, so each block's share of the gradient "
            "depends on its depth and shifts as training moves the weights"
        )
    return Finding(
        CODE,
        f"Post-LN stack `{name}` "
        + (
            "needs a warmup despite DeepNorm's scales"
            if scaled
            else "without DeepNorm's initialization"
        ),
        tuple(evidence),
        "train with a learning-rate warmup (Post-LN without one stalls or diverges: "
        "Xiong et al. 2020), or re-initialize for DeepNorm: "
        "normprobe.reinit(model, 'deepnorm', example_inputs=...), which trains without "
        "one; or move the norms in front of the branches (Pre-LN).",
        (s.path,),
    )


CHECK = Check(
    CODE,
    "Post-LN stack needing a warmup (no DeepNorm init, or top-heavy gradients)",
    {"POSTLN_GRAD_RATIO_MAX": POSTLN_GRAD_RATIO_MAX},
    check,
)
