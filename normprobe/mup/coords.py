"""muP's coordinate check: activation RMS per width and training step (`coord_check`), and its
log-log slopes and picture (`CoordTable`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import plots
from .param_groups import Optimizer, mup_param_groups
from .shapes import is_marked

# each panel of the coordinate-check picture (`CoordTable.plot`: one per step), in pixels
COORD_PANEL_SIZE = (310, 280)


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
    _check_arguments(widths, steps, seeds, optimizer, lr)
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
                is_mup = is_marked(model)
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


def _check_arguments(widths: list[int], steps: int, seeds: int, optimizer: str, lr: float) -> None:
    """Refuse fewer than two integer widths, and a bad ``steps``/``seeds``/``optimizer``/``lr``."""
    if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in widths):
        raise ValueError(f"coord_check needs two or more integer widths, got {widths!r}")
    for name, count in (("steps", steps), ("seeds", seeds)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")


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
