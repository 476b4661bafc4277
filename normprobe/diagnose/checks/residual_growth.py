"""``residual-growth``: a residual stream whose RMS grows with depth, left unnormalized.

The thresholds are the ones `normprobe report` flags ``resid_slope`` with
(`normprobe.metrics.resid_rms`). A jump at one block (``layer-jump``) is divided out first: when
the rest of the stream is flat, the finding names the jump instead of depth.
"""

from __future__ import annotations

from typing import Any

from ... import probes
from ...metrics import resid_rms
from ..layers import Jump, without_jumps
from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "residual-growth"

RESID_SLOPE_MAX = resid_rms.SLOPE_LIMIT
RESID_MIN_DEPTH = resid_rms.MIN_DEPTH


def check(ctx: Context) -> CheckResult:
    stacks = ctx.add_stacks(("pre-ln", "sandwich", "mixed", "no-norm", "in-branch"))
    stacks = [s for s in stacks if s.depth >= RESID_MIN_DEPTH]
    if not stacks:
        return [], f"no stack of {RESID_MIN_DEPTH}+ blocks whose stream is left unnormalized"
    found = []
    for s in stacks:
        slope = ctx.scalar("resid_slope", s.path)
        growth = ctx.scalar("resid_growth", s.path)
        if slope is None or growth is None or not slope > RESID_SLOPE_MAX:
            continue
        name = s.path or "<root>"
        title = f"residual stream grows with depth in `{name}`"
        evidence = [
            f"RMS of the stream after block {s.depth - 1} / after block 0 = {growth:.2f}; "
            f"log-log slope against depth {slope:.2f} (sqrt(depth) is 0.5; threshold "
            f"{RESID_SLOPE_MAX})"
        ]
        suggestion = (
            "deep blocks add ever less to a growing stream: scale the residual writes "
            "(normprobe.reinit(model, 'gpt2')), start branches small "
            "(normprobe.insert_branch_scale(model, 'layerscale')), or use sandwich norms."
        )
        jumps = [j for j in ctx.jumps() if not j.layer and j.block and j.block[0] == s.path]
        if jumps:
            title, suggestion = _discount_jumps(ctx, s, jumps, evidence, (title, suggestion))
        found.append(Finding(CODE, title, tuple(evidence), suggestion, (s.path,)))
    return found, None


def _discount_jumps(
    ctx: Context, s: Any, jumps: list[Jump], evidence: list[str], said: tuple[str, str]
) -> tuple[str, str]:
    """Add the slope without the blocks' jumps to ``evidence``; when that slope is below the
    threshold, the (title, suggestion) naming the jumps, else ``said``."""
    rest = probes.loglog_slope(without_jumps(ctx.stream_rms(s), jumps))
    at = ", ".join(f"x{j.factor:.3g} at block {j.block[1]}" for j in jumps if j.block)
    evidence.append(f"of that, {at} [layer-jump]; without it the slope is {rest:.2f}")
    if rest > RESID_SLOPE_MAX:
        return said
    blocks = {j.block for j in jumps}
    culprits = list(dict.fromkeys(j.path for j in ctx.jumps() if j.layer and j.block in blocks))
    at = ", ".join(f"block {j.block[1]}" for j in jumps if j.block)
    name = s.path or "<root>"
    title = f"residual stream of `{name}` jumps at {at}, it does not grow with depth"
    suggestion = (
        f"the growth comes from one place, not from depth: fix "
        f"{collapse_paths(culprits or [j.path for j in jumps])} (see layer-jump); a global "
        "re-init or branch scaling would not remove it."
    )
    return title, suggestion


CHECK = Check(
    CODE,
    "residual stream growing with depth",
    {"RESID_SLOPE_MAX": RESID_SLOPE_MAX, "RESID_MIN_DEPTH": RESID_MIN_DEPTH},
    check,
)
