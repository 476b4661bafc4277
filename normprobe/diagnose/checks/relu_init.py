"""``relu-init``: chains of Linear/Conv→ReLU layers not initialized for ReLU.

The pairs and their chains come from the capture (`normprobe.diagnose.capture`): the second
moment into each layer and out of its ReLU, and the layer's fan_in·Var(W).
"""

from __future__ import annotations

import math

from ..capture import ReluPair
from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "relu-init"

# Linear→ReLU init: per layer E[y²]/E[x²] is 1 with Kaiming and 0.5 with Xavier or 1/fan_in
# (sanity check [e], examples/check_e_kaiming.py: 1.000 and 0.499). Flag outside [0.7, 1/0.7],
# around the geometric midpoint of 0.5 and 1, when at least 3 such layers follow each other
# (0.5³: 1/8 of the signal left).
RELU_RATIO_MIN = 0.7
RELU_CHAIN_MIN = 3


def check(ctx: Context) -> CheckResult:
    chains = [c for c in ctx.cap.chains if len(c) >= RELU_CHAIN_MIN]
    if not chains:
        return [], f"no chain of {RELU_CHAIN_MIN}+ Linear/Conv→ReLU layers"
    found = []
    for chain in chains:
        ratios = [p.ms_out / p.ms_in for p in chain if p.ms_in > 0]
        if not ratios or any(r <= 0 for r in ratios):
            continue
        per_layer = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        ctx.extra[f"diagnose/relu_ratio/{chain[0].layer}"] = per_layer
        if RELU_RATIO_MIN <= per_layer <= 1 / RELU_RATIO_MIN:
            continue
        found.append(_finding(chain, per_layer))
    return found, None


def _finding(chain: list[ReluPair], per_layer: float) -> Finding:
    first, last = chain[0], chain[-1]
    gains = [p.gain for p in chain if p.gain == p.gain]
    gain = sum(gains) / len(gains) if gains else math.nan
    way = "shrinks" if per_layer < 1 else "grows"
    return Finding(
        CODE,
        f"signal {way} x{per_layer:.2f} per Linear→ReLU layer: not initialized for ReLU",
        (
            f"{len(chain)} layers {collapse_paths([p.layer for p in chain])}: E[x²] "
            f"{first.ms_in:.3g} into `{first.layer}`, {last.ms_out:.3g} out of the "
            "last ReLU",
            f"fan_in·Var(W) = {gain:.2f} on average (Kaiming for ReLU: 2, keeping E[x²]; "
            "Xavier or 1/fan_in: 1, halving it per layer)",
        ),
        "re-initialize for ReLU: normprobe.reinit(model, 'kaiming') "
        "(He normal, fan_in, gain sqrt(2)).",
        tuple(p.layer for p in chain),
    )


CHECK = Check(
    CODE,
    "Linear→ReLU layers not initialized for ReLU",
    {"RELU_RATIO_MIN": RELU_RATIO_MIN, "RELU_CHAIN_MIN": RELU_CHAIN_MIN},
    check,
)
