"""The replacement for one plan: a new layer from the builders, with the old layer's gain, bias,
eps and running statistics placed in it, and a record of what was carried, dropped and created."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layers import DyT
from .builders import NormSpec, create_norm
from .layout import reference
from .plan import Options, Plan
from .select import Source


@dataclass
class Built:
    """A new layer and what went into it."""

    plan: Plan
    module: nn.Module
    carried: list[str]
    dropped: list[str]
    created: list[str]
    shift: nn.Parameter | None  # a reused gain to add the gain offset to, in place


def build(plan: Plan, opts: Options, fallback: torch.Tensor | None) -> Built:
    """The replacement module; ``fallback`` gives device and dtype when the old one has none."""
    old = plan.source.module
    stats = statistics_module(plan.source)
    old_bn = (
        stats
        if isinstance(stats, _BatchNorm) and plan.target in ("batchnorm", "syncbatchnorm")
        else None
    )
    new = create_norm(plan.target, _spec(plan, opts, fallback, old_bn))
    built = Built(plan, new, [], [], [], None)
    _place(built, "weight", plan.gain, plan.gain_name, plan.gain_offset)
    _place(built, "bias", plan.bias, plan.bias_name, 0.0)
    _carry_eps(built)
    _carry_buffers(built, stats, old_bn)
    for name in ("alpha",) if isinstance(old, DyT) and not isinstance(new, DyT) else ():
        built.dropped.append(name)
    _mark_created(built)
    new.train(old.training)
    return built


def _spec(
    plan: Plan, opts: Options, fallback: torch.Tensor | None, old_bn: _BatchNorm | None
) -> NormSpec:
    ref = reference(plan.source.module)
    ref = fallback if ref is None else ref
    return NormSpec(
        shape=plan.shape,
        affine_shape=plan.affine,
        groups=plan.groups,
        channels_first=plan.out_layout == "channels-first",
        gain=plan.gain is not None,
        bias=plan.bias is not None,
        eps=plan.eps,
        alpha_init=opts.alpha_init,
        momentum=old_bn.momentum if old_bn is not None else 0.1,
        track_running_stats=old_bn.track_running_stats if old_bn is not None else True,
        device=ref.device if ref is not None else None,
        dtype=ref.dtype if ref is not None and ref.is_floating_point() else None,
    )


def statistics_module(s: Source) -> nn.Module:
    """The module computing ``s``'s statistics: the norm it wraps, if any, else itself."""
    wrapped = s.layer.wraps if s.layer is not None else None
    if wrapped is None:
        return s.module
    path = s.paths[0]
    return s.module.get_submodule(wrapped[len(path) + 1 :] if path else wrapped)


def _carry_eps(built: Built) -> None:
    plan = built.plan
    layer = plan.source.layer
    if plan.eps_text and hasattr(built.module, "eps"):
        built.carried.append(plan.eps_text)
        if layer is not None and layer.eps_placement == "outside-sqrt":
            plan.notes.append("eps moved inside the square root (it was added to the RMS/std)")
    elif plan.eps_text:
        built.dropped.append("eps")


def _carry_buffers(built: Built, stats: nn.Module, old_bn: _BatchNorm | None) -> None:
    """A batch norm's running statistics move into the new batch norm; others are dropped."""
    for name, buf in stats.named_buffers(recurse=False):
        if old_bn is not None:
            setattr(built.module, name, buf)  # the same tensors, as convert_sync_batchnorm does
            built.carried.append(name)
        else:
            built.dropped.append(name)
    if isinstance(built.module, _BatchNorm) and old_bn is None:
        built.plan.notes.append("new BatchNorm running statistics start at mean 0, var 1")


def _mark_created(built: Built) -> None:
    """List the new layer's own parameters; they train only if the old layer's did."""
    new, old = built.module, built.plan.source.module
    for name, _ in new.named_parameters(recurse=False):
        if name not in ("weight", "bias"):
            built.created.append(name)
    old_params = list(old.parameters(recurse=False))
    trainable = any(p.requires_grad for p in old_params) if old_params else True
    for name in built.created:
        getattr(new, name).requires_grad_(trainable)  # a frozen layer stays frozen


def _place(
    built: Built, attr: str, param: nn.Parameter | None, name: str | None, offset: float
) -> None:
    """Put the old gain or bias into the new module: the same Parameter where shapes match."""
    new = built.module
    slot = new._parameters.get(attr) if attr in new._parameters else None
    if param is None or name is None:
        if slot is not None:
            built.created.append(attr)
        return
    if slot is None:
        built.dropped.append(name)
        return
    label = name if name == attr else f"{name}->{attr}"
    if offset:
        built.plan.notes.append(
            "a 1 + weight gain (Gemma) is now stored as weight (old weight + 1)"
        )
    if param.shape == slot.shape:
        setattr(new, attr, param)
        built.carried.append(label)
        if offset:
            built.shift = param
        return
    # a scalar or differently shaped gain: copy its values into a new Parameter
    with torch.no_grad():
        value = param.detach().reshape(-1).expand(slot.numel()).reshape(slot.shape) + offset
    setattr(new, attr, nn.Parameter(value.clone(), requires_grad=param.requires_grad))
    built.carried.append(label)
    built.created.append(attr)
    built.plan.notes.append(
        f"{name} of shape {tuple(param.shape)} copied into a new {attr} of shape "
        f"{tuple(slot.shape)}"
    )
