"""Planning a conversion: for each chosen layer, everything its replacement needs (layout,
shapes, gain, bias, eps), decided and refused before the model is touched."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..discovery import inside
from ..discovery import norms as norm_rules
from ..layers import DyT
from .layout import Layout, Refusal, Stats, source_layout
from .report import ConversionReport
from .select import Source
from .targets import CLASS_NAMES, Target

_GAIN_NAMES = ("weight", "gamma", "gain", "scale", "g")
_BIAS_NAMES = ("bias", "beta", "shift", "b")
_STATISTICS = {
    "batch": "the batch and its positions",
    "spatial": "its positions",
    "groups": "its group of channels and positions",
}


@dataclass(frozen=True)
class Options:
    """The arguments of `convert_norms` that shape every new layer."""

    eps: float | None
    num_groups: int | None
    alpha_init: float
    channels_first: bool


@dataclass
class Plan:
    """How one source layer becomes its replacement; built before the model is touched."""

    source: Source
    target: Target
    layout: Layout  # the source's statistics layout
    out_layout: Literal["channels-last", "channels-first"]
    shape: tuple[int, ...]  # normalized shape (channels-last) or (channels,)
    affine: tuple[int, ...]  # the gain's shape as applied: shape, or (heads, *shape) per head
    groups: int  # for a groupnorm target
    gain: nn.Parameter | None
    gain_name: str | None
    bias: nn.Parameter | None
    bias_name: str | None
    gain_offset: float  # 1.0 for Gemma's x_hat * (1 + weight)
    eps: float | None
    eps_text: str
    notes: list[str] = field(default_factory=list)
    check_input: torch.Tensor | None = None
    old_output: torch.Tensor | None = None


def plan_all(
    model: nn.Module,
    chosen: list[tuple[Source, Target]],
    opts: Options,
    report: ConversionReport,
) -> list[Plan]:
    """A plan per chosen layer that is not already its target; one ValueError naming every
    layer that cannot be converted, before anything changes."""
    plans: list[Plan] = []
    refusals: list[tuple[str, str]] = []
    eps_updates: list[nn.Module] = []
    for source, target in chosen:
        path = source.paths[0]
        try:
            _refuse_unknown(source, target)
            planned = plan(source, target, opts)
        except Refusal as err:
            refusals.append((path, str(err)))
            continue
        if planned is not None:
            plans.append(planned)
        else:
            report.kept.append((path, _already_why(source, target, opts, eps_updates)))
    _raise_refusals(refusals)
    _check_shared_gains(model, plans)
    for module in eps_updates:
        setattr(module, "eps", opts.eps)  # noqa: B010 - an attribute the class does not declare
    return plans


def _refuse_unknown(source: Source, target: Target) -> None:
    layer, path = source.layer, source.paths[0]
    if layer is not None and layer.kind == "unknown":
        raise Refusal(
            f"{path or '<root>'} ({layer.class_name}) looks like a norm "
            f"({layer.recognized_by}) but discovery could not tell what it computes, "
            f"so a {CLASS_NAMES[target]} may not replace it; exclude it "
            f"(exclude={path!r}) or map it to None in a policy"
        )


def _already_why(
    source: Source, target: Target, opts: Options, eps_updates: list[nn.Module]
) -> str:
    """Why a layer that already is its target is kept; one whose eps changes joins eps_updates."""
    why = f"already a {CLASS_NAMES[target]}"
    current = getattr(source.module, "eps", None)
    if opts.eps is not None and isinstance(current, float) and current != opts.eps:
        eps_updates.append(source.module)
        why += f"; eps {current:g} -> {opts.eps:g}"
    return why


def _raise_refusals(refusals: list[tuple[str, str]]) -> None:
    if refusals:
        message = refusals[0][1]
        if len(refusals) > 1:
            others = [p or "<root>" for p, _ in refusals[1:]]
            message += f" (and {len(others)} more: {others[:5]})"
        raise ValueError(message + "; nothing was changed")


def plan(s: Source, target: Target, opts: Options) -> Plan | None:
    """Everything needed to build ``s``'s replacement, or None when it already is one."""
    m, path = s.module, s.paths[0]
    name = f"{path or '<root>'} ({type(m).__name__})"
    _refuse_gated(m, name, path, target)
    stats = source_layout(s)
    layout, shape = stats.layout, stats.shape
    groups = opts.num_groups or (stats.groups if stats.groups else 32)
    out_layout: Literal["channels-last", "channels-first"] = (
        "channels-last" if layout == "channels-last" else "channels-first"
    )
    _refuse_axis(name, path, target, stats, opts)
    if _already(m, target, layout, out_layout, groups) and not (s.layer and s.layer.gain_offset):
        return None
    _refuse_extra_children(s, name)
    if target == "groupnorm" and shape[0] % groups:
        raise Refusal(
            f"{name} has {shape[0]} channels, which num_groups={groups} does not "
            f"divide; pass num_groups={math.gcd(shape[0], groups)} (or another "
            f"divisor of every converted layer's channels), or exclude it (exclude={path!r})"
        )
    gain_name, bias_name = _affine_names(s, name, target)
    gain = cast(nn.Parameter | None, getattr(m, gain_name) if gain_name else None)
    bias = cast(nn.Parameter | None, getattr(m, bias_name) if bias_name else None)
    _refuse_misfit(name, path, stats, gain, bias)
    gain_offset = _gain_offset(s, name, path, gain)
    eps, eps_text = _eps(s, opts)
    return Plan(
        s,
        target,
        layout,
        out_layout,
        shape,
        stats.affine,
        groups,
        gain,
        gain_name,
        bias,
        bias_name,
        gain_offset,
        eps,
        eps_text,
    )


def _refuse_gated(m: nn.Module, name: str, path: str, target: Target) -> None:
    second = _second_inputs(m)
    if second:
        glob = ".".join("*" if part.isdigit() else part for part in path.split("."))
        raise Refusal(
            f"{name} is a gated norm: its forward takes {', '.join(second)} besides the tensor "
            f"it normalizes, which a {CLASS_NAMES[target]} does not take, so the model would "
            f"fail where it passes one; leave it out with exclude={glob!r}, or with a policy "
            f"key mapping it to None: {{{glob!r}: None, '*': {target!r}}}"
        )


def _refuse_axis(name: str, path: str, target: Target, stats: Stats, opts: Options) -> None:
    """Refuse a target that would normalize along another axis than the source does."""
    layout, shape = stats.layout, stats.shape
    if target in ("layernorm", "rmsnorm") and layout in _STATISTICS and not opts.channels_first:
        raise Refusal(
            f"{name} normalizes each of its {shape[0]} channels over {_STATISTICS[layout]}, "
            f"but a {target} normalizes the features of one position; pass "
            f"channels_first=True to normalize the {shape[0]} channels at every position (as "
            "ConvNeXt's LayerNorm2d does), convert it to 'groupnorm', or exclude it "
            f"(exclude={path!r})"
        )
    if target in ("groupnorm", "batchnorm", "syncbatchnorm") and layout == "channels-last":
        raise Refusal(
            f"{name} normalizes the last dim of each position (channels-last), but a {target} "
            "normalizes dim 1 of an (N, C, *) input, which here is not the channel dim; pick "
            f"'layernorm', 'rmsnorm' or 'dyt' for it, or exclude it (exclude={path!r})"
        )


def _refuse_extra_children(s: Source, name: str) -> None:
    """Refuse a module that runs more than the norm it wraps (a fused norm and activation)."""
    m, path = s.module, s.paths[0]
    wrapped = s.layer.wraps if s.layer is not None else None  # the norm it applies a gain to
    extra = [
        n
        for n, c in m.named_children()
        if not isinstance(c, nn.Identity)
        and not (wrapped and inside(wrapped, f"{path}.{n}" if path else n))
    ]
    inner = [n for n in extra if norm_rules.name_match(getattr(m, n)) is not None]
    if inner and not s.traced:
        raise Refusal(
            f"{name} holds the norm {inner[0]!r}; whether it only applies a gain and bias to "
            "that norm's output shows in one forward pass: pass example_inputs=(x,), or exclude "
            f"it (exclude={path!r})"
        )
    if extra:
        raise Refusal(
            f"{name} also runs {extra} inside its forward (a fused norm and activation); "
            f"converting it would drop them; exclude it (exclude={path!r})"
        )


def _refuse_misfit(
    name: str, path: str, stats: Stats, gain: nn.Parameter | None, bias: nn.Parameter | None
) -> None:
    for what, p in (("gain", gain), ("bias", bias)):
        if p is not None and p.numel() not in (1, math.prod(stats.affine)):
            raise Refusal(
                f"{name} has a {what} of shape {tuple(p.shape)}, which does not fit its "
                f"{math.prod(stats.affine)} normalized features; exclude it (exclude={path!r})"
            )


def _gain_offset(s: Source, name: str, path: str, gain: nn.Parameter | None) -> float:
    """The source's gain offset (Gemma's ``1 + weight``: 1.0); a refusal where its gain is
    carried over and discovery could not tell."""
    offset = s.layer.gain_offset if s.layer is not None else 0.0
    if offset is None and gain is not None:
        raise Refusal(
            f"{name} scales by its weight or by 1 + weight, and discovery could not run it to "
            "tell which; pass example_inputs, or exclude it (exclude="
            f"{path!r})"
        )
    return offset or 0.0


def _eps(s: Source, opts: Options) -> tuple[float | None, str]:
    """The new layer's eps (the given one, else the source's) and how the report names it."""
    src_eps = s.layer.eps if s.layer is not None else None
    if opts.eps is not None:
        return opts.eps, f"eps={opts.eps:g} (given)"
    return src_eps, f"eps={src_eps:g}" if src_eps is not None else ""


def _second_inputs(m: nn.Module) -> list[str]:
    """Parameters of ``m.forward`` past its input that may carry a second tensor (a gate).

    Those are the required ones and those defaulting to None that are unannotated or annotated
    with a tensor; options with other defaults (``inplace=False``), ``*args`` and ``**kwargs``
    are not.
    """
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a readable signature
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [p for p in params if p.kind not in variadic]
    if not named or named[0] is not params[0]:  # forward(self, *inputs): nothing to read
        return []
    return [
        p.name
        for p in named[1:]
        if p.default is inspect.Parameter.empty
        or (p.default is None and (p.annotation is p.empty or "Tensor" in str(p.annotation)))
    ]


def _already(m: nn.Module, target: Target, layout: Layout, out_layout: str, groups: int) -> bool:
    """Whether ``m`` already is what ``target`` would build."""
    same_axis = layout == out_layout
    if target == "layernorm":
        return isinstance(m, nn.LayerNorm) and same_axis
    if target == "rmsnorm":
        return isinstance(m, nn.RMSNorm) and same_axis
    if target == "groupnorm":
        return isinstance(m, nn.GroupNorm) and m.num_groups == groups
    if target == "batchnorm":
        return isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    if target == "syncbatchnorm":
        return isinstance(m, nn.SyncBatchNorm)
    if target == "dyt":
        return isinstance(m, DyT) and m.channels_first == (out_layout == "channels-first")
    return False


def _affine_names(s: Source, name: str, target: Target) -> tuple[str | None, str | None]:
    """Which of the layer's own parameters is the gain (gamma) and which the bias (beta)."""
    params = [n for n, _ in s.module.named_parameters(recurse=False)]
    if isinstance(s.module, DyT):
        params.remove("alpha")  # DyT's own scalar: dropped by any other target
    lowered = {n.lower(): n for n in params}
    gain = next((lowered[n] for n in _GAIN_NAMES if n in lowered), None)
    bias = next((lowered[n] for n in _BIAS_NAMES if n in lowered), None)
    rest = [n for n in params if n not in (gain, bias)]
    if gain is None and len(rest) == 1:
        gain = rest.pop()
    if rest:
        raise Refusal(
            f"{name} has parameters {rest} besides a gain and a bias, which a {target} has no "
            f"place for; exclude it (exclude={s.paths[0]!r})"
        )
    return gain, bias


def _check_shared_gains(model: nn.Module, plans: list[Plan]) -> None:
    """A gain shifted in place (Gemma) must not also serve a layer that is not converted."""
    shifted = {id(p.gain): p for p in plans if p.gain_offset and p.gain is not None}
    if not shifted:
        return
    converting = {id(p.source.module) for p in plans}
    for path, m in model.named_modules():
        if id(m) in converting:
            continue
        for pname, param in m.named_parameters(recurse=False):
            if id(param) in shifted:
                owner = shifted[id(param)]
                raise ValueError(
                    f"{owner.source.paths[0]}.{owner.gain_name} is also {path}.{pname}, which is "
                    "not being converted; folding Gemma's 1 + weight into it would change that "
                    "layer too: convert both (include both paths) or neither; nothing was changed"
                )
