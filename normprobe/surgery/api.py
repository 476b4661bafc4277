"""`convert_norms` and `convert_norms_with_report`, and the checks of their arguments; the steps
themselves live beside this module (select, plan, commit)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from ..common import is_compiled
from ..discovery import ModelMap
from ..runtime import attached_probe
from .commit import commit
from .fidelity import keep_bit_identical
from .plan import Options, plan_all
from .report import ConversionReport, warn
from .select import refuse_doubts, resolve_map, select, sources
from .targets import ALIASES, TARGETS, Policy, Target

M = TypeVar("M", bound=nn.Module)
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule")


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
    model_map = resolve_map(model, policy, example_inputs, example_kwargs, model_map)
    report = ConversionReport()
    found = sources(model, model_map)
    if not found:
        warn(
            f"convert_norms found no normalization layers in {type(model).__name__}; "
            "the model is unchanged"
        )
        return model, report
    chosen = select(found, policy, model_map, include, exclude, report)
    refuse_doubts(model_map, chosen)
    opts = Options(eps, num_groups, alpha_init, channels_first)
    plans = plan_all(model, chosen, opts, report)
    plans = keep_bit_identical(model, plans, opts, report)
    if plans:
        model = commit(model, plans, opts, optimizer, report)
    return model, report


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
    if key not in ALIASES:
        raise ValueError(f"unknown norm target {value!r}{where}; expected one of {list(TARGETS)}")
    return ALIASES[key]


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
