"""`reinit` and `reinit_with_report`: look the scheme up, check its options, run it on a `Target`,
write the parametrized weights back and report what was set and what was left.

The schemes are declared in `normprobe.reinit.schemes`; `reinit`'s docstring lists them from
there (`_document`).
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ..discovery import ModelMap, ParameterWrites
from ..layers.branch_scale import Wrapper
from .report import ReinitReport
from .scheme import Scheme
from .schemes import REGISTRY, SCHEMES
from .target import Target
from .weights import warn_user

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_ALIASES = {s.replace("_", ""): s for s in SCHEMES}
_REINIT_WAY_OUT = {
    True: "Pass n_layers= (the number of blocks) if the depth is what is in doubt, or fix the map",
    False: "Fix the map, or initialize those modules yourself after a scheme that needs no map "
    "('kaiming', 'xavier')",
}


def reinit(
    model: ModuleT,
    scheme: str,
    *,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
    **options: Any,
) -> ModuleT:
    """Re-initialize ``model`` in place with a named scheme, and return it.

    The existing tensors are overwritten with ``torch.nn.init`` (so the same Parameter objects
    stay, and an optimizer built earlier stays valid; Hugging Face's own init skips weights loaded
    by ``from_pretrained``, this does not). Weight layers are leaf modules with a matrix or kernel
    (Linear, Conv, HF's transposed ``Conv1D``, Embedding); fan-in and fan-out follow each layer's
    layout. A parametrized weight gets the scheme's values as the weight the layer applies: weight
    norm's (either torch API) as ``v = w`` and ``g = ||w||``, any other parametrization's through
    its ``right_inverse`` (one without keeps its value, with a warning). Bare parameters of
    container modules (ViT's ``pos_embed``, LayerScale gammas) are left alone.

    Schemes and their options (filled in from `normprobe.reinit.schemes`):

    <schemes>

    Args:
        model: the model; changed in place.
        scheme: one of <names>.
        example_inputs: positional inputs for one forward; the schemes that act on residual
            branches need them (or ``model_map``) for discovery.
        example_kwargs: keyword inputs for that forward (``{"use_cache": False}``).
        model_map: a map from ``normprobe.discover`` to use instead of discovering again.
        **options: the scheme's options, listed above.

    Returns:
        ``model``. `reinit_with_report` returns a report of what it set too.

    Raises:
        ValueError: unknown scheme or option, an option out of range, or a scheme that needs
            residual branches on a model where discovery found none, or whose map doubts what
            the scheme would change (`ModelMap.doubts`: <branch schemes>
            refuse, before any change, on a doubt affecting ``reinit``; one about
            the depth N only while they count N themselves, so ``n_layers=`` lifts it).

    Example::

        >>> normprobe.reinit(model, "gpt2", example_inputs=(ids,))
        >>> normprobe.reinit(resnet, "fixup", example_inputs=(images,))
        >>> model, report = normprobe.reinit_with_report(model, "gpt2", example_inputs=(ids,))
    """
    changed, _ = reinit_with_report(
        model,
        scheme,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        model_map=model_map,
        **options,
    )
    return changed


def reinit_with_report(
    model: ModuleT,
    scheme: str,
    *,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
    **options: Any,
) -> tuple[ModuleT, ReinitReport]:
    """`reinit`, also returning a report of what each tensor was set to and what was left.

    Takes the same arguments, and raises the same errors, as `reinit`. The report's numbers are
    the ones applied: each drawn tensor's std (and the formula it comes from, such as
    ``0.02/sqrt(2*12)``), each constant's value, and why every other parameter was left.

    Returns:
        ``(model, report)``: the model as `reinit` returns it, and a `ReinitReport`.

    Example::

        >>> model, report = normprobe.reinit_with_report(model, "gpt2", example_inputs=(ids,))
        >>> print(report)
    """
    spec = _scheme(scheme)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(
            f"reinit scheme {spec.name!r} has no option {unknown[0]!r}; its options are "
            f"{sorted(spec.options) or 'none'}"
        )
    t = Target(model, f"reinit(model, {spec.name!r})", example_inputs, example_kwargs, model_map)
    chosen = {**spec.options, **options}
    if spec.branches:
        depth = spec.counts_depth(chosen)
        t.refuse_doubts("reinit", depth, _REINIT_WAY_OUT[depth])
    before = {id(p) for p in model.parameters()}
    # parameters that do not train, copied only if the scheme writes them (a frozen backbone)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    writes = ParameterWrites(frozen)
    copies = [(p, p.detach().clone()) for p in writes.unwatched]  # no memory to watch
    with writes if writes.by_memory else contextlib.nullcontext():
        spec.apply(t, **chosen)
    if t.kept_vectors:
        _warn_kept_vectors(model, spec.name, t.kept_vectors)
    _keep_frozen(t, model, spec.name, frozen, writes, copies)
    for kept in t.applied.commit():
        t.rec.undo(kept, "its parametrization cannot be set to a given tensor: kept its value")
    parametrized = t.applied.parametrized(model)
    left_why = _LeftWhy(t, spec)
    return model, t.rec.report(model, spec.name, chosen, parametrized, before, left_why)


def _keep_frozen(
    t: Target,
    model: nn.Module,
    scheme: str,
    frozen: list[nn.Parameter],
    writes: ParameterWrites,
    copies: list[tuple[nn.Parameter, torch.Tensor]],
) -> None:
    """Put back the parameters that do not train (``requires_grad=False``: a frozen backbone
    under LoRA, YOLO's fixed DFL projection), which no optimizer could repair, and say so."""
    with torch.no_grad():
        changed = writes.restore()
        changed += [p for p, value in copies if not torch.equal(p.detach(), value)]
        for p, value in copies:
            p.copy_(value)
    for p in frozen:
        t.rec.undo(p, f"it does not train (requires_grad=False): {scheme} keeps it")
    if changed:
        names = _names(model, changed)
        warn_user(
            f"reinit(model, {scheme!r}) left {len(changed)} parameter(s) that do not train "
            f"(requires_grad=False: {names}) as they were; set requires_grad=True on them first "
            "to re-initialize them"
        )


def _warn_kept_vectors(model: nn.Module, scheme: str, kept: list[torch.Tensor]) -> None:
    warn_user(
        f"reinit(model, {scheme!r}) kept {len(kept)} vector(s) of weight layers that are not "
        f"biases ({_names(model, kept)}): a flat weight the layer reshapes (e3nn) or a learned "
        "decay has no fan-in a scheme can read; initialize them with the model's own init"
    )


def _names(model: nn.Module, params: Sequence[torch.Tensor]) -> str:
    """The first three of ``params``' names, in the model's order, and how many more."""
    ids = {id(p) for p in params}
    listed = [name for name, p in model.named_parameters() if id(p) in ids]
    more = f" and {len(listed) - 3} more" if len(listed) > 3 else ""
    return ", ".join(listed[:3]) + more


def _scheme(scheme: Any) -> Scheme:
    """The registered scheme ``scheme`` names (``-`` and ``_`` optional, any case)."""
    key = str(scheme).lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise ValueError(f"unknown init scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return REGISTRY[_ALIASES[key]]


class _LeftWhy:
    """Why ``scheme`` left a parameter alone, from the module holding it."""

    def __init__(self, t: Target, scheme: Scheme) -> None:
        self.t, self.scheme = t, scheme
        self.norms = {id(_unwrapped(t.module(n.path))): n for n in t.map.norms}
        self.layers = {id(m) for _, m in t.weight_layers()}

    def __call__(self, name: str) -> str:
        owner = re.sub(r"(^|\.)parametrizations\.[^.]+$", "", name.rpartition(".")[0])
        module = self.t.module(owner)
        scheme = self.scheme.name
        norm = self.norms.get(id(module))
        if norm is not None:
            if norm.kind == "unknown":
                return "a norm of unknown kind: left as it is"
            return f"norm layer: {scheme} keeps norm gains and biases"
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            return f"embedding: {scheme} leaves embeddings as they are"
        if isinstance(module, Wrapper):
            return f"the scale of a {type(module).__name__}: {scheme} leaves it"
        if id(module) in self.layers:
            return self.scheme.leaves_layers or f"{scheme} does not re-initialize it"
        return f"a parameter of {type(module).__name__}, which is no weight layer"


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.inner if isinstance(module, Wrapper) else module


def _listed(s: Scheme) -> str:
    """``s``'s entry in `reinit`'s docstring: name, options with defaults, what it does."""
    options = ", ".join(f"``{k}={v!r}``" for k, v in s.options.items())
    head = f"* ``{s.name}``" + (f" ({options})" if options else "") + ": "
    return textwrap.fill(
        head + " ".join(s.doc.split()),
        width=96,
        initial_indent="    ",
        subsequent_indent="      ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _document(function: Callable[..., Any]) -> None:
    """Fill the registered schemes into ``function``'s docstring."""
    schemes = list(REGISTRY.values())
    branch = [f"``{s.name}``" for s in schemes if s.branches]
    names = ", ".join(f"``{s.name}``" for s in schemes)
    function.__doc__ = (
        (function.__doc__ or "")
        .replace("    <schemes>", "\n".join(_listed(s) for s in schemes))
        .replace("<names>", names)
        .replace("<branch schemes>", ", ".join(branch[:-1]) + " and " + branch[-1])
    )


_document(reinit)
