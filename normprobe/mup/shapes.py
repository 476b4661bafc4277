"""Marking a model's widths for muP (`mup`) and reading them back (`mup_shapes`).

`mup` records each parameter's shape at a base width in a buffer next to it
(``<module>.mup_base_<param>``), so the width information is part of the ``state_dict`` and
survives ``torch.save``/``load_state_dict``, ``deepcopy`` and DDP's ``module.`` prefix. The
readout's 1/width output multiplier is folded into its weight and learning rate (Tensor
Programs V, Table 3), so the model's forward and its state_dict keys do not change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import nn

from ..reinit.weights import is_transposed, is_weight_layer

MupKind = Literal["hidden", "input", "output", "vector", "fixed"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_PREFIX = "mup_base_"


@dataclass(frozen=True)
class MupShape:
    """How one parameter scales with width.

    Attributes:
        name: the parameter's name in ``model.named_parameters()``.
        shape: its shape in this model.
        base: its shape at the base width.
        width_dims: which dims scale with width (muP's "infinite" dims), per dim.
        kind: ``hidden`` (fan-in and fan-out scale with width), ``input`` (only fan-out:
            embeddings, the first layer), ``output`` (only fan-in: the readout), ``vector``
            (one width dim: biases, norm gains), ``fixed`` (none).
        fanin_mult: fan-in / base fan-in (1 for vectors).
        fanout_mult: fan-out / base fan-out, or the width dim's multiplier for a vector.
        marked: whether `mup` recorded this parameter (``False`` for parameters added later).
    """

    name: str
    shape: tuple[int, ...]
    base: tuple[int, ...]
    width_dims: tuple[bool, ...]
    kind: MupKind
    fanin_mult: float
    fanout_mult: float
    marked: bool = True


# --------------------------------------------------------------------------------------------
# Marking widths
# --------------------------------------------------------------------------------------------


def _occurrences(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(full name, owning module, local name, param) for every parameter, tied ones included."""
    found = []
    for path, m in model.named_modules(remove_duplicate=False):
        for local, p in m.named_parameters(recurse=False):
            found.append((f"{path}.{local}" if path else local, m, local, p))
    return found


def is_marked(model: nn.Module) -> bool:
    return any(n.rpartition(".")[2].startswith(_PREFIX) for n, _ in model.named_buffers())


def _fan_dims(module: nn.Module, p: torch.Tensor) -> tuple[int, int] | None:
    """(out dim, in dim) of a layer's matrix or kernel; None for other parameters."""
    if p.ndim < 2 or not is_weight_layer(module):
        return None
    return (1, 0) if is_transposed(module) else (0, 1)


# A parameter's base shape and which of its dims are width dims.
_Base = tuple[tuple[int, ...], tuple[bool, ...]]


def _classify(
    name: str, module: nn.Module, p: torch.Tensor, base: _Base, marked: bool = True
) -> MupShape:
    shape = tuple(p.shape)
    base_shape, width_dims = base
    inf = [d for d, is_width in enumerate(width_dims) if is_width]
    dims = _fan_dims(module, p)

    def mult(d: int) -> float:
        return shape[d] / base_shape[d]

    kind: MupKind
    if not inf:
        return MupShape(name, shape, base_shape, width_dims, "fixed", 1.0, 1.0, marked)
    if dims is not None:
        out_d, in_d = dims
        if out_d in inf and in_d in inf:
            kind = "hidden"
        elif in_d in inf:
            kind = "output"
        elif out_d in inf:
            kind = "input"
        else:
            kind = "vector"  # only a kernel dim scales: not a fan
        if kind != "vector":
            fan_in = mult(in_d) if in_d in inf else 1.0
            fan_out = mult(out_d) if out_d in inf else 1.0
            return MupShape(name, shape, base_shape, width_dims, kind, fan_in, fan_out, marked)
    if len(inf) > 1:
        raise ValueError(
            f"{name} {shape} has {len(inf)} width dims (base {base_shape}) but is not the "
            "weight of a Linear/Conv/Embedding layer, so its fan-in is unknown; make its "
            "width dims match the base model, or keep it out of muP (requires_grad=False)"
        )
    return MupShape(name, shape, base_shape, width_dims, "vector", 1.0, mult(inf[0]), marked)


def _infer_width(occurrences: list[tuple[str, nn.Module, str, nn.Parameter]]) -> int:
    """The most common in/out dim of the model's layers."""
    counts: Counter[int] = Counter()
    for _, m, _, p in occurrences:
        dims = _fan_dims(m, p)
        if dims is not None:
            counts.update(p.shape[d] for d in dims)
    top = counts.most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        raise ValueError(
            "mup could not tell the model's width (no single most common layer dimension: "
            f"{dict(counts.most_common(4))}); pass width=..."
        )
    return top[0][0]


def _base_from_width(
    occurrences: list[tuple[str, nn.Module, str, nn.Parameter]], base_width: int, width: int | None
) -> dict[str, _Base]:
    if isinstance(base_width, bool) or not isinstance(base_width, int) or base_width < 1:
        raise ValueError(f"base_width must be a positive integer, got {base_width!r}")
    if width is None:
        width = _infer_width(occurrences)
    elif isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive integer, got {width!r}")
    if base_width > width:
        raise ValueError(
            f"base_width {base_width} is larger than the model's width {width}: muP scales a "
            "model up from a narrower base; build the model at a width >= base_width"
        )
    return {
        name: (
            tuple(n // width * base_width if n % width == 0 else n for n in p.shape),
            tuple(n % width == 0 for n in p.shape),
        )
        for name, _, _, p in occurrences
    }


def _base_from_model(
    occurrences: list[tuple[str, nn.Module, str, nn.Parameter]],
    base_model: nn.Module,
    width: int | None,
) -> dict[str, _Base]:
    if not isinstance(base_model, nn.Module):
        raise TypeError(f"base_model must be an nn.Module, got {type(base_model).__qualname__}")
    base = {n: tuple(p.shape) for n, _, _, p in _occurrences(base_model)}
    names = [n for n, _, _, _ in occurrences]
    missing = [n for n in names if n not in base]
    extra = [n for n in base if n not in set(names)]
    if missing or extra:
        raise ValueError(
            "base_model must have the same parameters as the model, built at another width; "
            f"only in the model: {missing[:5]}, only in base_model: {extra[:5]}"
        )
    for name, _, _, p in occurrences:
        b = base[name]
        if len(b) != p.ndim:
            raise ValueError(f"{name} has shape {tuple(p.shape)} but {b} in base_model")
        if any(bd > d for bd, d in zip(b, p.shape, strict=True)):
            raise ValueError(
                f"base_model is wider than the model at {name}: {b} > {tuple(p.shape)}; the "
                "base is the narrow model muP scales up from"
            )
    if all(base[n] == tuple(p.shape) for n, _, _, p in occurrences):
        # the model is at its base width: nothing differs, so find the width dims by the
        # base_width rule (multiples of the width)
        w = width if width is not None else _infer_width(occurrences)
        return _base_from_width(occurrences, w, w)
    return {
        name: (base[name], tuple(b != n for b, n in zip(base[name], p.shape, strict=True)))
        for name, _, _, p in occurrences
    }


def mup(
    model: ModuleT,
    *,
    base_width: int | None = None,
    base_model: nn.Module | None = None,
    width: int | None = None,
    zero_readout: bool = False,
    rescale: bool = True,
) -> ModuleT:
    """Mark how each parameter scales with width, and rescale the init to muP.

    A dim is a width dim when it differs from the base model's (``base_model``), or, with
    ``base_width``, when it is a whole multiple of the model's width (then its base size is the
    same multiple of ``base_width``: a 4x MLP or a fused 3x QKV scale too). Then:

    * the readout (weights whose fan-in alone scales) is multiplied by ``1/sqrt(m)``, m its
      fan-in multiplier: microsoft/mup's ``sqrt(m)`` rescale times the ``1/m`` output
      multiplier, folded into the weight (its learning rate is folded the same way by
      `mup_param_groups`); ``zero_readout=True`` sets it to 0 instead;
    * biases of layers whose fan-in scales are multiplied by ``sqrt(m)`` (torch's default bias
      init shrinks with fan-in; muP wants it width-independent);
    * hidden and input weights are left as they are: their init must already scale as
      1/fan-in (torch's default, ``reinit(model, "kaiming" | "xavier")``); a fixed std such as
      GPT-2's 0.02 is not muP.

    Attention's 1/d_head scale, which muP also asks for, is in the model's forward and is not
    changed. Call `mup` last, after surgery: parameters added later are treated as fixed.

    Args:
        model: the model at its target width; changed in place.
        base_width: the width the hyperparameters were tuned at.
        base_model: the same model built at the base width (the meta device saves memory);
            exact where ``base_width`` would guess (a vocabulary that is a multiple of the width).
        width: the model's width with ``base_width``; by default the most common layer dim.
        zero_readout: start the readout at 0 (recommended by microsoft/mup).
        rescale: ``False`` only (re)marks widths: for a model whose weights come from a muP
            checkpoint, or to change the base of a model marked before.

    Returns:
        ``model``.

    Raises:
        ValueError: neither or both of ``base_width``/``base_model``; a base wider than the
            model; parameters that differ from ``base_model``; a readout tied to an embedding.
        RuntimeError: `mup` already rescaled this model.

    Example::

        >>> model = normprobe.mup(GPT(width=1024), base_model=GPT(width=256))
        >>> opt = torch.optim.AdamW(normprobe.mup_param_groups(model, lr=3e-3))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"mup() needs a torch.nn.Module, got {type(model).__qualname__}")
    if (base_width is None) == (base_model is None):
        raise ValueError("pass exactly one of base_width=... or base_model=... to mup()")
    if is_marked(model) and rescale:
        raise RuntimeError(
            "mup() already ran on this model (it has mup_base_* buffers), and rescaling twice "
            "would shrink the readout again. Build a fresh model and call mup() once; to only "
            "change the base widths (or after loading a muP checkpoint) pass rescale=False"
        )
    occurrences = _occurrences(model)
    if base_model is not None:
        bases = _base_from_model(occurrences, base_model, width)
    else:
        assert base_width is not None
        bases = _base_from_width(occurrences, base_width, width)
    shapes: dict[int, MupShape] = {}
    for name, module, _, p in occurrences:
        found = _classify(name, module, p, bases[name])
        seen = shapes.get(id(p))
        if seen is not None and seen.kind != found.kind:
            output, other = (seen, found) if seen.kind == "output" else (found, seen)
            raise ValueError(
                f"{output.name} is a muP readout but shares its weight with {other.name} "
                f"({other.kind}); muP needs its own 1/width multiplier on a tied readout, which "
                "mup() folds into the weight and cannot do for a shared one. Untie it first, "
                "e.g. `model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())`"
            )
        shapes.setdefault(id(p), found)
    if rescale:
        _rescale(occurrences, shapes, zero_readout)
    for name, module, local, p in occurrences:
        base_shape, width_dims = bases[name]
        record = torch.tensor([base_shape, width_dims], dtype=torch.long, device=p.device)
        module.register_buffer(_PREFIX + local, record.view(2, p.ndim), persistent=True)
    return model


def _rescale(
    occurrences: list[tuple[str, nn.Module, str, nn.Parameter]],
    shapes: dict[int, MupShape],
    zero_readout: bool,
) -> None:
    done: set[int] = set()
    with torch.no_grad():
        for _, module, _, p in occurrences:
            if id(p) in done or not is_weight_layer(module):
                continue
            done.add(id(p))
            weight = next(q for q in module.parameters(recurse=False) if q.ndim >= 2)
            layer = shapes[id(weight)]
            if layer.kind == "output" and zero_readout:
                p.zero_()
            elif layer.kind == "output" and p.ndim >= 2:
                p.mul_(layer.fanin_mult**-0.5)
            elif layer.kind in ("hidden", "output") and p.ndim < 2:
                p.mul_(layer.fanin_mult**0.5)


def mup_shapes(model: nn.Module) -> dict[str, MupShape]:
    """How every parameter of ``model`` scales with width, as `mup` recorded it.

    Args:
        model: a model marked by `mup` (or one that loaded a marked model's state_dict).

    Returns:
        Parameter name -> `MupShape`, each shared parameter once. Parameters without a record
        (added after `mup`) come back ``fixed`` with ``marked=False``.

    Raises:
        ValueError: `mup` never ran on ``model``, or a record does not fit its parameter.

    Example::

        >>> {n: s.kind for n, s in normprobe.mup_shapes(model).items()}
        {'inp.weight': 'input', 'h1.weight': 'hidden', ..., 'out.weight': 'output'}
    """
    return {s.name: s for s, _ in shape_records(model)}


def shape_records(model: nn.Module) -> list[tuple[MupShape, nn.Parameter]]:
    found: list[tuple[MupShape, nn.Parameter]] = []
    seen: set[int] = set()
    any_marked = False
    for name, module, local, p in _occurrences(model):
        if id(p) in seen:
            continue
        seen.add(id(p))
        record = module._buffers.get(_PREFIX + local)
        if record is None:
            shape = tuple(p.shape)
            unmarked = MupShape(name, shape, shape, (False,) * p.ndim, "fixed", 1.0, 1.0, False)
            found.append((unmarked, p))
            continue
        any_marked = True
        if tuple(record.shape) != (2, p.ndim):
            raise ValueError(
                f"the muP record of {name} has shape {tuple(record.shape)}, not (2, {p.ndim}); "
                "re-mark the model with mup(model, ..., rescale=False)"
            )
        base_shape, width_dims = record.tolist()
        base = (tuple(base_shape), tuple(bool(w) for w in width_dims))
        found.append((_classify(name, module, p, base), p))
    if not any_marked:
        raise ValueError(
            f"{type(model).__name__} has no muP widths: call normprobe.mup(model, "
            "base_width=...) first (with a muP checkpoint: call mup(), then load_state_dict)"
        )
    return found
