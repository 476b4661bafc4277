"""What `reinit_with_report` changed: each tensor's distribution or value, and what it left."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..tables import table

__all__ = ["ReinitReport", "TensorInit", "Treatment"]


@dataclass(frozen=True)
class Treatment:
    """How a tensor (or some of its output rows) was set.

    Attributes:
        how: ``normal`` (drawn from N(0, std)), ``uniform`` (from U(-b, b), b = std * sqrt(3))
            or ``constant`` (every entry set to ``value``).
        std: the standard deviation drawn from (None for a constant).
        value: the value set (None for a draw).
        formula: where the number comes from (``0.02/sqrt(2*12)``, ``sqrt(2)/sqrt(fan_out 576)``).
    """

    how: Literal["normal", "uniform", "constant"]
    std: float | None = None
    value: float | None = None
    formula: str = ""

    def __str__(self) -> str:
        if self.how == "constant":
            return f"= {self.value:g}"
        assert self.std is not None
        if self.how == "uniform":
            return f"uniform ±{self.std * math.sqrt(3):.4g} (std {self.std:.4g})"
        return f"normal std {self.std:.4g}"


def normal(std: float, formula: str) -> Treatment:
    return Treatment("normal", std=std, formula=formula)


def constant(value: float, formula: str) -> Treatment:
    return Treatment("constant", value=float(value), formula=formula)


def scaled(base: Treatment, factor: float, formula: str) -> Treatment:
    """``base``'s draw multiplied by ``factor``."""
    return Treatment(base.how, std=(base.std or 0.0) * factor, formula=formula)


def fans(view: torch.Tensor) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight laid out ``(out, in, *kernel)``, as ``torch.nn.init``."""
    receptive = math.prod(view.shape[2:])
    return view.shape[1] * receptive, view.shape[0] * receptive


def kaiming(view: torch.Tensor, mode: str, gain: float, distribution: str, why: str) -> Treatment:
    """He's std ``gain/sqrt(fan)``, as ``torch.nn.init.kaiming_*_`` computes it."""
    fan = fans(view)[0 if mode == "fan_in" else 1]
    how: Literal["normal", "uniform"] = "uniform" if distribution == "uniform" else "normal"
    return Treatment(how, std=gain / math.sqrt(fan), formula=f"{why}/sqrt({mode} {fan})")


def xavier(view: torch.Tensor, gain: float, distribution: str, why: str) -> Treatment:
    """Glorot's std ``gain*sqrt(2/(fan_in+fan_out))``, as ``torch.nn.init.xavier_*_``."""
    fan_in, fan_out = fans(view)
    how: Literal["normal", "uniform"] = "uniform" if distribution == "uniform" else "normal"
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return Treatment(how, std=std, formula=f"{why}*sqrt(2/({fan_in}+{fan_out}))")


@dataclass(frozen=True)
class TensorInit:
    """One tensor `reinit` set.

    Attributes:
        path: its name: a parameter's (``model.named_parameters()``), a parametrized weight's
            (``fc.weight`` of a weight-normed ``fc``), or a buffer's (DeepNorm's fixed scale).
        treatment: what it was set to.
        outputs: ``(start, stop)`` of the output features set this way, for a fused weight
            drawn in parts (DeepNorm's q|k|v); None for the whole tensor.
        aliases: other names of the same tensor (a tied ``lm_head.weight``).
        parameters: for a parametrized weight, the parameters it is computed from (weight
            norm's ``g`` and ``v``), which hold the values.
        created: a parameter the scheme made (Fixup's scalars); build the optimizer after.
    """

    path: str
    treatment: Treatment
    outputs: tuple[int, int] | None = None
    aliases: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    created: bool = False


@dataclass
class ReinitReport:
    """What `reinit_with_report` did; ``print()`` it for a table.

    Every parameter of the model is named once: in ``changed`` (through its own path, or in the
    ``parameters`` of a parametrized weight) or in ``left``.

    Attributes:
        scheme: the scheme's name; ``options`` the options it ran with.
        changed: every parameter (or parametrized weight) set, in the model's order.
        left: ``(path, why)`` of the parameters left as they were.
        scalers: fixed factors the scheme put on residual branches (DeepNorm's 1/alpha buffers).
        notes: anything else a reader should know (a padding row kept at 0).
    """

    scheme: str
    options: dict[str, Any] = field(default_factory=dict)
    changed: list[TensorInit] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    scalers: list[TensorInit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        created = sum(c.created for c in self.changed)
        head = f"reinit {self.scheme!r}" + (f" ({options})" if options else "")
        tensors = len({c.path for c in self.changed})
        lines = [
            f"{head}: {tensors} tensors set, {len(self.left)} parameters left"
            + (f", {created} created (build the optimizer after)" if created else "")
        ]
        if self.changed:
            lines += table(("tensor", "set to", "from"), [_row(c) for c in self.changed])
        if self.scalers:
            lines.append(f"Fixed branch scalers ({len(self.scalers)})")
            lines += table(("buffer", "set to", "from"), [_row(c) for c in self.scalers])
        if self.left:
            lines.append(f"Left ({len(self.left)})")
            lines += table(("parameter", "why"), self.left)
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _row(c: TensorInit) -> tuple[str, str, str]:
    path = c.path + (f"[{c.outputs[0]}:{c.outputs[1]}]" if c.outputs else "")
    path += f" (also {', '.join(c.aliases)})" if c.aliases else ""
    setting = str(c.treatment) + (" (new)" if c.created else "")
    return path, setting, c.treatment.formula or "-"


class Recorder:
    """Collects, by tensor, what a scheme set and why it left a tensor alone."""

    def __init__(self) -> None:
        self.done: dict[int, list[tuple[Treatment, tuple[int, int] | None]]] = {}
        self.why: dict[int, str] = {}
        self.notes: list[str] = []
        self._held: dict[int, torch.Tensor] = {}  # keeps every id valid

    def record(
        self, p: torch.Tensor, treatment: Treatment, outputs: tuple[int, int] | None = None
    ) -> None:
        """``p`` (or its output rows ``outputs``) was set; a whole-tensor record replaces any."""
        key = id(p)
        self._held[key] = p
        self.why.pop(key, None)
        kept = [r for r in self.done.get(key, []) if outputs and r[1] and r[1] != outputs]
        self.done[key] = [*kept, (treatment, outputs)]

    def leave(self, p: torch.Tensor, why: str) -> None:
        if id(p) not in self.done:
            self._held[id(p)] = p
            self.why[id(p)] = why

    def undo(self, p: torch.Tensor, why: str) -> None:
        """``p`` kept its value after all (its parametrization could not take the new one)."""
        self.done.pop(id(p), None)
        self.leave(p, why)

    def report(
        self,
        model: nn.Module,
        scheme: str,
        options: Mapping[str, Any],
        parametrized: Mapping[int, tuple[str, tuple[nn.Parameter, ...]]],
        before: set[int],
        default_why: Callable[[str], str],
    ) -> ReinitReport:
        """The report over ``model``'s parameters. ``parametrized``: id of each parametrized
        weight's copy -> (its path, the parameters it is computed from); ``before``: ids of
        the parameters the model had before the scheme ran."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        source_of = {id(s): key for key, (_, srcs) in parametrized.items() for s in srcs}
        out = ReinitReport(scheme, dict(options), notes=list(self.notes))
        emitted: set[int] = set()
        for name, p in model.named_parameters():
            key = source_of.get(id(p), id(p))
            if key not in self.done:
                out.left.append((name, self.why.get(key) or default_why(name)))
            elif key not in emitted:
                emitted.add(key)
                if key in parametrized:
                    path, sources = parametrized[key]
                    params = tuple(names[id(s)][0] for s in sources)
                    out.changed += self._changes(key, path, parameters=params)
                else:
                    aliases = tuple(names[key][1:])
                    new = key not in before
                    out.changed += self._changes(key, name, aliases=aliases, created=new)
        for name, b in model.named_buffers():
            if id(b) in self.done:
                out.scalers += self._changes(id(b), name)
        return out

    def _changes(self, key: int, path: str, **extra: Any) -> list[TensorInit]:
        return [TensorInit(path, t, outputs, **extra) for t, outputs in self.done[key]]
