"""`convert_norms`: swap a model's normalization layers for another kind, in place."""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .common import example_call, is_compiled
from .discovery import DiscoveryWarning, ModelMap, NormLayer, discover, discover_on_carried
from .discovery import norms as norm_rules
from .discovery.doubts import block_glob, refusal
from .discovery.table import table
from .layers import BatchNormNd, DyT, LayerNorm2d, PerHeadLayerNorm, PerHeadRMSNorm, RMSNorm2d
from .runtime import attached_probe

__all__ = [
    "HYBRIDNORM",
    "POSITIONS",
    "ROLES",
    "TARGETS",
    "Conversion",
    "ConversionReport",
    "ConversionWarning",
    "Target",
    "convert_norms",
    "convert_norms_with_report",
]

Target = Literal[
    "layernorm", "rmsnorm", "groupnorm", "batchnorm", "syncbatchnorm", "dyt", "identity"
]
TARGETS: tuple[Target, ...] = (
    "layernorm",
    "rmsnorm",
    "groupnorm",
    "batchnorm",
    "syncbatchnorm",
    "dyt",
    "identity",
)
ROLES = ("pre", "post", "sandwich-post", "qk", "final", "branch", "other")
POSITIONS = ("post-attention", "post-ffn")
HYBRIDNORM: Mapping[str, Target | None] = MappingProxyType(
    {"post-attention": "layernorm", "*": "rmsnorm"}
)
"""LayerNorm right after attention, RMSNorm everywhere else: norm kinds mixed by position, named
after HybridNorm (Zhuo et al. 2025), whose own block mixes placements instead (QKV normalization
in attention, Post-Norm in the feed-forward)."""

M = TypeVar("M", bound=nn.Module)
Policy = Mapping[str, Target | str | None]
Layout = Literal["channels-last", "channels-first", "batch", "spatial", "groups"]

_ALIASES: dict[str, Target] = {t: t for t in TARGETS} | {"dynamictanh": "dyt"}
_GAIN_NAMES = ("weight", "gamma", "gain", "scale", "g")
_BIAS_NAMES = ("bias", "beta", "shift", "b")
_HOOK_ATTRS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule")


class ConversionWarning(UserWarning):
    """`convert_norms` did less than asked, or something needs the caller's attention."""


def _warn(message: str) -> None:
    """Warn at the caller's line: the first frame outside this module."""
    level, frame = 2, sys._getframe(1)  # level 2: _warn's caller
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, ConversionWarning, level)


@dataclass(frozen=True)
class Conversion:
    """One norm layer replaced by `convert_norms`.

    Attributes:
        path: its name in ``model.named_modules()``; ``aliases`` holds any other names of the
            same (shared) module.
        source: the replaced module's class name; ``kind`` what it computed.
        target: what it was converted to; ``result`` the new module's class name.
        carried: state moved into the new module (``weight``, ``bias``, ``eps=1e-05``, ...).
        dropped: state the new module has no place for (``bias``, ``running_mean``, ...).
        created: parameters made fresh (``alpha``, a ``weight`` of ones, ...).
        notes: anything else a reader should know (a folded ``1 + weight``, a renamed key).
        max_abs_diff: for a conversion to the same kind, the largest output difference between
            the old and the new layer on a random input (None when not checked).
    """

    path: str
    aliases: tuple[str, ...]
    source: str
    kind: str
    target: Target
    result: str
    carried: tuple[str, ...]
    dropped: tuple[str, ...]
    created: tuple[str, ...]
    notes: tuple[str, ...] = ()
    max_abs_diff: float | None = None


@dataclass
class ConversionReport:
    """What `convert_norms_with_report` changed; ``print()`` it for a table.

    Attributes:
        conversions: every replaced layer.
        kept: ``(path, why)`` of norm layers left as they were (already the target, or no
            policy key chose them).
        skipped: ``(path, why)`` of norm layers that could not be converted and were left alone.
        new_parameters: full names of parameters the conversion created.
        removed_parameters: full names (before the conversion) of parameters no longer in the
            model.
        renamed_keys: state_dict keys whose tensor now lives under another key, old to new.
        removed_keys, added_keys: state_dict keys that disappeared or appeared.
        optimizer_updated: whether the optimizer passed in had its param groups changed.
    """

    conversions: list[Conversion] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    new_parameters: list[str] = field(default_factory=list)
    removed_parameters: list[str] = field(default_factory=list)
    renamed_keys: dict[str, str] = field(default_factory=dict)
    removed_keys: list[str] = field(default_factory=list)
    added_keys: list[str] = field(default_factory=list)
    optimizer_updated: bool = False

    def __str__(self) -> str:
        swaps = Counter(f"{c.source} -> {c.result}" for c in self.conversions)
        summary = ", ".join(f"{count} {swap}" for swap, count in swaps.items())
        n = len(self.conversions)
        lines = [f"Converted {n} norm layer{'s' if n != 1 else ''}" + (f": {summary}" if n else "")]
        if self.conversions:
            rows = [
                (
                    c.path or "<root>",
                    c.source,
                    c.result,
                    ", ".join(c.carried) or "-",
                    ", ".join(c.dropped) or "-",
                    ", ".join(c.created) or "-",
                )
                for c in self.conversions
            ]
            lines += table(("path", "from", "to", "carried", "dropped", "created"), rows)
        for title, items in (("Kept", self.kept), ("Skipped", self.skipped)):
            if items:
                lines.append(f"{title} ({len(items)})")
                lines += table(("path", "why"), [(p or "<root>", why) for p, why in items])
        changes = [
            f"{len(self.removed_keys)} removed",
            f"{len(self.added_keys)} added",
            f"{len(self.renamed_keys)} renamed",
        ]
        lines.append("state_dict keys: " + ", ".join(changes))
        params = (
            f"parameters: {len(self.new_parameters)} new, {len(self.removed_parameters)} removed"
        )
        if self.optimizer_updated:
            params += " (optimizer updated)"
        elif self.new_parameters:
            params += " (not in any optimizer: build it after the conversion)"
        lines.append(params)
        notes = sorted({n for c in self.conversions for n in c.notes})
        lines += [f"Note: {n}" for n in notes]
        return "\n".join(lines)


def convert_norms(
    model: M,
    target: Target | str | Policy,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    eps: float | None = None,
    num_groups: int | None = None,
    alpha_init: float = 0.5,
    channels_first: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    example_inputs: tuple[Any, ...] | torch.Tensor | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
) -> M:
    """Replace the normalization layers of ``model`` in place and return it.

    Layers are found by `normprobe.discover` (torch norms, Hugging Face and timm norm classes,
    users' own) and by class for `DyT`. Each keeps its statistics layout: per head (a gain of
    shape (heads, head_dim) with statistics over head_dim), over the channels of dim 1 (known from
    the module's ``data_format`` or class, or measured), per group. A layer converted to the kind
    it already computes keeps its outputs bit-identical (one torch would compute with other
    rounding is kept as it is). Each new layer takes over the old one's gain and bias
    Parameter objects where shapes match (so an existing optimizer stays valid), its eps (unless
    ``eps`` is given), training mode and forward/backward hooks (the old handles still remove
    them); a module registered under two names is converted once and stays shared. Gemma's
    ``x_hat * (1 + weight)`` is folded into ``weight`` in place. A module that only applies its
    own gain and bias to a parameter-free norm inside it (``self.ln(x) * self.gamma``) is one
    norm: it is replaced as a whole. Nothing changes if any selected layer cannot be converted.

    Args:
        model: the model; always reassign the result (a new object only when ``model`` itself
            is a norm layer).
        target: one of `TARGETS` (``"rmsnorm"`` is torch's fused ``nn.RMSNorm``), or a policy
            mapping keys to targets (None leaves a layer as it is). A key is a module-path glob
            (``"*.ln_2"``), a discovery role (`ROLES`), a position (``"post-attention"``,
            ``"post-ffn"``: the first norm the attention / feed-forward output passes through),
            or ``"*"`` for the rest. Globs win over positions, positions over roles, roles over
            ``"*"``; among globs the first listed wins. `HYBRIDNORM` is a ready-made policy.
        include: path globs; only matching layers are converted.
        exclude: path globs; matching layers are left alone.
        eps: eps for every new layer (default: each old layer's own).
        num_groups: groups for a ``groupnorm`` target (default: a group norm's own, else 32).
        alpha_init: starting ``alpha`` of a ``dyt`` target.
        channels_first: let BatchNorm/GroupNorm/InstanceNorm become a layernorm/rmsnorm that
            normalizes the channels at every position (ConvNeXt's LayerNorm2d).
        optimizer: an optimizer over ``model``'s parameters, updated when the conversion
            creates parameters (added to the group of the old layer's weight) or removes them.
        example_inputs: positional inputs for one forward pass, so discovery knows each norm's
            role and position (needed by a policy with role or position keys), and measures the
            axis of norms whose class does not declare it.
        example_kwargs: keyword inputs for that forward (``use_cache=False`` for HF models).
        model_map: a map ``discover`` already made of ``model``, instead of example inputs.

    Returns:
        ``model`` with its norm layers replaced. `convert_norms_with_report` returns a report too.

    Raises:
        ValueError: an unknown target, a role policy without example inputs, a layer that
            cannot become the target (a gated norm, whose forward takes a second input) or
            whose axis cannot be known without example inputs (named in the message, with the
            way out), a layer the map doubts (`ModelMap.doubts`: a norm-named module of
            unknown kind; leave it out with ``exclude``), or a ``model_map`` of another model.
        TypeError: ``model`` is not an ``nn.Module``, or is wrapped by DDP/FSDP or compiled.
        RuntimeError: a normprobe probe is attached (remove it, convert, attach again).

    Example::

        >>> model = normprobe.convert_norms(model, "rmsnorm")
        >>> model = normprobe.convert_norms(model, HYBRIDNORM, example_inputs=(tokens,))
    """
    converted, _ = convert_norms_with_report(
        model,
        target,
        include=include,
        exclude=exclude,
        eps=eps,
        num_groups=num_groups,
        alpha_init=alpha_init,
        channels_first=channels_first,
        optimizer=optimizer,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        model_map=model_map,
    )
    return converted


def convert_norms_with_report(
    model: M,
    target: Target | str | Policy,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    eps: float | None = None,
    num_groups: int | None = None,
    alpha_init: float = 0.5,
    channels_first: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    example_inputs: tuple[Any, ...] | torch.Tensor | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
) -> tuple[M, ConversionReport]:
    """`convert_norms`, also returning a report of what was converted, carried and dropped.

    Takes the same arguments, and raises the same errors, as `convert_norms`.

    Returns:
        ``(model, report)``: the model as `convert_norms` returns it, and a `ConversionReport`.

    Example::

        >>> model, report = convert_norms_with_report(model, "dyt")
        >>> print(report)
    """
    _check_model(model)
    policy = _parse_policy(target)
    if num_groups is not None and num_groups < 1:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups}")
    model_map = _model_map(model, policy, example_inputs, example_kwargs, model_map)
    report = ConversionReport()
    sources = _sources(model, model_map)
    if not sources:
        _warn(
            f"convert_norms found no normalization layers in {type(model).__name__}; "
            "the model is unchanged"
        )
        return model, report
    chosen = _select(sources, policy, model_map, include, exclude, report)
    _refuse_doubts(model_map, chosen)
    opts = _Options(eps, num_groups, alpha_init, channels_first)
    plans = _plan_all(model, chosen, opts, report)
    if plans:
        model = _commit(model, plans, opts, optimizer, report)
    return model, report


# ------------------------------------------------------------------------------------------------
# checks and selection


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norms needs a torch.nn.Module, got {type(model).__qualname__}")
    _check_no_probe(model)
    for path, m in model.named_modules():
        names = {c.__name__ for c in type(m).__mro__}
        wrapper = next((w for w in _WRAPPERS if w in names), None)
        where = f" at {path!r}" if path else ""
        if wrapper is not None:
            raise TypeError(
                f"convert_norms got a model wrapped in {wrapper}{where}, which has already "
                "registered the current parameters for gradient reduction; convert the plain "
                f"model (the wrapper's `.module`), then wrap the result in {wrapper}"
            )
        if is_compiled(m):
            raise TypeError(
                f"convert_norms got a model compiled by torch.compile{where}, whose graphs would "
                "keep running the old layers; convert the model before compiling it (the "
                "uncompiled model is `._orig_mod`), then compile the result"
            )


def _check_no_probe(model: nn.Module) -> None:
    for path, m in model.named_modules():
        if attached_probe(m) is not None:
            where = f" at {path!r}" if path else ""
            raise RuntimeError(
                f"a normprobe probe is attached to {type(m).__name__}{where}; its hooks and model "
                "map point at the current layers, so it would stop seeing the converted ones: "
                "call probe.remove(), convert, then attach a new probe"
            )


def _parse_target(value: object, where: str) -> Target:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a target name, got {type(value).__name__}: {value!r}")
    key = value.lower().replace("_", "").replace("-", "")
    if key not in _ALIASES:
        raise ValueError(f"unknown norm target {value!r}{where}; expected one of {list(TARGETS)}")
    return _ALIASES[key]


def _parse_policy(target: object) -> dict[str, Target | None]:
    if isinstance(target, str):
        return {"*": _parse_target(target, "")}
    if isinstance(target, Mapping):
        return {
            str(k): None if v is None else _parse_target(v, f" for policy key {k!r}")
            for k, v in target.items()
        }
    raise TypeError(
        f"target must be a target name or a policy mapping, got {type(target).__name__}: "
        f"{target!r:.80}; valid targets: {list(TARGETS)}"
    )


def _model_map(
    model: nn.Module,
    policy: dict[str, Target | None],
    example_inputs: tuple[Any, ...] | torch.Tensor | None,
    example_kwargs: Mapping[str, Any] | None,
    model_map: ModelMap | None,
) -> ModelMap:
    if model_map is None:
        # without inputs given, those the model carries (transformers' dummy_inputs)
        args, kwargs = example_call(model, example_inputs, example_kwargs, own=False)
        with warnings.catch_warnings():
            # our own warning says the same thing about norms; residual adds don't matter here
            warnings.simplefilter("ignore", DiscoveryWarning)
            if args or kwargs:
                model_map = discover(model, *args, **kwargs)
            else:
                model_map = discover_on_carried(model, *example_call(model))
    else:
        modules = dict(model.named_modules())
        for n in model_map.norms:
            m = modules.get(n.path)
            if m is None or type(m).__name__ != n.class_name:
                now = "has no such module" if m is None else f"has a {type(m).__name__} there"
                raise ValueError(
                    f"model_map lists {n.class_name} at {n.path!r}, but {type(model).__name__} "
                    f"{now}: pass the map normprobe.discover() made of this model as it is now"
                )
    roles = [k for k in policy if k in ROLES or k in POSITIONS]
    if roles and not model_map.traced:
        raise ValueError(
            f"policy keys {roles} are roles, which discovery knows only after watching one "
            "forward pass: pass example_inputs=(x,) (and example_kwargs=... for keyword "
            "inputs) or model_map=normprobe.discover(model, x)"
        )
    return model_map


@dataclass
class _Source:
    """A norm layer as discovery describes it, with every name its module is registered under."""

    layer: NormLayer | None  # None for a DyT, which discovery does not list
    module: nn.Module
    paths: tuple[str, ...]
    traced: bool
    role: str | None = None
    position: str | None = None


def _sources(model: nn.Module, model_map: ModelMap) -> list[_Source]:
    names: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(path)
    modules = dict(model.named_modules())
    positions = _positions(model_map) if model_map.traced else {}
    sources = []
    for n in model_map.norms:
        m = modules[n.path]
        role = n.role if model_map.traced else None
        paths = tuple(names[id(m)])
        sources.append(_Source(n, m, paths, model_map.traced, role, positions.get(n.path)))
    listed = {id(s.module) for s in sources}
    for m in modules.values():
        if isinstance(m, DyT) and id(m) not in listed:
            sources.append(_Source(None, m, tuple(names[id(m)]), model_map.traced))
    return sources


def _inside(path: str, container: str) -> bool:
    return container == "" or path == container or path.startswith(container + ".")


def _positions(model_map: ModelMap) -> dict[str, str]:
    """The first norm each residual branch's output passes through: its position.

    That is the branch's sandwich-post norm, else the add's post norm, else the norm reading the
    add's result: the one where discovery reads it, else, in a sequential stack, the next add's
    pre norm (Pre-LN's norm before the FFN, which HF Llama calls ``post_attention_layernorm``).
    A branch holding an attention module makes it ``post-attention``; any other ``post-ffn``.
    """
    attention = [a.path for a in model_map.attention]
    norm_paths = {n.path for n in model_map.norms}
    adds = model_map.residual_adds
    positions: dict[str, str] = {}
    for i, add in enumerate(adds):
        attends = any(_inside(lay, a) for lay in add.branch_layers for a in attention)
        first = add.sandwich_norm or add.post_norm
        if first is None and add.anchor is not None and add.anchor.hook == "pre":
            first = add.anchor.module if add.anchor.module in norm_paths else None
        if first is None and i + 1 < len(adds) and add.stack is not None:
            following = adds[i + 1]
            first = following.pre_norm if following.stack == add.stack else None
        if first is not None:
            positions.setdefault(first, "post-attention" if attends else "post-ffn")
    return positions


def _patterns(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _matches(pattern: str, paths: tuple[str, ...]) -> bool:
    return any(fnmatchcase(p, pattern) for p in paths)


def _select(
    sources: list[_Source],
    policy: dict[str, Target | None],
    model_map: ModelMap,
    include: str | Iterable[str] | None,
    exclude: str | Iterable[str] | None,
    report: ConversionReport,
) -> list[tuple[_Source, Target]]:
    includes, excludes = _patterns(include), _patterns(exclude)
    for arg, patterns in (("include", includes), ("exclude", excludes)):
        for pat in patterns:
            if not any(_matches(pat, s.paths) for s in sources):
                _warn(
                    f"{arg}={pat!r} matches no norm layer of {model_map.model_type}; "
                    f"norm layers are at e.g. {[s.paths[0] for s in sources][:4]}"
                )
    globs = [k for k in policy if k != "*" and k not in ROLES and k not in POSITIONS]
    used: set[str] = set()
    chosen = []
    for s in sources:
        if includes and not any(_matches(p, s.paths) for p in includes):
            continue
        if any(_matches(p, s.paths) for p in excludes):
            continue
        key = next((g for g in globs if _matches(g, s.paths)), None)
        if key is None and s.position in policy:
            key = s.position
        if key is None and s.role in policy:
            key = s.role
        if key is None and "*" in policy:
            key = "*"
        if key is None:
            report.kept.append((s.paths[0], "no policy key selects it"))
            continue
        used.add(key)
        target = policy[key]
        if target is None:
            report.kept.append((s.paths[0], f"policy key {key!r} leaves it"))
        else:
            chosen.append((s, target))
    for key in (k for k in policy if k not in used):
        hint = ""
        if key not in (*ROLES, *POSITIONS, "*"):
            hint = (
                f" (a key is a role {list(ROLES)}, a position {list(POSITIONS)}, '*', or a "
                "module-path glob)"
            )
        _warn(f"policy key {key!r} selects no norm layer of {model_map.model_type}{hint}")
    return chosen


def _refuse_doubts(model_map: ModelMap, chosen: list[tuple[_Source, Target]]) -> None:
    """Refuse while the map doubts a layer that would be converted."""
    paths = {p for s, _ in chosen for p in s.paths}
    standing = [d for d in model_map.doubts_for("convert_norms") if paths & set(d.modules)]
    if standing:
        globs = list(
            dict.fromkeys(block_glob(p) for d in standing for p in d.modules if p in paths)
        )
        raise ValueError(
            refusal(
                "convert_norms",
                standing,
                f"Leave those layers out with exclude={globs[:4]!r}, or with a policy key "
                "mapping them to None",
            )
        )


# ------------------------------------------------------------------------------------------------
# planning: decide everything and refuse before touching the model


@dataclass(frozen=True)
class _Options:
    eps: float | None
    num_groups: int | None
    alpha_init: float
    channels_first: bool


@dataclass
class _Plan:
    """How one source layer becomes its replacement; built before the model is touched."""

    source: _Source
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


class _Refusal(Exception):
    pass


_CLASS_NAMES: dict[Target, str] = {
    "layernorm": "LayerNorm",
    "rmsnorm": "RMSNorm",
    "groupnorm": "GroupNorm",
    "batchnorm": "BatchNorm",
    "syncbatchnorm": "SyncBatchNorm",
    "dyt": "DyT",
    "identity": "Identity",
}
_STATISTICS = {
    "batch": "the batch and its positions",
    "spatial": "its positions",
    "groups": "its group of channels and positions",
}


def _plan_all(
    model: nn.Module,
    chosen: list[tuple[_Source, Target]],
    opts: _Options,
    report: ConversionReport,
) -> list[_Plan]:
    plans: list[_Plan] = []
    refusals: list[tuple[str, str]] = []
    eps_updates: list[nn.Module] = []
    for source, target in chosen:
        path = source.paths[0]
        if source.layer is not None and source.layer.kind == "unknown":
            layer = source.layer
            refusals.append(
                (
                    path,
                    f"{path or '<root>'} ({layer.class_name}) looks like a norm "
                    f"({layer.recognized_by}) but discovery could not tell what it computes, "
                    f"so a {_CLASS_NAMES[target]} may not replace it; exclude it "
                    f"(exclude={path!r}) or map it to None in a policy",
                )
            )
            continue
        try:
            plan = _plan(source, target, opts)
        except _Refusal as err:
            refusals.append((path, str(err)))
            continue
        if plan is not None:
            plans.append(plan)
            continue
        why = f"already a {_CLASS_NAMES[target]}"
        current = getattr(source.module, "eps", None)
        if opts.eps is not None and isinstance(current, float) and current != opts.eps:
            eps_updates.append(source.module)
            why += f"; eps {current:g} -> {opts.eps:g}"
        report.kept.append((path, why))
    if refusals:
        message = refusals[0][1]
        if len(refusals) > 1:
            others = [p or "<root>" for p, _ in refusals[1:]]
            message += f" (and {len(others)} more: {others[:5]})"
        raise ValueError(message + "; nothing was changed")
    _check_shared_gains(model, plans)
    for module in eps_updates:
        setattr(module, "eps", opts.eps)  # noqa: B010 - an attribute the class does not declare
    fallback = next((p for p in model.parameters() if p.is_floating_point()), None)
    for plan in plans:
        _record_old_output(plan)
    kept = [plan for plan in plans if _rounds_differently(plan, opts, fallback)]
    for plan in kept:
        cls = type(_build(replace(plan, notes=[]), opts, fallback).module).__name__
        report.kept.append(
            (
                plan.source.paths[0],
                f"already computes a {plan.target} over the same features, which a new {cls} "
                "would round differently: kept so its outputs stay bit-identical",
            )
        )
    return [plan for plan in plans if plan not in kept]


def _plan(s: _Source, target: Target, opts: _Options) -> _Plan | None:
    """Everything needed to build ``s``'s replacement, or None when it already is one."""
    m, path = s.module, s.paths[0]
    name = f"{path or '<root>'} ({type(m).__name__})"
    second = _second_inputs(m)
    if second:
        glob = ".".join("*" if part.isdigit() else part for part in path.split("."))
        raise _Refusal(
            f"{name} is a gated norm: its forward takes {', '.join(second)} besides the tensor "
            f"it normalizes, which a {_CLASS_NAMES[target]} does not take, so the model would "
            f"fail where it passes one; leave it out with exclude={glob!r}, or with a policy "
            f"key mapping it to None: {{{glob!r}: None, '*': {target!r}}}"
        )
    stats = _source_layout(s)
    layout, shape = stats.layout, stats.shape
    groups = opts.num_groups or (stats.groups if stats.groups else 32)
    gain_offset = (s.layer.gain_offset or 0.0) if s.layer is not None else 0.0
    out_layout: Literal["channels-last", "channels-first"] = (
        "channels-last" if layout == "channels-last" else "channels-first"
    )
    if target in ("layernorm", "rmsnorm") and layout in _STATISTICS and not opts.channels_first:
        raise _Refusal(
            f"{name} normalizes each of its {shape[0]} channels over {_STATISTICS[layout]}, "
            f"but a {target} normalizes the features of one position; pass "
            f"channels_first=True to normalize the {shape[0]} channels at every position (as "
            "ConvNeXt's LayerNorm2d does), convert it to 'groupnorm', or exclude it "
            f"(exclude={path!r})"
        )
    if target in ("groupnorm", "batchnorm", "syncbatchnorm") and layout == "channels-last":
        raise _Refusal(
            f"{name} normalizes the last dim of each position (channels-last), but a {target} "
            "normalizes dim 1 of an (N, C, *) input, which here is not the channel dim; pick "
            f"'layernorm', 'rmsnorm' or 'dyt' for it, or exclude it (exclude={path!r})"
        )
    if gain_offset == 0.0 and _already(m, target, layout, out_layout, groups):
        return None
    wrapped = s.layer.wraps if s.layer is not None else None  # the norm it applies a gain to
    extra = [
        n
        for n, c in m.named_children()
        if not isinstance(c, nn.Identity)
        and not (wrapped and _inside(wrapped, f"{path}.{n}" if path else n))
    ]
    inner = [n for n in extra if norm_rules.name_match(getattr(m, n)) is not None]
    if inner and not s.traced:
        raise _Refusal(
            f"{name} holds the norm {inner[0]!r}; whether it only applies a gain and bias to "
            "that norm's output shows in one forward pass: pass example_inputs=(x,), or exclude "
            f"it (exclude={path!r})"
        )
    if extra:
        raise _Refusal(
            f"{name} also runs {extra} inside its forward (a fused norm and activation); "
            f"converting it would drop them; exclude it (exclude={path!r})"
        )
    if target == "groupnorm" and shape[0] % groups:
        raise _Refusal(
            f"{name} has {shape[0]} channels, which num_groups={groups} does not "
            f"divide; pass num_groups={math.gcd(shape[0], groups)} (or another "
            f"divisor of every converted layer's channels), or exclude it (exclude={path!r})"
        )
    gain_name, bias_name = _affine_names(s, name, target)
    gain = cast(nn.Parameter | None, getattr(m, gain_name) if gain_name else None)
    bias = cast(nn.Parameter | None, getattr(m, bias_name) if bias_name else None)
    for what, p in (("gain", gain), ("bias", bias)):
        if p is not None and p.numel() not in (1, math.prod(stats.affine)):
            raise _Refusal(
                f"{name} has a {what} of shape {tuple(p.shape)}, which does not fit its "
                f"{math.prod(stats.affine)} normalized features; exclude it (exclude={path!r})"
            )
    src_eps = s.layer.eps if s.layer is not None else None
    if opts.eps is not None:
        eps: float | None = opts.eps
        eps_text = f"eps={opts.eps:g} (given)"
    else:
        eps = src_eps
        eps_text = f"eps={src_eps:g}" if src_eps is not None else ""
    return _Plan(
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


@dataclass(frozen=True)
class _Stats:
    """Which elements a source layer's statistics run over, and the shape of its gain."""

    layout: Layout
    shape: tuple[int, ...]  # normalized shape (channels-last) or (channels,)
    affine: tuple[int, ...]  # the gain's shape as applied: shape, or (heads, *shape) per head
    groups: int | None = None  # of a group norm


def _source_layout(s: _Source) -> _Stats:
    """The source's statistics layout: declared by the module, else measured, else refused."""
    m, layer = s.module, s.layer
    if isinstance(m, DyT):
        cf = m.channels_first
        shape = m.normalized_shape
        return _Stats("channels-first" if cf else "channels-last", shape, shape)
    assert layer is not None
    name = f"{s.paths[0] or '<root>'} ({type(m).__name__})"
    gain = next((p for p in m.parameters(recurse=False) if p.ndim >= 1), None)
    gain_shape = tuple(gain.shape) if gain is not None else ()
    layout, dims = norm_rules.declared_layout(m), layer.dims
    if not layout and s.traced and _fits(layer.layout, dims, gain_shape):
        layout = layer.layout  # measured on the example inputs by discovery
    elif not layout:
        measured = _measure(m, layer, gain_shape)
        if measured is None:
            how = (
                "discovery could not measure it on the example inputs; exclude it"
                if s.traced
                else "pass example_inputs=(x,) so discovery can measure it, or exclude it"
            )
            raise _Refusal(
                f"{name} declares no layout (no data_format attribute, not a known norm class) "
                f"and cannot be told channels-last from channels-first without seeing its input; "
                f"{how} (exclude={s.paths[0]!r})"
            )
        layout, dims = measured
    dims = dims or gain_shape
    if not dims:
        raise _Refusal(
            f"{name}: cannot tell how many features it normalizes; pass example inputs so "
            f"discovery can measure it, or exclude it (exclude={s.paths[0]!r})"
        )
    if layout == "channels-first" and len(dims) > 1:
        if gain_shape and math.prod(gain_shape) == dims[0]:  # a gain per channel: GroupNorm(1)
            return _Stats("groups", dims[:1], dims[:1], 1)
        return _Stats("channels-last", dims, dims)  # over all trailing dims: a plain LayerNorm
    if layout == "groups":
        return _Stats("groups", (dims[-1],), (dims[-1],), dims[0] if len(dims) > 1 else None)
    if layout in ("channels-first", "batch", "spatial"):
        return _Stats(cast(Layout, layout), (dims[-1],), (dims[-1],))
    k = len(dims)
    per_head = len(gain_shape) > k and gain_shape[-k:] == dims
    return _Stats("channels-last", dims, gain_shape if per_head else dims)


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
    ref = _reference(m)
    if not gain_shape or ref is None or ref.device.type == "meta":
        return None
    a, b = [n for n in (5, 7, 3, 11, 13) if n not in gain_shape][:2]
    gen = torch.Generator().manual_seed(0)

    def run(*shape: int) -> norm_rules.Behaviour | None:
        x = torch.randn(shape, generator=gen).to(ref.device, ref.dtype)
        hooks = {attr: getattr(m, attr) for attr in _HOOK_ATTRS}
        try:  # the layer's own hooks stay quiet on made-up inputs
            for attr, value in hooks.items():
                setattr(m, attr, type(value)())
            return norm_rules.probe(m, (x,), {}, layer.eps)
        finally:
            for attr, value in hooks.items():
                setattr(m, attr, value)

    last: tuple[int, ...] | None = None
    lead = [(2, a), (2, a, b)] if len(gain_shape) == 1 else [(2, a)]
    for shape in (tuple((*lo, *gain_shape)) for lo in lead):
        found = run(*shape)
        varying = found.varying if found is not None else ()
        start = min(varying, default=0)
        # statistics over a run of trailing dims inside the gain's shape: channels-last
        if varying == tuple(range(start, len(shape))) and start >= len(shape) - len(gain_shape):
            last = shape[start:]
            break
    first: tuple[str, tuple[int, ...]] | None = None
    if math.prod(gain_shape[1:]) == 1:  # one gain per channel: (C,) or (C, 1, 1)
        c = gain_shape[0]
        found = run(2, c, a, b)
        if found is not None and found.layout in ("channels-first", "groups", "batch", "spatial"):
            whole = found.layout == "channels-first" and len(found.dims) > 1
            first = ("groups", (1, c)) if whole else (found.layout, found.dims)
    if (last is None) == (first is None):
        return None
    return ("channels-last", last) if last is not None else first


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


def _affine_names(s: _Source, name: str, target: Target) -> tuple[str | None, str | None]:
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
        raise _Refusal(
            f"{name} has parameters {rest} besides a gain and a bias, which a {target} has no "
            f"place for; exclude it (exclude={s.paths[0]!r})"
        )
    return gain, bias


def _check_shared_gains(model: nn.Module, plans: list[_Plan]) -> None:
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
                plan = shifted[id(param)]
                raise ValueError(
                    f"{plan.source.paths[0]}.{plan.gain_name} is also {path}.{pname}, which is "
                    "not being converted; folding Gemma's 1 + weight into it would change that "
                    "layer too: convert both (include both paths) or neither; nothing was changed"
                )


def _reference(m: nn.Module) -> torch.Tensor | None:
    return next((t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))), None)


def _record_old_output(plan: _Plan) -> None:
    """For a same-kind conversion, run the old layer on a random input to compare later."""
    kind = plan.source.layer.kind if plan.source.layer is not None else "dyt"
    if kind != plan.target or kind not in ("layernorm", "rmsnorm", "dyt"):
        return
    ref = _reference(plan.source.module)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    if device.type == "meta":
        return
    shape = (2, 3, *plan.affine) if plan.out_layout == "channels-last" else (2, plan.shape[0], 3, 3)
    gen = torch.Generator().manual_seed(0)  # the caller's random stream stays untouched
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device, dtype)
    try:
        with torch.no_grad():
            y = plan.source.module.forward(x)  # forward, not __call__: the layer's hooks stay quiet
    except Exception:  # a layer needing more inputs than x: nothing to compare
        return
    if isinstance(y, torch.Tensor) and y.shape == x.shape:
        plan.check_input, plan.old_output = x, y


# ------------------------------------------------------------------------------------------------
# building and committing


@dataclass
class _Built:
    plan: _Plan
    module: nn.Module
    carried: list[str]
    dropped: list[str]
    created: list[str]
    shift: nn.Parameter | None  # a reused gain to add the gain offset to, in place


def _build(plan: _Plan, opts: _Options, fallback: torch.Tensor | None) -> _Built:
    """The replacement module; ``fallback`` gives device and dtype when the old one has none."""
    old, target = plan.source.module, plan.target
    ref = _reference(old)
    ref = fallback if ref is None else ref
    device = ref.device if ref is not None else None
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    affine = plan.gain is not None or plan.bias is not None
    channels = plan.shape[0]
    cf = plan.out_layout == "channels-first"
    stats = _statistics_module(plan.source)
    old_bn = (
        stats
        if isinstance(stats, _BatchNorm) and target in ("batchnorm", "syncbatchnorm")
        else None
    )
    new: nn.Module
    if target == "identity":
        new = nn.Identity()
    elif target == "layernorm" and plan.affine != plan.shape:
        new = PerHeadLayerNorm(
            plan.shape,
            plan.affine,
            eps=1e-5 if plan.eps is None else plan.eps,
            elementwise_affine=affine,
            bias=plan.bias is not None,
            device=device,
            dtype=dtype,
        )
    elif target == "layernorm":
        cls = LayerNorm2d if cf else nn.LayerNorm
        new = cls(
            plan.shape,
            eps=1e-5 if plan.eps is None else plan.eps,
            elementwise_affine=affine,
            bias=plan.bias is not None,
            device=device,
            dtype=dtype,
        )
    elif target == "rmsnorm" and plan.affine != plan.shape:
        new = PerHeadRMSNorm(
            plan.shape, plan.affine, plan.eps, elementwise_affine=affine, device=device, dtype=dtype
        )
    elif target == "rmsnorm":
        rms_cls = RMSNorm2d if cf else nn.RMSNorm
        new = rms_cls(
            plan.shape, eps=plan.eps, elementwise_affine=affine, device=device, dtype=dtype
        )
    elif target == "groupnorm":
        eps = 1e-5 if plan.eps is None else plan.eps
        new = nn.GroupNorm(plan.groups, channels, eps, affine, device=device, dtype=dtype)
    elif target in ("batchnorm", "syncbatchnorm"):
        bn_cls: type[_BatchNorm] = nn.SyncBatchNorm if target == "syncbatchnorm" else BatchNormNd
        new = bn_cls(
            channels,
            eps=1e-5 if plan.eps is None else plan.eps,
            momentum=old_bn.momentum if old_bn is not None else 0.1,
            affine=affine,
            track_running_stats=old_bn.track_running_stats if old_bn is not None else True,
            device=device,
            dtype=dtype,
        )
    else:
        new = DyT(
            plan.affine,
            opts.alpha_init,
            channels_first=cf,
            elementwise_affine=plan.gain is not None,
            bias=plan.bias is not None,
            device=device,
            dtype=dtype,
        )
    built = _Built(plan, new, [], [], [], None)
    _place(built, "weight", plan.gain, plan.gain_name, plan.gain_offset)
    _place(built, "bias", plan.bias, plan.bias_name, 0.0)
    layer = plan.source.layer
    if plan.eps_text and hasattr(new, "eps"):
        built.carried.append(plan.eps_text)
        if layer is not None and layer.eps_placement == "outside-sqrt":
            plan.notes.append("eps moved inside the square root (it was added to the RMS/std)")
    elif plan.eps_text:
        built.dropped.append("eps")
    for name, buf in stats.named_buffers(recurse=False):
        if old_bn is not None:
            setattr(new, name, buf)  # the same tensors, as convert_sync_batchnorm does
            built.carried.append(name)
        else:
            built.dropped.append(name)
    if isinstance(new, _BatchNorm) and old_bn is None:
        plan.notes.append("new BatchNorm running statistics start at mean 0, var 1")
    for name in ("alpha",) if isinstance(old, DyT) and not isinstance(new, DyT) else ():
        built.dropped.append(name)
    for name, _ in new.named_parameters(recurse=False):
        if name not in ("weight", "bias"):
            built.created.append(name)
    old_params = list(old.parameters(recurse=False))
    trainable = any(p.requires_grad for p in old_params) if old_params else True
    for name in built.created:
        getattr(new, name).requires_grad_(trainable)  # a frozen layer stays frozen
    new.train(old.training)
    return built


def _statistics_module(s: _Source) -> nn.Module:
    """The module computing ``s``'s statistics: the norm it wraps, if any, else itself."""
    wrapped = s.layer.wraps if s.layer is not None else None
    if wrapped is None:
        return s.module
    path = s.paths[0]
    return s.module.get_submodule(wrapped[len(path) + 1 :] if path else wrapped)


def _place(
    built: _Built, attr: str, param: nn.Parameter | None, name: str | None, offset: float
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


def _carry_hooks(old: nn.Module, new: nn.Module) -> int:
    """Move forward/backward hooks by sharing the hook dicts, so old handles still remove them."""
    count = 0
    for attr in _HOOK_ATTRS:
        hooks = getattr(old, attr)
        if attr in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_pre_hooks",
            "_backward_hooks",
        ):
            count += len(hooks)
        setattr(new, attr, hooks)
    new._is_full_backward_hook = old._is_full_backward_hook
    return count


def _commit(
    model: M,
    plans: list[_Plan],
    opts: _Options,
    optimizer: torch.optim.Optimizer | None,
    report: ConversionReport,
) -> M:
    params_before = dict(_named_params(model))
    state_before = model.state_dict(keep_vars=True)
    group_of = _groups(optimizer)
    fallback = next((p for p in model.parameters() if p.is_floating_point()), None)
    built = [_build(plan, opts, fallback) for plan in plans]
    with torch.no_grad():
        shifted: set[int] = set()
        for b in built:
            if b.shift is not None and id(b.shift) not in shifted:  # a tied gain moves once
                b.shift.add_(b.plan.gain_offset)
                shifted.add(id(b.shift))
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
    result = cast(M, new_of.get(id(model), model))  # a root norm is replaced by a new object
    for b in built:
        hooks = _carry_hooks(b.plan.source.module, b.module)
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
        _warn(
            f"convert_norms created {len(created)} new parameters (e.g. "
            f"{report.new_parameters[0]!r}) that no existing optimizer holds; pass "
            "optimizer=opt to add them to it, or build the optimizer after this call"
        )
    return result


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
    owner: dict[int, _Built],
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


def _within_rounding(new: torch.Tensor, old: torch.Tensor) -> bool:
    """A few roundings at the output's size: HF norms compute in fp32 and cast back."""
    diff = float((new.double() - old.double()).abs().max())
    scale = max(1.0, float(old.abs().max()))
    return diff <= max(1e-4, 4 * torch.finfo(new.dtype).eps) * scale


def _rounds_differently(plan: _Plan, opts: _Options, fallback: torch.Tensor | None) -> bool:
    """A same-kind conversion whose new layer differs from the old one by rounding only."""
    layer, x, old = plan.source.layer, plan.check_input, plan.old_output
    if layer is None or x is None or old is None or layer.kind != plan.target:
        return False
    if layer.eps_placement == "outside-sqrt" or opts.eps not in (None, layer.eps):
        return False  # a real change, reported as one
    trial = _build(replace(plan, notes=[]), opts, fallback).module
    params = {}
    if plan.gain_offset and plan.gain is not None and trial.weight is plan.gain:
        params["weight"] = plan.gain + plan.gain_offset  # the shift the commit makes in place
    with torch.no_grad():
        y = torch.func.functional_call(trial, params, (x,))
    return not torch.equal(y, old) and _within_rounding(y, old)


def _conversion(b: _Built) -> Conversion:
    plan = b.plan
    diff = None
    if plan.check_input is not None and plan.old_output is not None:
        with torch.no_grad():
            y = b.module.forward(plan.check_input)
        diff = float((y.double() - plan.old_output.double()).abs().max())
        if not _within_rounding(y, plan.old_output):
            _warn(
                f"{plan.source.paths[0]}: the new {type(b.module).__name__} differs from the old "
                f"{type(plan.source.module).__name__} by up to {diff:.3g} on a random input; "
                "check what the old layer computes (convert_norms_with_report shows the details)"
            )
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
