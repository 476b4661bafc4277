"""The ``fixup`` scheme (Zhang et al. 2019): zero branch writers, scaled He init, scalar biases
and multipliers (`FixupScalars`) around the branch layers, the stem and the head."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from ...discovery import ResidualAdd
from ...layers.branch_scale import FixupScalars
from ..branches import check_placeable, check_skip_gains, parent_wrapper, replace_module
from ..report import constant, kaiming, scaled
from ..scheme import Scheme, one_of
from ..target import Target, zero_params
from ..weights import direct_params, out_in_view, warn_user


def fixup(t: Target, *, mode: Any = "fan_out", allow_norms: Any = False) -> None:
    """Zhang et al. 2019, as the authors' ResNets do it. L residual branches, m weight layers on
    a branch: its writers (the last layer on each path) 0, the others He-normal times
    L^(-1/(2m-2)); projection shortcuts plain He; the head 0 (unless tied to another weight).
    `FixupScalars` (biases at 0, multipliers at 1) add a scalar bias before and after every
    branch layer and a multiplier on each writer, a bias after the stem (the weight layers that
    run before any branch, but embeddings) and before the head, and feed each projection
    shortcut the input shifted by its branch's first bias (one Parameter). A new optimizer is
    needed to train them (the authors train the scalars at a tenth of the learning rate). Fixup
    is for networks without normalization: a model with norm layers is refused unless
    ``allow_norms=True`` (``normprobe.convert_norms(model, "identity")`` removes them).
    """
    fan = cast(_Fan, one_of("mode", mode, ("fan_in", "fan_out")))
    if not isinstance(allow_norms, bool):
        raise ValueError(f"allow_norms must be True or False, got {allow_norms!r}")
    adds = t.adds()
    check_skip_gains(t, adds, unit_ok=True)
    for a in adds:  # every refusal before any change
        check_placeable(t, a)
    if not allow_norms:
        _refuse_norms(t)
    t.require_inputs("find the stem and the first layer of each projection shortcut")
    order = t.call_order({p for p, _ in t.weight_layers(embeddings=False)})
    parts: dict[str, _FixupPart] = {}
    with torch.no_grad():
        for a in adds:
            _fixup_branch(t, a, len(adds), fan, parts)
        for a in adds:
            _fixup_shortcut(t, a, fan, order, parts)
        head = t.map.head
        if head is not None and _fixup_head(t, head):
            parts[head] = _FixupPart(bias_out=False)  # fc(x + bias)
    for path in _stem(t, order, parts):
        parts[path] = _FixupPart(bias_in=False)  # act(stem(x) + bias)
    _wrap_fixup(t, parts)


_Fan = Literal["fan_in", "fan_out"]


@dataclass(frozen=True)
class _FixupPart:
    """Which of `FixupScalars`' parts one layer gets; ``shares_in``: the layer whose
    ``bias_in`` it reads too (a projection shortcut reads its branch's first layer's)."""

    last: bool = False
    bias_in: bool = True
    bias_out: bool = True
    shares_in: str | None = None


def _refuse_norms(t: Target) -> None:
    norms = t.map.norms
    if norms:
        first = norms[0]
        raise ValueError(
            f"{t.what}: Fixup (Zhang et al. 2019) trains residual networks without "
            f"normalization, but {type(t.model).__name__} has {len(norms)} norm layers (the "
            f"first: {first.kind} at {first.path!r}); remove them first with "
            "model = normprobe.convert_norms(model, 'identity'), or pass allow_norms=True to "
            "re-initialize around them"
        )


def _fixup_branch(
    t: Target, a: ResidualAdd, n_branches: int, mode: _Fan, parts: dict[str, _FixupPart]
) -> None:
    """Writers 0, the other layers He times L^(-1/(2m-2)); every layer gets both biases."""
    layers = [p for p in a.branch_layers if not isinstance(t.module(p), nn.Embedding)]
    m = len(layers)
    for path in layers:
        layer = t.module(path)
        last = path in a.writers  # the last layer on each path of the branch
        parts[path] = _FixupPart(last=last)
        for name, p in t.applied.of(layer):
            if last:
                p.zero_()
                t.rec.record(p, constant(0.0, "last layer of a branch"))
                continue
            if not t.drawn(name, p):
                t.set_vector(name, p, "fixup")
                continue
            view = out_in_view(layer, p)
            nn.init.kaiming_normal_(view, mode=mode, nonlinearity="relu")
            factor = n_branches ** (-1.0 / (2 * m - 2))
            p.mul_(factor)
            he = kaiming(view, mode, math.sqrt(2.0), "normal", "sqrt(2)")
            why = f"{he.formula}*L^(-1/(2m-2)), L={n_branches}, m={m}"
            t.rec.record(p, scaled(he, factor, why))


def _fixup_shortcut(
    t: Target, a: ResidualAdd, mode: _Fan, order: list[str], parts: dict[str, _FixupPart]
) -> None:
    """A projection shortcut's layers plain He; the first to run reads the input shifted by
    the bias before the branch's first layer, as the branch does."""
    if a.kind != "projection":
        return
    prefix = a.module + "." if a.module else ""
    shortcut = [
        path
        for path, _ in t.weight_layers(embeddings=False)
        if path.startswith(prefix) and path not in parts
    ]
    for path in shortcut:
        layer = t.module(path)
        for name, p in t.applied.of(layer):
            if t.drawn(name, p):
                view = out_in_view(layer, p)
                nn.init.kaiming_normal_(view, mode=mode, nonlinearity="relu")
                t.rec.record(p, kaiming(view, mode, math.sqrt(2.0), "normal", "sqrt(2)"))
            else:
                t.set_vector(name, p, "fixup")
    branch = [p for p in a.branch_layers if p in parts]
    first = min((p for p in shortcut if p in order), key=order.index, default=None)
    if first is not None and branch:
        parts[first] = _FixupPart(bias_in=False, bias_out=False, shares_in=branch[0])


def _fixup_head(t: Target, head: str) -> bool:
    """Zero the classifier; False (with a warning) where its weight is tied to another."""
    tied = _tied_elsewhere(t.model, head)
    if tied:
        warn_user(
            f"fixup leaves the head {head!r} as it is: its weight is shared with "
            f"{tied!r}, and zeroing it would zero that too"
        )
        for _, p in direct_params(t.module(head)):
            t.rec.leave(p, f"the head, tied to {tied!r}: fixup leaves it (zeroing it zeroes both)")
        return False
    zero_params(t, t.module(head), "classifier")
    return True


def _stem(t: Target, order: list[str], parts: dict[str, _FixupPart]) -> list[str]:
    """The weight layers that run before any residual branch or shortcut: the stem (an
    embedding table, which holds an offset per entry already, excepted)."""
    stem: list[str] = []
    for path in order:
        if path in parts:
            break
        if path not in stem:
            stem.append(path)
    return stem


def _wrap_fixup(t: Target, parts: dict[str, _FixupPart]) -> None:
    """Wrap each layer in its `FixupScalars`, or reset the one a previous run put there."""
    wrappers: dict[str, FixupScalars] = {}
    swaps = []
    # a shortcut's wrapper takes its branch's bias_in, so the branches' come first
    for path, part in sorted(parts.items(), key=lambda item: item[1].shares_in is not None):
        wrapper = parent_wrapper(t.model, path)
        if isinstance(wrapper, FixupScalars):
            wrapper.reset()  # fixup ran before: keep the scalars, reset them
            _record_scalars(t, wrapper)
        else:
            shared = wrappers[part.shares_in].bias_in if part.shares_in else None
            wrapper = FixupScalars(
                t.module(path),
                part.last,
                bias_in=part.bias_in,
                bias_out=part.bias_out,
                shared_in=shared,
            )
            swaps.append((path, wrapper))
            _record_scalars(t, wrapper)
        wrappers[path] = wrapper
    # inner layers first: a layer applying weights of its own around a child weight layer
    # (fused experts around their router) is wrapped with the child's wrapper inside it
    for path, new in sorted(swaps, key=lambda swap: -swap[0].count(".")):
        replace_module(t.model, path, new)


def _record_scalars(t: Target, wrapper: FixupScalars) -> None:
    for p, treatment in (
        (wrapper.bias_in, constant(0.0, "Fixup scalar bias before the layer")),
        (wrapper.bias_out, constant(0.0, "Fixup scalar bias after the layer")),
        (wrapper.scale, constant(1.0, "Fixup multiplier")),
    ):
        if p is not None:
            t.rec.record(p, treatment)


def _tied_elsewhere(model: nn.Module, path: str) -> str | None:
    mine = {id(p) for _, p in direct_params(model.get_submodule(path))}
    for other, m in model.named_modules():
        if other != path and any(id(p) in mine for _, p in direct_params(m)):
            return other
    return None


SCHEME = Scheme(
    "fixup",
    fixup,
    branches=True,
    leaves_layers="neither on a residual branch, a projection shortcut nor the head",
)
