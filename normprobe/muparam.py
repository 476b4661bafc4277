"""muP (Yang et al., Tensor Programs V): width-aware init, per-layer learning rates, coord check.

`mup` records each parameter's shape at a base width in a buffer next to it
(``<module>.mup_base_<param>``), so the width information is part of the ``state_dict`` and
survives ``torch.save``/``load_state_dict``, ``deepcopy`` and DDP's ``module.`` prefix. The
readout's 1/width output multiplier is folded into its weight and learning rate (Tensor
Programs V, Table 3), so the model's forward and its state_dict keys do not change.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from . import plots
from .init import is_transposed, is_weight_layer

MupKind = Literal["hidden", "input", "output", "vector", "fixed"]
Optimizer = Literal["adam", "sgd"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_PREFIX = "mup_base_"
# each panel of the coordinate-check picture (`CoordTable.plot`: one per step), in pixels
COORD_PANEL_SIZE = (310, 280)


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


def _is_marked(model: nn.Module) -> bool:
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
    if _is_marked(model) and rescale:
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
    return {s.name: s for s, _ in _records(model)}


def _records(model: nn.Module) -> list[tuple[MupShape, nn.Parameter]]:
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


def mup_param_groups(
    model: nn.Module,
    lr: float,
    optimizer: Optimizer = "adam",
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Parameter groups with muP's per-layer learning rate and weight decay.

    With m a parameter's fan-in multiplier (its width over the base width):

    * ``adam`` (Adam, AdamW and other entrywise-normalized optimizers): hidden matrices and the
      readout get ``lr/m`` and ``weight_decay*m``; everything else ``lr``.
    * ``sgd``: hidden matrices ``lr*fanout_m/fanin_m``; the readout ``lr/m``; input weights,
      biases and gains ``lr*m`` (``weight_decay/m``); fixed parameters ``lr``.

    The readout's entries differ from microsoft/mup's by its folded output multiplier, which
    makes the training dynamics the same.

    Args:
        model: a model marked by `mup`.
        lr: the learning rate tuned at the base width.
        optimizer: ``adam`` or ``sgd``.
        weight_decay: the weight decay tuned at the base width.

    Returns:
        A list of ``{"params", "lr", "weight_decay"}`` dicts for ``torch.optim`` (parameters
        with ``requires_grad=False`` are left out).

    Raises:
        ValueError: the model was never marked, an unknown optimizer, or ``lr <= 0``.

    Example::

        >>> opt = torch.optim.AdamW(normprobe.mup_param_groups(model, lr=1e-2, weight_decay=0.1))
    """
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    records = _records(model)
    unmarked = [s.name for s, _ in records if not s.marked]
    if unmarked:
        warnings.warn(
            f"{len(unmarked)} parameters were added after mup() ({unmarked[:3]}) and are "
            "treated as width-independent; call mup() after surgery to mark them",
            UserWarning,
            stacklevel=2,
        )
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for s, p in records:
        if not p.requires_grad:
            continue
        lr_mult, wd_mult = _multipliers(s, optimizer)
        groups.setdefault((lr * lr_mult, weight_decay * wd_mult), []).append(p)
    return [{"params": ps, "lr": g_lr, "weight_decay": wd} for (g_lr, wd), ps in groups.items()]


def _multipliers(s: MupShape, optimizer: str) -> tuple[float, float]:
    """(lr factor, weight-decay factor) of one parameter."""
    if s.kind == "output":
        return 1 / s.fanin_mult, s.fanin_mult
    if optimizer == "adam":
        if s.kind == "hidden":
            return 1 / s.fanin_mult, s.fanin_mult
        return 1.0, 1.0
    if s.kind == "hidden":
        ratio = s.fanin_mult / s.fanout_mult
        return 1 / ratio, ratio
    if s.kind in ("input", "vector"):
        return s.fanout_mult, 1 / s.fanout_mult
    return 1.0, 1.0


# --------------------------------------------------------------------------------------------
# Coordinate check
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoordTable:
    """Activation RMS of every module, per width and training step, from `coord_check`.

    Attributes:
        widths: the widths, ascending.
        steps: ``0`` (before any update) up to the number of optimizer steps taken.
        modules: module paths (``<root>`` is the model's output), in call order.
        rms: ``(module, step)`` -> RMS of that module's output at each width.
        parametrization: ``muP`` when the models were marked by `mup`, else ``SP``.
        optimizer: ``adam`` or ``sgd``.
        lr: the learning rate given.
    """

    widths: tuple[int, ...]
    steps: tuple[int, ...]
    modules: tuple[str, ...]
    rms: dict[tuple[str, int], tuple[float, ...]]
    parametrization: str
    optimizer: str
    lr: float

    def slope(self, module: str, step: int = -1) -> float:
        """Least-squares slope of log RMS against log width (0 = width-independent)."""
        if module not in self.modules:
            raise KeyError(f"no module {module!r} in the table; known: {list(self.modules)}")
        values = self.rms[(module, self.steps[step])]
        if any(not v > 0 or not math.isfinite(v) for v in values):
            return math.nan
        xs = [math.log(w) for w in self.widths]
        ys = [math.log(v) for v in values]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var

    def slopes(self, step: int = -1) -> dict[str, float]:
        """`slope` of every module at ``step`` (the last by default)."""
        return {m: self.slope(m, step) for m in self.modules}

    def rows(self) -> list[tuple[int, int, str, float]]:
        """``(width, step, module, rms)`` for every measurement."""
        return [
            (w, s, m, self.rms[(m, s)][i])
            for i, w in enumerate(self.widths)
            for s in self.steps
            for m in self.modules
        ]

    def __str__(self) -> str:
        step = self.steps[-1]
        head = (
            f"Coordinate check ({self.parametrization}, {self.optimizer} lr={self.lr:g}): "
            f"activation RMS after {step} steps, slope of log RMS vs log width"
        )
        name_w = max(len("module"), *(len(m) for m in self.modules))
        cols = [f"{w:>9}" for w in self.widths]
        lines = [head, f"  {'module':<{name_w}}  {' '.join(cols)}  {'slope':>6}"]
        for m in self.modules:
            values = " ".join(f"{v:>9.3g}" for v in self.rms[(m, step)])
            lines.append(f"  {m:<{name_w}}  {values}  {self.slope(m):>+6.2f}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write a PNG: one panel per step, RMS against width on log scales, a line per module.

        The panels share their y axis. Non-positive RMS (a zeroed readout at step 0) is left out.
        Each panel is `COORD_PANEL_SIZE`; one legend of the modules sits below them. Drawn with
        matplotlib (``pip install normprobe[plot]``).

        Raises:
            ImportError: matplotlib is not installed.
        """

        def line(i: int, module: str, step: int) -> plots.Line:
            points = [
                (float(w), v) for w, v in zip(self.widths, self.rms[(module, step)], strict=True)
            ]
            return plots.Line(module, points, plots.PALETTE[i % len(plots.PALETTE)])

        panels = [
            plots.Panel(
                title=f"step {s}",
                lines=[line(i, m, s) for i, m in enumerate(self.modules)],
                xlabel="width",
                ylabel="activation RMS" if k == 0 else "",
                xticks=[(float(w), str(w)) for w in self.widths],
                xlog=True,
                ylog=True,
            )
            for k, s in enumerate(self.steps)
        ]
        title = f"{self.parametrization} coordinate check ({self.optimizer}, lr={self.lr:g})"
        return plots.save(
            Path(path), panels, len(panels), COORD_PANEL_SIZE, title, legend="below", sharey=True
        )


def coord_check(
    make_model: Callable[[int], nn.Module],
    widths: Sequence[int],
    inputs: torch.Tensor | Sequence[Any],
    targets: torch.Tensor | None = None,
    *,
    steps: int = 3,
    optimizer: Optimizer = "adam",
    lr: float = 1e-2,
    loss_fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    seeds: int = 1,
    plot: str | os.PathLike[str] | None = None,
) -> CoordTable:
    """Train a model at each width for a few steps and record every module's activation RMS.

    Models marked by `mup` train with `mup_param_groups`; others with one learning rate (SP).
    Under muP the RMS of every activation stays the same as the width grows (slope ~0); under SP
    hidden activations grow with width once training starts.

    Args:
        make_model: builds the model at a width (call `mup` inside it for muP).
        widths: two or more widths.
        inputs: the model's positional input(s), the same batch at every step.
        targets: class indices (cross-entropy) or values (MSE) for the default loss.
        steps: optimizer steps; RMS is recorded before the first and after each.
        optimizer: ``adam`` or ``sgd``.
        lr: learning rate (the base-width one under muP).
        loss_fn: ``loss_fn(output, targets)`` instead of the default loss (mean square of the
            output when ``targets`` is None).
        seeds: runs per width, averaged (seeds 0, 1, ...).
        plot: also write a PNG there (`CoordTable.plot`).

    Returns:
        A `CoordTable`; ``print()`` it for the RMS at the last step with slopes.

    Raises:
        ValueError: fewer than two widths, or a bad ``steps``/``seeds``/``lr``/``optimizer``.

    Example::

        >>> table = normprobe.coord_check(
        ...     lambda w: normprobe.mup(MLP(w), base_width=64), [64, 256, 1024], x, y)
        >>> print(table)
    """
    widths = sorted(set(widths))
    if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in widths):
        raise ValueError(f"coord_check needs two or more integer widths, got {widths!r}")
    for name, count in (("steps", steps), ("seeds", seeds)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    sums: dict[tuple[str, int, int], float] = {}
    order: dict[str, None] = {}
    parametrizations = set()
    with torch.random.fork_rng(devices=[]):
        for w in widths:
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = make_model(w)
                if not isinstance(model, nn.Module):
                    raise TypeError(f"make_model({w}) returned {type(model).__qualname__}")
                is_mup = _is_marked(model)
                parametrizations.add("muP" if is_mup else "SP")
                run = _train_and_record(model, args, targets, steps, optimizer, lr, loss_fn, is_mup)
                for (module, step), value in run.items():
                    order.setdefault(module, None)
                    key = (module, step, w)
                    sums[key] = sums.get(key, 0.0) + value / seeds
    modules = tuple(order)
    table = CoordTable(
        widths=tuple(widths),
        steps=tuple(range(steps + 1)),
        modules=modules,
        rms={
            (m, s): tuple(sums.get((m, s, w), math.nan) for w in widths)
            for m in modules
            for s in range(steps + 1)
        },
        parametrization="/".join(sorted(parametrizations)),
        optimizer=optimizer,
        lr=float(lr),
    )
    if plot is not None:
        table.plot(plot)
    return table


def _train_and_record(
    model: nn.Module,
    args: tuple[Any, ...],
    targets: torch.Tensor | None,
    steps: int,
    optimizer: str,
    lr: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None,
    is_mup: bool,
) -> dict[tuple[str, int], float]:
    if is_mup:
        groups: list[dict[str, Any]] = mup_param_groups(model, lr, optimizer)  # type: ignore[arg-type]
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    opt: torch.optim.Optimizer
    opt = torch.optim.Adam(groups, lr=lr) if optimizer == "adam" else torch.optim.SGD(groups, lr=lr)
    names = {id(m): (p or "<root>") for p, m in model.named_modules()}
    current: list[tuple[str, torch.Tensor]] = []

    def hook(module: nn.Module, inputs: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                current.append((names[id(module)], out.detach().float().pow(2).mean().sqrt()))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    recorded: dict[tuple[str, int], float] = {}
    try:
        for step in range(steps + 1):
            current.clear()
            output = _first_tensor(model(*args))
            # one device sync per step, not one per module
            values = torch.stack([v for _, v in current]).tolist() if current else []
            for (name, _), value in zip(current, values, strict=True):
                recorded.setdefault((name, step), value)
            if step == steps:
                break
            loss = loss_fn(output, targets) if loss_fn is not None else _loss(output, targets)
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()
    finally:
        for h in handles:
            h.remove()
    return recorded


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"coord_check needs the model to return a tensor (or .logits), got {type(output)}; "
        "pass loss_fn= and wrap the model"
    )


def _loss(output: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    if targets is None:
        return output.float().pow(2).mean()
    if targets.is_floating_point():
        return F.mse_loss(output.float(), targets.float())
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())
