"""``layer-jump``: one weight layer or block whose output or gradient jumps against its peers.

The gains and jumps are measured in `normprobe.diagnose.layers` (with the threshold,
``JUMP_MIN``, and the peers needed, ``MIN_PEERS``); this file groups them by culprit and says
what to do: re-initialize one layer that is off, or look for a scale or hook in its forward or
backward.
"""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn

from ..layers import JUMP_MIN, MIN_PEERS, Jump
from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "layer-jump"


def check(ctx: Context) -> CheckResult:
    jumps = ctx.jumps()
    if not any(t.startswith("diagnose/jump_max/") for t in ctx.extra):
        return [], "no layer or block repeated 3+ times to compare with its peers"
    return _describe(jumps, ctx.model), None


def _outputs(group: list[Jump]) -> bool:
    return any(j.layer and j.kind == "output" for j in group)


def _group(jumps: list[Jump]) -> list[list[Jump]]:
    """One group per culprit layer; a block's step joins a layer of that block that jumps."""
    groups: dict[str, list[Jump]] = {}
    for j in jumps:
        if j.layer:
            groups.setdefault(j.path, []).append(j)
    for j in jumps:
        if not j.layer:
            host = next(
                (p for p, g in groups.items() if g[0].block == j.block and _outputs(g)), j.path
            )
            groups.setdefault(host, []).append(j)
    return list(groups.values())


def _weight_std(modules: dict[str, nn.Module], path: str) -> float:
    w = getattr(modules[path], "weight", None)
    return float(w.detach().float().std()) if isinstance(w, torch.Tensor) else math.nan


def _line(j: Jump) -> str:
    peers = f"{len(j.peers)} peers {collapse_paths(j.peers)}"
    if j.layer and j.kind == "output":
        what = f"forward gain of `{j.path}` (output RMS / input RMS) {j.value:.3g}"
    elif j.layer:
        what = f"backward gain of `{j.path}` (input / output gradient RMS) {j.value:.3g}"
    else:
        i = j.block[1] if j.block else 0
        what = f"stream RMS after block {i} / after block {i - 1} = {j.value:.3g}"
    return f"{what}, against a median {j.typical:.3g} over {peers}: x{j.factor:.3g}"


def _describe(jumps: list[Jump], model: nn.Module) -> list[Finding]:
    """One finding per culprit."""
    modules = dict(model.named_modules())
    out: list[Finding] = []
    for group in _group(jumps):
        head = group[0]
        where = f" (block {head.block[1]} of `{head.block[0] or '<root>'}`)" if head.block else ""
        kinds = sorted({j.kind for j in group}, reverse=True)
        factor = max(j.factor for j in group)
        evidence = [_line(j) for j in group]
        if head.layer:
            what = " and ".join(kinds)
            title = f"`{head.path}`{where} scales its {what} x{factor:.3g} more than its peers"
            suggestion = _layer_advice(head, group, modules, evidence)
        else:
            stack, i = head.block or ("", 0)
            title = f"the residual stream of `{stack or '<root>'}` jumps x{factor:.3g} at block {i}"
            suggestion = (
                f"no weight layer of `{head.path}` stands out from its peers: look for a scale or "
                f"hook applied in that block's forward code, rather than re-initializing the model."
            )
        out.append(Finding(CODE, title, tuple(evidence), suggestion, (head.path,)))
    return out


def _layer_advice(
    head: Jump, group: list[Jump], modules: dict[str, nn.Module], evidence: list[str]
) -> str:
    std = _weight_std(modules, head.path)
    peer_std = statistics.median(_weight_std(modules, p) for p in head.peers)
    evidence.append(f"weight std of `{head.path}` {std:.3g}; its peers' median {peer_std:.3g}")
    if std > JUMP_MIN**0.5 * peer_std:
        return (
            f"one layer is off, not the model's init: re-initialize `{head.path}` alone, like "
            f"its peers: nn.init.normal_(model.get_submodule('{head.path}').weight, "
            f"std={peer_std:.3g}); then look for what scaled it (a checkpoint, a manual edit)."
        )
    if all(j.kind == "gradient" for j in group if j.layer):
        return (
            f"its forward matches its peers', its backward does not: look for what scales the "
            f"gradient through `{head.path}` (a backward hook, a custom autograd.Function, a "
            "gradient multiplier); the model's init is not at fault."
        )
    return (
        f"its weights are like its peers': look for a scale or hook applied in the forward of "
        f"`{head.path}`; the model's init is not at fault."
    )


CHECK = Check(
    CODE,
    "one layer or block whose output or gradient jumps against its peers",
    {"JUMP_MIN": JUMP_MIN, "MIN_PEERS": MIN_PEERS},
    check,
)
