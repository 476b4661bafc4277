"""``normprobe report RUN_DIR``: what a probed run's event files say, as a table and flags.

A *run* is one directory holding ``events.out.tfevents.*`` files directly (what
``attach(log_dir=...)`` or a Lightning ``TensorBoardLogger`` version folder writes). Several
event files in one directory (a resumed run) are read together, as TensorBoard does. Given a
directory without event files of its own, the runs below it are found (``lightning_logs`` ->
``version_0``, ``version_1``...): `report` wants exactly one, the CLI reports each.

The table has one row per (stack, metric): the first and last logged value, the min, the max
and the trend. Metrics logged per block are reduced to one number per step (see `ROW_REDUCE`),
metrics logged per module (norms, attention, BatchNorm) too, per position within the stack's
blocks. A value that was NaN is not in the event files (the probe skips it), so after a NaN
onset rows end early and say so. Flags compare the run against the thresholds below.

Given two or more run directories, ``normprobe report RUN_A RUN_B ...`` compares them instead
(`normprobe.compare`).

Every flag has a severity: a *problem* is worth stopping a run for (no healthy run of the
calibration set, ``benchmarks/calibration.py``, raises one), a *note* is worth a look (healthy
runs raise some: Pre-LN's bottom-heavy gradients, a lone gradient spike). The table lists
problems first, then notes.

Exit status of ``normprobe report``: 0 when no run raised a problem (notes alone exit 0), 1 when
one did (so that a CI job can fail on it; in a comparison, when any of the runs did), 2 on bad
input (a path that does not exist, no event files, no ``normprobe/`` tags, a folder of several
runs given to compare).

``--json`` prints one JSON document instead of the table (`json.loads` reads it as it is):

* ``schema``: ``"normprobe.report/1"``; a change that breaks readers changes the number.
* ``runs``: one object per run reported (`RunReport.to_dict`):

  - ``path``: the run's directory (or event file); ``event_files``: how many were read;
  - ``steps``: ``{"first", "last", "count"}`` of the logged steps (``null`` first and last
    when none); ``repeated_steps``: steps found in more than one event file;
  - ``rows``: the table, ``{"stack", "metric", "first", "last", "min", "max", "trend",
    "first_step", "last_step"}`` (``trend`` as in the table: ``flat``, ``up x3.2``...);
  - ``flags``: ``{"kind", "severity", "stack", "step", "value", "threshold", "message"}``,
    problems first; ``severity`` is ``"problem"`` or ``"note"``.

* ``skipped``: folders below the path whose event files hold no ``normprobe/`` tag.

Numbers are JSON numbers; a value that is not finite (NaN, ±Inf) is ``null``. On bad input
(exit status 2) nothing is printed to stdout; the error goes to stderr. ``--png`` still draws
the pictures; with ``--json`` the lines naming them go to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from . import plots, tags
from .common import spread
from .jsonout import dumps, json_number
from .metrics import SERIES
from .metrics.base import MODEL, Flag, Points, RunTag
from .metrics.run import flag_lines, problems, run_flags, run_tags
from .sinks import PROFILE_PLUGIN

EVENT_GLOB = "events.out.tfevents.*"
# A change of less than 10% between the first and the last value reads as "flat".
TREND_FLAT = 0.1
# the prefix every normprobe tag starts with
PREFIX = tags.PREFIX + "/"
# the ``schema`` of ``normprobe report --json``
REPORT_SCHEMA = "normprobe.report/1"

# --- the depth-profile picture ---------------------------------------------------------------
PANEL_SIZE = (480, 300)
PANEL_COLUMNS = 2
MAX_PROFILE_LINES = 6


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
        return _draw_profiles(self, Path(path))

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


# --- JSON --------------------------------------------------------------------------------------
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


# --- reading -----------------------------------------------------------------------------------
def find_runs(path: str | Path) -> list[Path]:
    """Every directory at or under ``path`` that holds event files itself, sorted.

    Example::

        for run in find_runs("lightning_logs"):   # lightning_logs/version_0, version_1, ...
            print(report(run))
    """
    root = Path(path)
    if root.is_file():
        return [root] if _is_event_file(root) else []
    if not root.is_dir():
        return []
    dirs = {p.parent for p in root.rglob(EVENT_GLOB) if p.is_file()}
    return sorted(dirs)


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
    events = _read(run)
    if not any(t.startswith(PREFIX) for t in [*events.scalars, *events.histograms]):
        raise ValueError(
            f"the event files of {str(run)!r} hold no {PREFIX} tags (tags there: "
            f"{sorted(events.scalars)[:5]}); was the run logged with normprobe.attach or "
            "normprobe.NormProbe?"
        )
    steps = sorted({s for series in events.scalars.values() for s, _ in series})
    rows = _rows(events.scalars)
    return RunReport(
        run_dir=str(run),
        event_files=events.files,
        repeated_steps=events.repeated,
        steps=steps,
        trends=rows,
        flags=_flags(events),
        profiles=_profiles(events.histograms),
    )


@dataclass
class _Events:
    files: int
    scalars: dict[str, Points]
    histograms: dict[str, list[tuple[int, list[float]]]]
    texts: dict[str, list[tuple[int, str]]]
    repeated: list[int]  # logged steps that more than one event file holds


def _is_event_file(p: Path) -> bool:
    return p.name.startswith("events.out.tfevents.")


def _read(run: Path) -> _Events:
    """Every event file of the run, oldest first, merged by step: where files repeat a step
    (a resumed run, a script run twice into one folder) the later file's values win."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    files = [run] if run.is_file() else sorted(run.glob(EVENT_GLOB), key=_written_at)
    files = [f for f in files if f.is_file()]
    everything = {ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0}
    scalars: dict[str, dict[int, float]] = {}
    histograms: dict[str, dict[int, list[float]]] = {}
    texts: dict[str, dict[int, str]] = {}
    repeated: set[int] = set()
    for f in files:
        acc = ea.EventAccumulator(str(f), size_guidance=everything, purge_orphaned_data=False)
        acc.Reload()
        tags_here = acc.Tags()
        for t in tags_here[ea.SCALARS]:
            values = scalars.setdefault(t, {})
            for e in acc.Scalars(t):
                if t.startswith(PREFIX) and e.step in values:
                    repeated.add(e.step)
                values[e.step] = float(e.value)
        for t in tags_here[ea.HISTOGRAMS]:  # the depth view of runs written before 0.1
            if t.startswith(PREFIX):
                for e in acc.Histograms(t):
                    buckets = [float(b) for b in e.histogram_value.bucket]
                    histograms.setdefault(t, {})[e.step] = buckets
        for t in tags_here[ea.TENSORS]:
            if acc.SummaryMetadata(t).plugin_data.plugin_name == PROFILE_PLUGIN:
                for e in acc.Tensors(t):
                    histograms.setdefault(t, {})[e.step] = list(e.tensor_proto.float_val)
        for t in tags_here[ea.TENSORS]:
            if t.startswith(PREFIX) and t.endswith("/text_summary"):
                for e in acc.Tensors(t):
                    text = b"".join(e.tensor_proto.string_val).decode("utf-8", "replace")
                    texts.setdefault(t.removesuffix("/text_summary"), {})[e.step] = text
    return _Events(
        len(files),
        {t: sorted(v.items()) for t, v in scalars.items()},
        {t: sorted(v.items()) for t, v in histograms.items()},
        {t: sorted(v.items()) for t, v in texts.items()},
        sorted(repeated),
    )


def _written_at(path: Path) -> tuple[float, str]:
    """When an event file was started: the time in its name (``events.out.tfevents.<time>.``),
    else its modification time."""
    parts = path.name.split(".")
    stamp = parts[3] if len(parts) > 3 and parts[3].isdigit() else None
    return (float(stamp) if stamp else path.stat().st_mtime, path.name)


# --- rows --------------------------------------------------------------------------------------
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


def _rows(scalars: dict[str, Points]) -> list[Trend]:
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


# --- flags -------------------------------------------------------------------------------------
def _flags(events: _Events) -> list[Flag]:
    return run_flags(events.scalars, events.texts)


# --- profiles and the picture -------------------------------------------------------------------
def _profiles(
    histograms: dict[str, list[tuple[int, list[float]]]],
) -> dict[str, list[tuple[int, list[float]]]]:
    out = {}
    for tag, events in histograms.items():
        parsed = tags.parse(tag)
        series = SERIES.get(parsed.series) if parsed is not None else None
        if series is None or series.shape != "block":
            continue
        profiles = []
        for step, values in sorted(events, key=lambda e: e[0]):
            values = list(values)
            # blocks without a value (block 0 of resid_cos): the sink wrote 0
            values[: series.first_block] = [math.nan] * min(series.first_block, len(values))
            profiles.append((step, values))
        out[tag[len(PREFIX) :]] = profiles
    return out


def png_size(panels: int) -> tuple[int, int]:
    """The size in pixels of a picture of ``panels`` depth profiles."""
    return plots.grid_size(panels, PANEL_COLUMNS, PANEL_SIZE)


def _draw_profiles(rep: RunReport, path: Path) -> Path:
    if not rep.profiles:
        raise ValueError(
            f"{rep.run_dir!r} has no depth histograms to draw: log a per-block metric "
            f"({', '.join(n for n, s in SERIES.items() if s.shape == 'block')}) to get them"
        )
    order = list(SERIES)
    names = sorted(rep.profiles, key=lambda n: (n.split("/", 1)[1], order.index(n.split("/")[0])))
    panels = [_panel(name, rep.profiles[name]) for name in names]
    return plots.save(path, panels, PANEL_COLUMNS, PANEL_SIZE)


def _panel(name: str, profiles: list[tuple[int, list[float]]]) -> plots.Panel:
    """The panel of one (metric, stack): a line per chosen step, value against block index
    (on a log scale where the values span decades)."""
    family, stack = name.split("/", 1)
    chosen = [profiles[k] for k in spread(len(profiles), MAX_PROFILE_LINES)]
    lines = [
        plots.Line(
            f"step {step}", [(float(b), v) for b, v in enumerate(vs)], plots.ramp(n, len(chosen))
        )
        for n, (step, vs) in enumerate(chosen)
    ]
    return plots.Panel(title=f"{family}, stack {stack}", lines=lines, xlabel="block")


# --- the command line --------------------------------------------------------------------------
def format_number(v: float) -> str:
    """A table cell: four significant digits, ``nan`` for NaN."""
    if math.isnan(v):
        return "nan"
    return f"{v:.4g}"


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on an ``argparse`` subparsers object (``normprobe report``).

    Exit status of the command: 0 when no run raised a problem (notes exit 0), 1 when some did
    (also in a comparison), 2 on bad input (a path that does not exist, no event files, no
    ``normprobe/`` tags, a folder of several runs among the runs to compare).

    Example::

        parser = argparse.ArgumentParser(prog="normprobe")
        report.add_cli(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["report", "runs/a", "--png", "depth.png"])
        raise SystemExit(args.run(args))
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="summarize a probed run's TensorBoard event files, or compare runs",
        description=(
            "Read the event files normprobe wrote and print, per stack, each metric's first, "
            "last, min and max over training with its trend, then flags (residual growth, "
            "representation collapse, NaN onset, BatchNorm drift, logit blow-up, top- or "
            "bottom-heavy gradients...), problems (worth stopping for) first, then notes. Every "
            "run under RUN_DIR is reported. Given two or more runs, compare them: each metric at "
            "the last step all runs logged, its ratio to the first run, and the flags not every "
            "run raised. Exit status: 0 no problem (notes alone included), 1 a problem raised "
            "(by any run), 2 bad input."
        ),
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's log directory, or a parent; two or more runs: compare them",
    )
    parser.add_argument(
        "--png",
        metavar="OUT.png",
        help="also draw the depth profiles there (one file per run: OUT-<run>.png if several)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON document ({REPORT_SCHEMA}, or normprobe.compare/1 for a "
        "comparison) instead of the table",
    )
    parser.set_defaults(run=_run)
    return parser


def runs_under(path: Path) -> list[Path]:
    """`find_runs`, or FileNotFoundError naming the path and what to pass instead."""
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {str(path)!r}; pass a run's log_dir")
    runs = find_runs(path)
    if not runs:
        raise FileNotFoundError(
            f"no TensorBoard event files ({EVENT_GLOB}) in or under {str(path)!r}; pass the "
            "log_dir given to normprobe.attach (or a Lightning logger's directory)"
        )
    return runs


def _run(args: argparse.Namespace) -> int:
    if len(args.run_dirs) > 1:
        return _compare(args)
    root = Path(args.run_dirs[0])
    try:
        runs = runs_under(root)
    except FileNotFoundError as e:
        return _fail(str(e))
    reports, skipped = [], []
    for run in runs:
        try:
            reports.append(report(run))
        except ValueError:
            skipped.append(run)
    if not reports:
        listed = ", ".join(repr(str(r)) for r in skipped[:3])
        listed += f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        return _fail(
            f"no normprobe/ tags in the event files of {listed}; was the probe attached "
            "(normprobe.attach or normprobe.NormProbe)?"
        )
    notes = sys.stderr if args.json else sys.stdout
    for k, rep in enumerate(reports):
        if not args.json:
            print(("\n" if k else "") + rep.table())
        if args.png:
            _draw(rep, _png_path(Path(args.png), root, Path(rep.run_dir), len(reports)), notes)
    if args.json:
        print(dumps(report_document(reports, skipped)))
    elif skipped:
        print(f"\nskipped (no normprobe/ tags): {', '.join(str(s) for s in skipped)}")
    return 1 if any(problems(rep.flags) for rep in reports) else 0


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare_runs  # compare builds on this module

    try:
        comparison = compare_runs(*args.run_dirs)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    print(dumps(comparison.to_dict()) if args.json else comparison.table())
    if args.png:
        runs = [Path(os.path.abspath(r.run_dir)) for r in comparison.reports]
        root = Path(os.path.commonpath(runs))
        for rep, run in zip(comparison.reports, runs, strict=True):
            out = _png_path(Path(args.png), root, run, len(runs))
            _draw(rep, out, sys.stderr if args.json else sys.stdout)
    return 1 if comparison.flagged else 0


def _draw(rep: RunReport, out: Path, notes: TextIO) -> None:
    """Draw the run's depth profiles to ``out``, and say where (or why not) on ``notes``."""
    try:
        rep.write_png(out)
    except ValueError as e:
        print(f"no picture: {e}", file=notes)
    else:
        print(f"depth profiles: {out}", file=notes)


def _png_path(out: Path, root: Path, run: Path, count: int) -> Path:
    if count == 1:
        return out
    try:
        rel = run.relative_to(root)
    except ValueError:
        rel = Path(run.name)
    label = "_".join(rel.parts) or run.name
    return out.with_name(f"{out.stem}-{label}{out.suffix or '.png'}")


def _fail(message: str) -> int:
    print(f"normprobe report: error: {message}", file=sys.stderr)
    return 2
