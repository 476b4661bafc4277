"""The norm builders: one small function per target, registered under its name (in the spirit of
timm's ``create_norm``), each making a new, empty layer from a `NormSpec`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layers import BatchNormNd, DyT, LayerNorm2d, PerHeadLayerNorm, PerHeadRMSNorm, RMSNorm2d
from .targets import Target


@dataclass(frozen=True)
class NormSpec:
    """What a builder needs to know about the layer to make; none of the old layer's state."""

    shape: tuple[int, ...]  # normalized shape (channels-last) or (channels,)
    affine_shape: tuple[int, ...]  # the gain's shape as applied: shape, or (heads, *shape)
    groups: int  # for a group norm
    channels_first: bool  # statistics over dim 1 at every position
    gain: bool
    bias: bool
    eps: float | None  # the given or the old layer's; None: the new class's default
    alpha_init: float  # a DyT's starting alpha
    momentum: float | None = 0.1  # a batch norm's
    track_running_stats: bool = True  # a batch norm's
    device: torch.device | None = None
    dtype: torch.dtype | None = None

    @property
    def affine(self) -> bool:
        return self.gain or self.bias

    @property
    def per_head(self) -> bool:
        """A gain per head: statistics over the trailing dims, a gain over more."""
        return self.affine_shape != self.shape

    @property
    def eps_value(self) -> float:
        """eps for a class that takes a number: the given one, else torch's default 1e-5.

        (RMSNorm takes ``spec.eps`` as it is: None there means the dtype's machine epsilon.)
        """
        return 1e-5 if self.eps is None else self.eps


Builder = Callable[[NormSpec], nn.Module]
BUILDERS: dict[str, Builder] = {}
"""The builder of each target, by name; every name in `TARGETS` has one."""


def register(target: Target) -> Callable[[Builder], Builder]:
    """Decorator registering ``fn`` as the builder of ``target``."""

    def add(fn: Builder) -> Builder:
        if target in BUILDERS:
            raise ValueError(f"target {target!r} already has a builder: {BUILDERS[target]}")
        BUILDERS[target] = fn
        return fn

    return add


def create_norm(target: Target, spec: NormSpec) -> nn.Module:
    """A new ``target`` layer as ``spec`` describes it."""
    builder = BUILDERS.get(target)
    if builder is None:
        raise ValueError(f"no norm builder is registered for target {target!r}")
    return builder(spec)


@register("layernorm")
def _layernorm(spec: NormSpec) -> nn.Module:
    if spec.per_head:
        return PerHeadLayerNorm(
            spec.shape,
            spec.affine_shape,
            eps=spec.eps_value,
            elementwise_affine=spec.affine,
            bias=spec.bias,
            device=spec.device,
            dtype=spec.dtype,
        )
    cls = LayerNorm2d if spec.channels_first else nn.LayerNorm
    return cls(
        spec.shape,
        eps=spec.eps_value,
        elementwise_affine=spec.affine,
        bias=spec.bias,
        device=spec.device,
        dtype=spec.dtype,
    )


@register("rmsnorm")
def _rmsnorm(spec: NormSpec) -> nn.Module:
    if spec.per_head:
        return PerHeadRMSNorm(
            spec.shape,
            spec.affine_shape,
            spec.eps,
            elementwise_affine=spec.affine,
            device=spec.device,
            dtype=spec.dtype,
        )
    cls = RMSNorm2d if spec.channels_first else nn.RMSNorm
    return cls(
        spec.shape,
        eps=spec.eps,
        elementwise_affine=spec.affine,
        device=spec.device,
        dtype=spec.dtype,
    )


@register("groupnorm")
def _groupnorm(spec: NormSpec) -> nn.Module:
    return nn.GroupNorm(
        spec.groups,
        spec.shape[0],
        spec.eps_value,
        spec.affine,
        device=spec.device,
        dtype=spec.dtype,
    )


def _batch_norm(cls: type[_BatchNorm], spec: NormSpec) -> nn.Module:
    return cls(
        spec.shape[0],
        eps=spec.eps_value,
        momentum=spec.momentum,
        affine=spec.affine,
        track_running_stats=spec.track_running_stats,
        device=spec.device,
        dtype=spec.dtype,
    )


@register("batchnorm")
def _batchnorm(spec: NormSpec) -> nn.Module:
    return _batch_norm(BatchNormNd, spec)


@register("syncbatchnorm")
def _syncbatchnorm(spec: NormSpec) -> nn.Module:
    return _batch_norm(nn.SyncBatchNorm, spec)


@register("dyt")
def _dyt(spec: NormSpec) -> nn.Module:
    return DyT(
        spec.affine_shape,
        spec.alpha_init,
        channels_first=spec.channels_first,
        elementwise_affine=spec.gain,
        bias=spec.bias,
        device=spec.device,
        dtype=spec.dtype,
    )


@register("identity")
def _identity(spec: NormSpec) -> nn.Module:
    return nn.Identity()
