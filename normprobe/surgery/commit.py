"""Committing planned conversions: the new layers take the old ones' places (shared modules and
tied gains stay shared), carry their hooks, and the optimizer and the report follow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

import torch
from torch import nn

from .build import Built, build
from .fidelity import output_diff
from .hooks import carry_hooks
from .plan import Options, Plan
from .report import Conversion, ConversionReport, warn

M = TypeVar("M", bound=nn.Module)


def commit(
    model: M,
    plans: list[Plan],
    opts: Options,
    optimizer: torch.optim.Optimizer | None,
    report: ConversionReport,
) -> M:
    """Replace every planned layer of ``model``; the result (a new object only when ``model``
    itself is a norm layer)."""
    params_before = dict(_named_params(model))
    state_before = model.state_dict(keep_vars=True)
    group_of = _groups(optimizer)
    fallback = next((p for p in model.parameters() if p.is_floating_point()), None)
    built = [build(plan, opts, fallback) for plan in plans]
    _shift_gains(built)
    result = _swap(model, built)
    for b in built:
        hooks = carry_hooks(b.plan.source.module, b.module)
        if hooks:
            b.plan.notes.append(f"{hooks} hook(s) carried over to the new layers")
        report.conversions.append(_conversion(b))
    params_after = dict(_named_params(result))
    created = [p for i, (_, p) in params_after.items() if i not in params_before]
    removed = [p for i, (_, p) in params_before.items() if i not in params_after]
    report.new_parameters = [n for i, (n, _) in params_after.items() if i not in params_before]
    report.removed_parameters = [n for i, (n, _) in params_before.items() if i not in params_after]
    _key_changes(state_before, result.state_dict(keep_vars=True), report)
    if optimizer is not None and (created or removed):
        owner = {id(p): b for b in built for p in b.module.parameters(recurse=False)}
        _update_optimizer(optimizer, created, removed, owner, group_of)
        report.optimizer_updated = True
    elif created:
        warn(
            f"convert_norms created {len(created)} new parameters (e.g. "
            f"{report.new_parameters[0]!r}) that no existing optimizer holds; pass "
            "optimizer=opt to add them to it, or build the optimizer after this call"
        )
    return result


def _shift_gains(built: list[Built]) -> None:
    """Fold each gain offset (Gemma's 1 + weight) into the reused gain, in place."""
    with torch.no_grad():
        shifted: set[int] = set()
        for b in built:
            if b.shift is not None and id(b.shift) not in shifted:  # a tied gain moves once
                b.shift.add_(b.plan.gain_offset)
                shifted.add(id(b.shift))


def _swap(model: M, built: list[Built]) -> M:
    """Register each new layer under every name of its old one; the (maybe new) root."""
    new_of = {id(b.plan.source.module): b.module for b in built}
    # collect every registration first, then assign: never mutate while iterating
    swaps = [
        (parent, name, new_of[id(child)])
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is not None and id(child) in new_of
    ]
    for parent, name, new in swaps:
        parent.add_module(name, new)
    return cast(M, new_of.get(id(model), model))  # a root norm is replaced by a new object


def _named_params(model: nn.Module) -> Iterable[tuple[int, tuple[str, nn.Parameter]]]:
    return ((id(p), (n, p)) for n, p in model.named_parameters())


def _groups(optimizer: torch.optim.Optimizer | None) -> dict[int, dict[str, Any]]:
    if optimizer is None:
        return {}
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _update_optimizer(
    optimizer: torch.optim.Optimizer,
    created: list[nn.Parameter],
    removed: list[nn.Parameter],
    owner: dict[int, Built],
    group_of: dict[int, dict[str, Any]],
) -> None:
    """Drop removed parameters; add each new one to the group of its old layer's parameters."""
    gone = {id(p) for p in removed}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for p in removed:
        optimizer.state.pop(p, None)
    orphans = []
    for p in created:
        old = owner[id(p)].plan.source.module
        groups = [group_of[id(q)] for q in old.parameters() if id(q) in group_of]
        if not groups:
            orphans.append(p)
        else:
            groups[0]["params"].append(p)
    if orphans:  # the old layer had no parameters in the optimizer: use its defaults
        optimizer.add_param_group({"params": orphans})


def _key_changes(before: dict[str, Any], after: dict[str, Any], report: ConversionReport) -> None:
    gone = [k for k in before if k not in after]
    new = [k for k in after if k not in before]
    by_tensor: dict[int, list[str]] = {}
    for k in new:
        by_tensor.setdefault(id(after[k]), []).append(k)
    for k in gone:
        candidates = by_tensor.get(id(before[k]))
        if candidates:
            report.renamed_keys[k] = candidates.pop(0)
    report.removed_keys = [k for k in gone if k not in report.renamed_keys]
    renamed_to = set(report.renamed_keys.values())
    report.added_keys = [k for k in new if k not in renamed_to]


def _conversion(b: Built) -> Conversion:
    plan = b.plan
    diff = output_diff(b)
    layer = plan.source.layer
    return Conversion(
        path=plan.source.paths[0],
        aliases=plan.source.paths[1:],
        source=type(plan.source.module).__name__,
        kind=layer.kind if layer is not None else "dyt",
        target=plan.target,
        result=type(b.module).__name__,
        carried=tuple(b.carried),
        dropped=tuple(b.dropped),
        created=tuple(b.created),
        notes=tuple(plan.notes),
        max_abs_diff=diff,
    )
