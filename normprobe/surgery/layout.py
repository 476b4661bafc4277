"""Which elements a norm layer's statistics run over (its layout) and how many features it
normalizes: declared by the module, measured by discovery, or measured here on made-up inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from ..discovery import NormLayer
from ..discovery import norms as norm_rules
from ..layers import DyT
from .hooks import quiet
from .select import Source

Layout = Literal["channels-last", "channels-first", "batch", "spatial", "groups"]
_Run = Callable[..., norm_rules.Behaviour | None]


class Refusal(Exception):
    """A layer that cannot become its target; the message says why and the way out."""


@dataclass(frozen=True)
class Stats:
    """Which elements a source layer's statistics run over, and the shape of its gain."""

    layout: Layout
    shape: tuple[int, ...]  # normalized shape (channels-last) or (channels,)
    affine: tuple[int, ...]  # the gain's shape as applied: shape, or (heads, *shape) per head
    groups: int | None = None  # of a group norm


def reference(m: nn.Module) -> torch.Tensor | None:
    """A tensor of ``m``'s own whose device and dtype a new module takes."""
    return next((t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))), None)


def source_layout(s: Source) -> Stats:
    """The source's statistics layout: declared by the module, else measured, else refused."""
    m, layer = s.module, s.layer
    if isinstance(m, DyT):
        cf = m.channels_first
        shape = m.normalized_shape
        return Stats("channels-first" if cf else "channels-last", shape, shape)
    assert layer is not None
    name = f"{s.paths[0] or '<root>'} ({type(m).__name__})"
    gain = next((p for p in m.parameters(recurse=False) if p.ndim >= 1), None)
    gain_shape = tuple(gain.shape) if gain is not None else ()
    layout, dims = _layout_and_dims(s, layer, gain_shape, name)
    dims = dims or gain_shape
    if not dims:
        raise Refusal(
            f"{name}: cannot tell how many features it normalizes; pass example inputs so "
            f"discovery can measure it, or exclude it (exclude={s.paths[0]!r})"
        )
    return _stats(layout, dims, gain_shape)


def _layout_and_dims(
    s: Source, layer: NormLayer, gain_shape: tuple[int, ...], name: str
) -> tuple[str, tuple[int, ...]]:
    """The layout the module declares, else the one discovery measured, else one measured here."""
    layout, dims = norm_rules.declared_layout(s.module), layer.dims
    if layout:
        return layout, dims
    if s.traced and _fits(layer.layout, dims, gain_shape):
        return layer.layout, dims  # measured on the example inputs by discovery
    measured = _measure(s.module, layer, gain_shape)
    if measured is None:
        if s.traced and layer.layout and dims:  # measured, but its gain spans other features
            raise Refusal(
                f"{name} normalizes over {dims} ({layer.layout}) on the example inputs, which "
                f"its gain of shape {gain_shape} does not fit (one gain over several heads' "
                f"features): no torch norm computes that; exclude it (exclude={s.paths[0]!r})"
            )
        how = (
            "discovery could not measure it on the example inputs; exclude it"
            if s.traced
            else "pass example_inputs=(x,) so discovery can measure it, or exclude it"
        )
        raise Refusal(
            f"{name} declares no layout (no data_format attribute, not a known norm class) "
            f"and cannot be told channels-last from channels-first without seeing its input; "
            f"{how} (exclude={s.paths[0]!r})"
        )
    return measured


def _stats(layout: str, dims: tuple[int, ...], gain_shape: tuple[int, ...]) -> Stats:
    if layout == "channels-first" and len(dims) > 1:
        if gain_shape and math.prod(gain_shape) == dims[0]:  # a gain per channel: GroupNorm(1)
            return Stats("groups", dims[:1], dims[:1], 1)
        return Stats("channels-last", dims, dims)  # over all trailing dims: a plain LayerNorm
    if layout == "groups":
        return Stats("groups", (dims[-1],), (dims[-1],), dims[0] if len(dims) > 1 else None)
    if layout in ("channels-first", "batch", "spatial"):
        return Stats(cast(Layout, layout), (dims[-1],), (dims[-1],))
    k = len(dims)
    per_head = len(gain_shape) > k and gain_shape[-k:] == dims
    return Stats("channels-last", dims, gain_shape if per_head else dims)


def _fits(layout: str, dims: tuple[int, ...], gain_shape: tuple[int, ...]) -> bool:
    """Whether a measured layout agrees with the module's own gain (one per feature it covers)."""
    if not layout or not dims:
        return False
    if not gain_shape or math.prod(gain_shape) == 1:
        return True
    if layout == "channels-last":
        return gain_shape[len(gain_shape) - len(dims) :] == dims
    return math.prod(gain_shape) in (dims[0], dims[-1], math.prod(dims))


def _measure(
    m: nn.Module, layer: NormLayer, gain_shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...]] | None:
    """Run ``m`` on made-up channels-last and channels-first inputs shaped by its gain: the
    layout it normalizes, when exactly one of them is normalized, else None."""
    ref = reference(m)
    if not gain_shape or ref is None or ref.device.type == "meta":
        return None
    a, b = [n for n in (5, 7, 3, 11, 13) if n not in gain_shape][:2]
    gen = torch.Generator().manual_seed(0)

    def run(*shape: int) -> norm_rules.Behaviour | None:
        x = torch.randn(shape, generator=gen).to(ref.device, ref.dtype)
        with quiet(m):  # the layer's own hooks stay quiet on made-up inputs
            return norm_rules.probe(m, (x,), {}, layer.eps)

    last = _measure_last(run, gain_shape, (a, b))
    first = _measure_first(run, gain_shape, (a, b))
    if (last is None) == (first is None):
        return None
    return ("channels-last", last) if last is not None else first


def _measure_last(
    run: _Run, gain_shape: tuple[int, ...], sizes: tuple[int, int]
) -> tuple[int, ...] | None:
    """The trailing dims ``run`` normalizes on channels-last inputs, if it does."""
    a, b = sizes
    lead = [(2, a), (2, a, b)] if len(gain_shape) == 1 else [(2, a)]
    for shape in (tuple((*lo, *gain_shape)) for lo in lead):
        found = run(*shape)
        varying = found.varying if found is not None else ()
        start = min(varying, default=0)
        # statistics over a run of trailing dims inside the gain's shape: channels-last
        if varying == tuple(range(start, len(shape))) and start >= len(shape) - len(gain_shape):
            return shape[start:]
    return None


def _measure_first(
    run: _Run, gain_shape: tuple[int, ...], sizes: tuple[int, int]
) -> tuple[str, tuple[int, ...]] | None:
    """The layout and dims ``run`` normalizes on a channels-first input, if it does."""
    if math.prod(gain_shape[1:]) != 1:  # one gain per channel: (C,) or (C, 1, 1)
        return None
    a, b = sizes
    c = gain_shape[0]
    found = run(2, c, a, b)
    if found is not None and found.layout in ("channels-first", "groups", "batch", "spatial"):
        whole = found.layout == "channels-first" and len(found.dims) > 1
        return ("groups", (1, c)) if whole else (found.layout, found.dims)
    return None
