"""``no-residual-scaling``: a deep Pre-LN stack whose residual writes are not scaled for depth.

GPT-2 residual scaling: layers writing into the stream get std/sqrt(2N) (Radford et al. 2019;
nanoGPT's `c_proj` init). The check compares the pooled weight std of the stream-writing layers
with that of the other branch layers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "no-residual-scaling"

# From 6 blocks on (12 writes) an unscaled stream's std grows by sqrt(1 + 12) = 3.6x (sanity
# check [f]: the variance grows linearly with the writes). Flag a write/other std ratio above
# (2N)^(-1/4): the geometric midpoint of 1 (unscaled) and (2N)^(-1/2) (GPT-2).
GPT2_MIN_DEPTH = 6


def check(ctx: Context) -> CheckResult:
    modules = dict(ctx.model.named_modules())
    found = []
    seen = False
    for s in ctx.add_stacks(("pre-ln",)):
        if s.depth < GPT2_MIN_DEPTH:
            continue
        writes, others = _branch_layers(ctx, s.path)
        if not writes:
            continue
        seen = True
        # a layer that jumps against its peers would swamp the pooled std (layer-jump names it)
        odd = {j.path for j in ctx.jumps() if j.layer}
        write_std = _pooled_std([modules[p] for p in writes if p not in odd])
        other_std = _pooled_std([modules[p] for p in others if p not in odd])
        if not other_std > 0:
            continue
        ratio = write_std / other_std
        gpt2 = 1 / math.sqrt(2 * s.depth)
        ctx.extra[f"diagnose/write_std_ratio/{s.path or 'root'}"] = ratio
        if ratio <= math.sqrt(gpt2):
            continue
        found.append(_finding(s, writes, write_std, other_std, ratio))
    if not seen:
        return [], (
            f"no Pre-LN stack of {GPT2_MIN_DEPTH}+ blocks with multi-layer residual branches"
        )
    return found, None


def _branch_layers(ctx: Context, stack: str) -> tuple[list[str], list[str]]:
    """The layers of ``stack``'s multi-layer branches: those writing into the stream, the rest."""
    writes: list[str] = []
    others: list[str] = []
    for a in ctx.model_map.adds_in(stack):
        if not a.writers or len(a.branch_layers) < 2:
            continue
        writes += a.writers
        others += [p for p in a.branch_layers if p not in a.writers and p not in a.gates]
    return writes, others


def _pooled_std(layers: list[nn.Module]) -> float:
    ws = [
        w.detach().float().reshape(-1)
        for m in layers
        if isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.ndim >= 2
    ]
    if not ws:
        return math.nan
    return float(torch.cat(ws).std())


def _finding(
    s: Any, writes: list[str], write_std: float, other_std: float, ratio: float
) -> Finding:
    gpt2 = 1 / math.sqrt(2 * s.depth)
    return Finding(
        CODE,
        f"residual writes of `{s.path or '<root>'}` are not scaled down for depth",
        (
            f"weight std {write_std:.4g} in the {len(writes)} layers writing into the "
            f"stream ({collapse_paths(writes)}) against {other_std:.4g} in the other branch "
            f"layers: ratio {ratio:.2f}; GPT-2's 1/sqrt(2N) with N = {s.depth} gives "
            f"{gpt2:.3f}",
        ),
        "scale the stream-writing layers by 1/sqrt(2N) so the stream's variance stays "
        "O(1) after 2N writes: normprobe.reinit(model, 'gpt2', example_inputs=...).",
        tuple(writes),
    )


CHECK = Check(
    CODE,
    "no residual-projection scaling on a deep Pre-LN stack",
    {"GPT2_MIN_DEPTH": GPT2_MIN_DEPTH},
    check,
)
