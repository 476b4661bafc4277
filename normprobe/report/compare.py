"""``normprobe report RUN_A RUN_B ...``: probed runs side by side, at the steps they all logged.

Each run is read as `normprobe.report_run` reads it, and its table's rows (stack, metric) are
lined up: a row's values are those at the last *matched* step (a step every run logged) where
every run holding the row has a value, with each run's ratio to the first run (B/A, C/A...).
Flags are compared by (kind, stack): what some runs raised and others did not is listed per
run, what all raised once. Each path names one run: a folder holding several runs is refused,
naming them.

``--json`` prints (schema ``"normprobe.compare/1"``):

* ``schema``: ``"normprobe.compare/1"``;
* ``runs``: each run as ``normprobe report --json`` writes it (``normprobe.report/1``), in the
  order given, plus its ``label`` (``A``, ``B``...); the first run is the baseline of the ratios;
* ``matched_steps``: ``{"first", "last", "count"}`` of the steps every run logged;
* ``rows``: ``{"stack", "metric", "step", "values", "ratios"}``: ``step`` is the matched step
  the values come from (``null`` when no run has a value at a matched step), ``values`` one
  number per run (``null`` where the run has no such row), ``ratios`` each value over the first
  run's (the first is 1; ``null`` where either is missing or the first is 0);
* ``unshared_flags``: one list per run of its flags (``report``'s keys, ``severity``
  included) whose (kind, stack) some other run did not raise; ``shared_flags``: ``{"kind",
  "stack"}`` every run raised.

Non-finite numbers are ``null``, as in ``normprobe.report/1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jsonout import json_number
from ..metrics import Flag
from ..metrics.core.run import problems
from .events import runs_under
from .rows import format_number, row_rank
from .summary import RunReport, flag_dict, report, span_dict

# the ``schema`` of ``normprobe report RUN_A RUN_B --json``
COMPARE_SCHEMA = "normprobe.compare/1"


@dataclass(frozen=True)
class ComparedRow:
    """One (stack, metric) row across the runs.

    Attributes:
        stack: the stack's tag name, or ``"model"``.
        metric: the row's name, as in `normprobe.report.Trend`.
        step: the matched step the values come from: the last one at which every run holding
            the row has a value (None when there is none).
        values: per run, its value at ``step`` (None where the run has no such row).
        ratios: per run, its value over the first run's (the first is 1.0; None where either
            value is missing or the first is 0).
    """

    stack: str
    metric: str
    step: int | None
    values: tuple[float | None, ...]
    ratios: tuple[float | None, ...]


@dataclass
class Comparison:
    """Runs side by side; ``print()`` it for the table.

    Attributes:
        reports: each run's `RunReport`, in the order given (the first is the baseline).
        labels: the runs' names in the table: ``A``, ``B``...
        steps: the matched steps, the logged steps every run has.
        rows: one per (stack, metric) any run has, in the report's order.
        unshared_flags: per run, its flags whose (kind, stack) some other run did not raise.
        shared_flags: the (kind, stack) pairs every run raised.
    """

    reports: list[RunReport]
    labels: list[str]
    steps: list[int]
    rows: list[ComparedRow]
    unshared_flags: list[list[Flag]]
    shared_flags: list[tuple[str, str]]

    @property
    def flagged(self) -> bool:
        """Whether any run raised a problem (``normprobe report``'s exit status 1)."""
        return any(problems(r.flags) for r in self.reports)

    def row(self, stack: str, metric: str) -> ComparedRow:
        """The row of ``metric`` for ``stack``; KeyError lists the rows there are."""
        for r in self.rows:
            if (r.stack, r.metric) == (stack, metric):
                return r
        have = ", ".join(f"{r.stack}:{r.metric}" for r in self.rows)
        raise KeyError(f"no row {metric!r} for stack {stack!r}; rows: {have}")

    def table(self) -> str:
        """The printable comparison: the runs, the matched steps, the table and the flags."""
        lines = [f"normprobe report: {len(self.reports)} runs compared"]
        paths = [r.run_dir for r in self.reports]
        width = max(len(p) for p in paths)
        for label, rep in zip(self.labels, self.reports, strict=True):
            lines.append(f"  {label}  {rep.run_dir:<{width}}  {_run_summary(rep)}")
        last = self.steps[-1]
        lines += [
            f"matched steps: {self.steps[0]}..{last} ({len(self.steps)} logged by every run); "
            f"values at step {last}, ratios to {self.labels[0]}",
            "",
        ]
        base = self.labels[0]
        header = ["stack", "metric", *self.labels, *(f"{lb}/{base}" for lb in self.labels[1:])]
        rows = [
            [
                r.stack,
                r.metric,
                *(_cell(v) for v in r.values),
                *(_cell(q) for q in r.ratios[1:]),
                self._note(r),
            ]
            for r in self.rows
        ]
        if any(r[-1] for r in rows):
            header.append("note")
        else:
            rows = [r[:-1] for r in rows]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        numbers = range(2, 2 + 2 * len(self.labels) - 1)
        for i, r in enumerate([header, *rows]):
            if i > 1 and r[0] == rows[i - 2][0]:
                r = ["", *r[1:]]  # the stack's name once, on its first row
            cells = [
                c.rjust(w) if j in numbers else c.ljust(w)
                for j, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
        unshared = [
            (label, f)
            for label, flags in zip(self.labels, self.unshared_flags, strict=True)
            for f in flags
        ]
        if unshared:
            lines.append(f"Flags not raised by every run ({len(unshared)}, by kind and stack):")
            lines += [f"  {label}  {f.severity:<7}  {f}" for label, f in unshared]
        else:
            lines.append("No flag raised by some runs and not others.")
        if self.shared_flags:
            shared = ", ".join(f"[{kind}] {stack}" for kind, stack in self.shared_flags)
            lines.append(f"Raised by every run: {shared}.")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _note(self, row: ComparedRow) -> str:
        if row.step is None:
            return "no value at a matched step"
        missing = [lb for lb, v in zip(self.labels, row.values, strict=True) if v is None]
        notes = [f"not in {', '.join(missing)}"] if missing else []
        if row.step != self.steps[-1]:
            notes.append(f"at step {row.step}")
        return "; ".join(notes)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (`COMPARE_SCHEMA`; keys in the module's docstring)."""
        return {
            "schema": COMPARE_SCHEMA,
            "runs": [
                {"label": label, **rep.to_dict()}
                for label, rep in zip(self.labels, self.reports, strict=True)
            ],
            "matched_steps": span_dict(self.steps),
            "rows": [
                {
                    "stack": r.stack,
                    "metric": r.metric,
                    "step": r.step,
                    "values": [json_number(v) for v in r.values],
                    "ratios": [json_number(q) for q in r.ratios],
                }
                for r in self.rows
            ],
            "unshared_flags": [[flag_dict(f) for f in flags] for flags in self.unshared_flags],
            "shared_flags": [{"kind": kind, "stack": stack} for kind, stack in self.shared_flags],
        }


def compare_runs(*runs: str | Path | RunReport) -> Comparison:
    """Put two or more runs side by side: each row at the steps they all logged, the ratio of
    each run to the first, and the flags that not every run raised.

    Args:
        runs: run directories (or event files) as `normprobe.report_run` takes them, one run
            each, or reports already read.

    Returns:
        A `Comparison`; ``print(it)`` shows the table.

    Raises:
        FileNotFoundError: a path that does not exist or holds no event files.
        ValueError: fewer than two runs, a path holding several runs, a run without
            ``normprobe/`` tags, or runs that have no logged step in common.

    Example::

        cmp = normprobe.compare_runs("runs/pre_ln", "runs/post_ln")
        print(cmp)
        cmp.row("blocks", "grad_ratio").ratios[1]   # Post-LN's gradient ratio over Pre-LN's
    """
    if len(runs) < 2:
        raise ValueError(f"compare_runs needs two or more runs, got {len(runs)}")
    reports = [r if isinstance(r, RunReport) else _one_run(Path(r)) for r in runs]
    labels = [_letters(i) for i in range(len(reports))]
    steps = sorted(set.intersection(*(set(r.steps) for r in reports)))
    if not steps:
        spans = "; ".join(
            f"{label} ({rep.run_dir}) "
            + (f"{rep.steps[0]}..{rep.steps[-1]}" if rep.steps else "no logged step")
            for label, rep in zip(labels, reports, strict=True)
        )
        raise ValueError(
            f"the runs have no logged step in common ({spans}); log them on the same steps "
            "(the same every=) to compare them"
        )
    keys = {(t.stack, t.metric) for r in reports for t in r.trends}
    rows = [_row(*key, reports, steps) for key in sorted(keys, key=lambda k: row_rank(*k))]
    raised = [{(f.kind, f.stack) for f in r.flags} for r in reports]
    shared = set.intersection(*raised)
    return Comparison(
        reports,
        labels,
        steps,
        rows,
        [[f for f in r.flags if (f.kind, f.stack) not in shared] for r in reports],
        sorted(shared),
    )


def _one_run(path: Path) -> RunReport:
    found = runs_under(path)
    if len(found) > 1:
        listed = " ".join(str(r) for r in found[:8]) + (" ..." if len(found) > 8 else "")
        raise ValueError(
            f"{str(path)!r} holds {len(found)} runs ({listed}); to compare them, name each run "
            f"directory: normprobe report {listed}"
        )
    return report(found[0])


def _row(
    stack: str, metric: str, reports: Sequence[RunReport], matched: Sequence[int]
) -> ComparedRow:
    series = [_values(rep, stack, metric) for rep in reports]
    held = [s for s in series if s is not None]
    common = [step for step in matched if all(step in s for s in held)]
    step = common[-1] if common else None
    values = tuple(None if s is None or step is None else s[step] for s in series)
    return ComparedRow(stack, metric, step, values, _ratios(values))


def _values(rep: RunReport, stack: str, metric: str) -> dict[int, float] | None:
    try:
        trend = rep.row(stack, metric)
    except KeyError:
        return None
    return dict(zip(trend.steps, trend.values, strict=True))


def _ratios(values: tuple[float | None, ...]) -> tuple[float | None, ...]:
    base = values[0]
    if base is None or base == 0:
        return tuple(None for _ in values)
    return tuple(None if v is None else v / base for v in values)


def _run_summary(rep: RunReport) -> str:
    span = f"steps {rep.steps[0]}..{rep.steps[-1]} ({len(rep.steps)} logged)"
    found = len(problems(rep.flags))
    notes = len(rep.flags) - found
    flags = f"{found} problem{'s' if found != 1 else ''}, {notes} note{'s' if notes != 1 else ''}"
    again = len(rep.repeated_steps)
    return f"{span}, {flags}" + (f", {again} steps in several event files" if again else "")


def _cell(value: float | None) -> str:
    return "-" if value is None else format_number(value)


def _letters(index: int) -> str:
    """``A``..``Z``, then ``AA``, ``AB``...: spreadsheet column names."""
    name = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        name = chr(ord("A") + rest) + name
    return name
