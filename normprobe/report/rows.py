"""The table of a run: one row per (stack, metric) over the logged steps, per-block and
per-module series reduced to one number per step."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from ..metrics import SERIES
from ..metrics.core.base import MODEL, Points, RunTag
from ..metrics.core.run import run_tags

# A change of less than 10% between the first and the last value reads as "flat".
TREND_FLAT = 0.1


@dataclass(frozen=True)
class Trend:
    """One row of the table: a metric of one stack over the logged steps.

    Attributes:
        stack: the stack's tag name, or ``"model"`` for what belongs to no stack.
        metric: the row's name: the family, with the reduction over blocks or modules in
            brackets (``resid_rms[last]``) and the norm's position in its block (``.ln_1``).
        steps: the logged steps that have a value.
        values: the value at each of those steps.
        tags: the TensorBoard tags the row was computed from.
    """

    stack: str
    metric: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    tags: tuple[str, ...]

    @property
    def first(self) -> float:
        return self.values[0]

    @property
    def last(self) -> float:
        return self.values[-1]

    @property
    def min(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return min(finite) if finite else math.nan

    @property
    def max(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return max(finite) if finite else math.nan

    @property
    def trend(self) -> str:
        """``flat``, ``up x3.2``, ``down x0.41``, ``up``/``down`` (sign change), ``non-finite``."""
        if len(self.values) < 2:
            return "one step"
        first, last = self.first, self.last
        if not (math.isfinite(first) and math.isfinite(last)):
            return "non-finite"
        scale = max(abs(first), abs(last))
        if scale == 0 or abs(last - first) <= TREND_FLAT * scale:
            return "flat"
        word = "up" if last > first else "down"
        if first > 0 and last > 0:
            return f"{word} x{last / first:.3g}"
        return word


def _label(t: RunTag) -> str:
    """The row a tag belongs to: the series, with its reduction over blocks or modules in
    brackets (``resid_rms[last]``) or the module's position in its block (``norm_in_rms .ln_1``)."""
    series = SERIES[t.parsed.series]
    name = t.parsed.series
    if series.shape == "stack":
        return name
    if series.shape == "model":
        return f"{name}/{t.parsed.subject}"
    if series.shape == "block" or series.row == "max":
        return f"{name}[{series.row}]"
    if t.stack == MODEL:
        return f"{name} {t.module}"
    return f"{name} .{t.parsed.layer}" if t.parsed.layer else f"{name}[{series.row}]"


def _members(kind: str, members: list[RunTag]) -> list[RunTag]:
    """The tags a row reads: the last block, the deep half, or all of them."""
    if kind not in ("last", "deep"):
        return members
    depth = max(t.parsed.block or 0 for t in members) + 1
    if kind == "last":
        return [t for t in members if t.parsed.block == depth - 1]
    return [t for t in members if (t.parsed.block or 0) >= depth // 2]


def _reduce(kind: str, values: list[float]) -> float:
    if kind == "max":
        return max(values)
    if kind in ("mean", "deep"):
        return statistics.fmean(values)
    return values[0]  # "last" and "value": one tag


def rows(scalars: dict[str, Points]) -> list[Trend]:
    grouped: dict[tuple[str, str], list[RunTag]] = {}
    for p in run_tags(list(scalars)):
        if SERIES[p.parsed.series].row != "none":
            grouped.setdefault((p.stack, _label(p)), []).append(p)
    rows = []
    for (stack, label), members in grouped.items():
        kind = SERIES[members[0].parsed.series].row
        members = _members(kind, members)
        by_step: dict[int, list[float]] = {}
        for m in members:
            for step, value in scalars[m.tag]:
                by_step.setdefault(step, []).append(value)
        # a step where some member was not logged (not measured there) would mix blocks
        steps = sorted(s for s, vs in by_step.items() if len(vs) == len(members))
        if not steps:
            continue
        values = tuple(_reduce(kind, by_step[s]) for s in steps)
        rows.append(
            Trend(stack, label, tuple(steps), values, tuple(sorted(m.tag for m in members)))
        )
    return sorted(rows, key=lambda t: row_rank(t.stack, t.metric))


def row_rank(stack: str, metric: str) -> tuple[bool, str, int, str]:
    """Where a row goes in the table: by stack (`MODEL` last), then family in registry order."""
    series = re.split(r"[\[ /]", metric, maxsplit=1)[0]
    order = list(SERIES)
    return (stack == MODEL, stack, order.index(series) if series in order else len(order), metric)


def format_number(v: float) -> str:
    """A table cell: four significant digits, ``nan`` for NaN."""
    if math.isnan(v):
        return "nan"
    return f"{v:.4g}"
