"""Finding the norm layers of a model (its discovery map, each layer's role and position) and
choosing, by policy key, include and exclude, which of them become which target."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from ..common import example_call
from ..discovery import (
    DiscoveryWarning,
    ModelMap,
    NormLayer,
    block_glob,
    discover,
    discover_on_carried,
    inside,
    refusal,
)
from ..layers import DyT
from .report import ConversionReport, warn
from .targets import POSITIONS, ROLES, Target


def resolve_map(
    model: nn.Module,
    policy: dict[str, Target | None],
    example_inputs: tuple[Any, ...] | torch.Tensor | None,
    example_kwargs: Mapping[str, Any] | None,
    model_map: ModelMap | None,
) -> ModelMap:
    """``model_map`` checked against ``model``, else a map discovery makes of it."""
    if model_map is None:
        model_map = _discover(model, example_inputs, example_kwargs)
    else:
        _check_map(model, model_map)
    roles = [k for k in policy if k in ROLES or k in POSITIONS]
    if roles and not model_map.traced:
        raise ValueError(
            f"policy keys {roles} are roles, which discovery knows only after watching one "
            "forward pass: pass example_inputs=(x,) (and example_kwargs=... for keyword "
            "inputs) or model_map=normprobe.discover(model, x)"
        )
    return model_map


def _discover(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor | None,
    example_kwargs: Mapping[str, Any] | None,
) -> ModelMap:
    # without inputs given, those the model carries (transformers' dummy_inputs)
    args, kwargs = example_call(model, example_inputs, example_kwargs, own=False)
    with warnings.catch_warnings():
        # our own warning says the same thing about norms; residual adds don't matter here
        warnings.simplefilter("ignore", DiscoveryWarning)
        if args or kwargs:
            return discover(model, *args, **kwargs)
        return discover_on_carried(model, *example_call(model))


def _check_map(model: nn.Module, model_map: ModelMap) -> None:
    modules = dict(model.named_modules())
    for n in model_map.norms:
        m = modules.get(n.path)
        if m is None or type(m).__name__ != n.class_name:
            now = "has no such module" if m is None else f"has a {type(m).__name__} there"
            raise ValueError(
                f"model_map lists {n.class_name} at {n.path!r}, but {type(model).__name__} "
                f"{now}: pass the map normprobe.discover() made of this model as it is now"
            )


@dataclass
class Source:
    """A norm layer as discovery describes it, with every name its module is registered under."""

    layer: NormLayer | None  # None for a DyT, which discovery does not list
    module: nn.Module
    paths: tuple[str, ...]
    traced: bool
    role: str | None = None
    position: str | None = None


def sources(model: nn.Module, model_map: ModelMap) -> list[Source]:
    """The map's norm layers, and any `DyT` it does not list."""
    names: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(path)
    modules = dict(model.named_modules())
    positions = _positions(model_map) if model_map.traced else {}
    found = []
    for n in model_map.norms:
        m = modules[n.path]
        role = n.role if model_map.traced else None
        paths = tuple(names[id(m)])
        found.append(Source(n, m, paths, model_map.traced, role, positions.get(n.path)))
    listed = {id(s.module) for s in found}
    for m in modules.values():
        if isinstance(m, DyT) and id(m) not in listed:
            found.append(Source(None, m, tuple(names[id(m)]), model_map.traced))
    return found


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
        attends = any(inside(lay, a) for lay in add.branch_layers for a in attention)
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


def select(
    found: list[Source],
    policy: dict[str, Target | None],
    model_map: ModelMap,
    include: str | Iterable[str] | None,
    exclude: str | Iterable[str] | None,
    report: ConversionReport,
) -> list[tuple[Source, Target]]:
    """The layers to convert and their targets; the others go to ``report.kept``."""
    includes, excludes = _patterns(include), _patterns(exclude)
    _warn_unmatched(found, model_map, includes, excludes)
    globs = [k for k in policy if k != "*" and k not in ROLES and k not in POSITIONS]
    used: set[str] = set()
    chosen = []
    for s in found:
        if includes and not any(_matches(p, s.paths) for p in includes):
            continue
        if any(_matches(p, s.paths) for p in excludes):
            continue
        key = _policy_key(s, policy, globs)
        if key is None:
            report.kept.append((s.paths[0], "no policy key selects it"))
            continue
        used.add(key)
        target = policy[key]
        if target is None:
            report.kept.append((s.paths[0], f"policy key {key!r} leaves it"))
        else:
            chosen.append((s, target))
    _warn_unused(policy, used, model_map)
    return chosen


def _policy_key(s: Source, policy: dict[str, Target | None], globs: list[str]) -> str | None:
    """The key choosing ``s``: the first matching glob, else its position, role, or ``"*"``."""
    key = next((g for g in globs if _matches(g, s.paths)), None)
    if key is None and s.position in policy:
        key = s.position
    if key is None and s.role in policy:
        key = s.role
    if key is None and "*" in policy:
        key = "*"
    return key


def _warn_unmatched(
    found: list[Source], model_map: ModelMap, includes: list[str], excludes: list[str]
) -> None:
    for arg, patterns in (("include", includes), ("exclude", excludes)):
        for pat in patterns:
            if not any(_matches(pat, s.paths) for s in found):
                warn(
                    f"{arg}={pat!r} matches no norm layer of {model_map.model_type}; "
                    f"norm layers are at e.g. {[s.paths[0] for s in found][:4]}"
                )


def _warn_unused(policy: dict[str, Target | None], used: set[str], model_map: ModelMap) -> None:
    for key in (k for k in policy if k not in used):
        hint = ""
        if key not in (*ROLES, *POSITIONS, "*"):
            hint = (
                f" (a key is a role {list(ROLES)}, a position {list(POSITIONS)}, '*', or a "
                "module-path glob)"
            )
        warn(f"policy key {key!r} selects no norm layer of {model_map.model_type}{hint}")


def refuse_doubts(model_map: ModelMap, chosen: list[tuple[Source, Target]]) -> None:
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
