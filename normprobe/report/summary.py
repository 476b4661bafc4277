"""One run summarized: its table, flags and depth profiles (`report`), and the run as
``normprobe report --json`` writes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..jsonout import json_number
from ..metrics.core.base import Flag
from ..metrics.core.run import flag_lines, run_flags
from .events import PREFIX, read_events, runs_under
from .pictures import draw_profiles, profiles
from .rows import Trend, format_number, rows

# the ``schema`` of ``normprobe report --json``
REPORT_SCHEMA = "normprobe.report/1"


@dataclass
class RunReport:
    """What `report` read from one run: rows, flags and depth profiles.

    Attributes:
        run_dir: the run's directory (or event file).
        event_files: how many event files were read.
        steps: every logged step, in order.
        trends: the table's rows, by stack then metric family.
        flags: what crossed a threshold.
        profiles: ``<family>/<stack>`` -> [(step, one value per block)], from the depth
            histograms (NaN where nothing was measured, e.g. block 0 of ``resid_cos``).
        repeated_steps: logged steps found in more than one event file (a resumed run, or a
            script run twice into one folder): the later file's values are the ones read.
    """

    run_dir: str
    event_files: int
    steps: list[int]
    trends: list[Trend]
    flags: list[Flag]
    profiles: dict[str, list[tuple[int, list[float]]]] = field(default_factory=dict)
    repeated_steps: list[int] = field(default_factory=list)

    def row(self, stack: str, metric: str) -> Trend:
        """The row of ``metric`` for ``stack``; KeyError lists the rows there are."""
        for t in self.trends:
            if t.stack == stack and t.metric == metric:
                return t
        have = ", ".join(f"{t.stack}:{t.metric}" for t in self.trends)
        raise KeyError(f"no row {metric!r} for stack {stack!r}; rows: {have}")

    def table(self) -> str:
        """The printable report: a header, the table and the flags."""
        if self.steps:
            span = f"steps {self.steps[0]}..{self.steps[-1]} ({len(self.steps)} logged)"
        else:
            span = "no logged steps"
        files = f"{self.event_files} event file{'s' if self.event_files != 1 else ''}"
        lines = [f"normprobe report: {self.run_dir}", f"{span}, {files}"]
        if self.repeated_steps:
            again = self.repeated_steps
            lines.append(
                f"{len(again)} logged step{'s' if len(again) != 1 else ''} "
                f"({again[0]}..{again[-1]}) appear in "
                "more than one event file: the latest file's values are used"
            )
        lines.append("")
        header = ("stack", "metric", "first", "last", "min", "max", "trend")
        last_step = self.steps[-1] if self.steps else None
        rows = [
            (
                t.stack,
                t.metric,
                format_number(t.first),
                format_number(t.last),
                format_number(t.min),
                format_number(t.max),
                t.trend if t.steps[-1] == last_step else f"{t.trend}, ends at step {t.steps[-1]}",
            )
            for t in self.trends
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for i, r in enumerate([header, *rows]):
            if i > 1 and r[0] == rows[i - 2][0]:
                r = ("", *r[1:])  # the stack's name once, on its first row
            cells = [
                c.rjust(w) if 2 <= j <= 5 else c.ljust(w)
                for j, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
        lines += flag_lines(self.flags)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def write_png(self, path: str | Path) -> Path:
        """Draw the depth profiles: one panel per (metric, stack), a line per chosen step.

        Each panel plots the metric against the block index for up to `MAX_PROFILE_LINES`
        logged steps spread over the run (first and last included), lighter for earlier steps;
        the y axis is a log one where the metric's values span decades. The image is
        ``PANEL_COLUMNS`` panels wide; each panel is `PANEL_SIZE` (`png_size`). It is drawn
        with matplotlib (``pip install normprobe[plot]``).

        Raises:
            ValueError: the run has no depth histograms (no per-block metric was logged).
            ImportError: matplotlib is not installed.

        Example::

            report("runs/a").write_png("runs/a/depth.png")
        """
        return draw_profiles(self, Path(path))

    def to_dict(self) -> dict[str, Any]:
        """The run as ``--json`` writes it: JSON-ready, non-finite numbers as None (see the
        module's docstring for the keys)."""
        return {
            "path": self.run_dir,
            "event_files": self.event_files,
            "steps": span_dict(self.steps),
            "repeated_steps": self.repeated_steps,
            "rows": [
                {
                    "stack": t.stack,
                    "metric": t.metric,
                    "first": json_number(t.first),
                    "last": json_number(t.last),
                    "min": json_number(t.min),
                    "max": json_number(t.max),
                    "trend": t.trend,
                    "first_step": t.steps[0],
                    "last_step": t.steps[-1],
                }
                for t in self.trends
            ],
            "flags": [flag_dict(f) for f in self.flags],
        }


def span_dict(steps: Sequence[int]) -> dict[str, int | None]:
    """``{"first", "last", "count"}`` of sorted steps (first and last None when empty)."""
    return {
        "first": steps[0] if steps else None,
        "last": steps[-1] if steps else None,
        "count": len(steps),
    }


def flag_dict(flag: Flag) -> dict[str, Any]:
    """A flag as ``--json`` writes it."""
    return {
        "kind": flag.kind,
        "severity": flag.severity,
        "stack": flag.stack,
        "step": flag.step,
        "value": json_number(flag.value),
        "threshold": json_number(flag.threshold),
        "message": flag.message,
    }


def report_document(reports: Sequence[RunReport], skipped: Sequence[Path] = ()) -> dict[str, Any]:
    """What ``normprobe report --json`` prints for these runs (`REPORT_SCHEMA`)."""
    return {
        "schema": REPORT_SCHEMA,
        "runs": [r.to_dict() for r in reports],
        "skipped": [str(s) for s in skipped],
    }


def report(run_dir: str | Path) -> RunReport:
    """Read one run's event files and summarize them: table rows, flags and depth profiles.

    Args:
        run_dir: a directory holding ``events.out.tfevents.*`` files (``attach(log_dir=...)``),
            a directory with exactly one such directory below it (``lightning_logs`` with one
            ``version_0``), or one event file.

    Returns:
        A `RunReport`; ``print(it)`` shows the table and the flags.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds no event files.
        ValueError: several runs below ``run_dir`` (report each of `find_runs`), or event
            files without any ``normprobe/`` tag (no probe was attached to that run).

    Example::

        rep = normprobe.report.report("runs/pre_ln")
        print(rep)                       # the table and the flags
        rep.write_png("depth.png")       # the depth profiles
        if any(f.kind == "nan onset" for f in rep.flags): ...
    """
    path = Path(run_dir)
    runs = runs_under(path)
    if len(runs) > 1:
        listed = ", ".join(str(r) for r in runs[:8]) + (" ..." if len(runs) > 8 else "")
        raise ValueError(
            f"{str(path)!r} holds {len(runs)} runs ({listed}); report one of them, or each of "
            "normprobe.report.find_runs(path) (the CLI reports them all)"
        )
    run = runs[0]
    events = read_events(run)
    if not any(t.startswith(PREFIX) for t in [*events.scalars, *events.histograms]):
        raise ValueError(
            f"the event files of {str(run)!r} hold no {PREFIX} tags (tags there: "
            f"{sorted(events.scalars)[:5]}); was the run logged with normprobe.attach or "
            "normprobe.NormProbe?"
        )
    steps = sorted({s for series in events.scalars.values() for s, _ in series})
    return RunReport(
        run_dir=str(run),
        event_files=events.files,
        repeated_steps=events.repeated,
        steps=steps,
        trends=rows(events.scalars),
        flags=run_flags(events.scalars, events.texts),
        profiles=profiles(events.histograms),
    )
