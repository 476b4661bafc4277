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
(`normprobe.report.compare`).

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

from .cli import add_cli
from .compare import COMPARE_SCHEMA, ComparedRow, Comparison, compare_runs
from .events import EVENT_GLOB, find_runs
from .pictures import MAX_PROFILE_LINES, PANEL_COLUMNS, PANEL_SIZE, png_size
from .rows import TREND_FLAT, Trend
from .summary import REPORT_SCHEMA, RunReport, report

__all__ = [
    "COMPARE_SCHEMA",
    "EVENT_GLOB",
    "MAX_PROFILE_LINES",
    "PANEL_COLUMNS",
    "PANEL_SIZE",
    "REPORT_SCHEMA",
    "TREND_FLAT",
    "ComparedRow",
    "Comparison",
    "RunReport",
    "Trend",
    "add_cli",
    "compare_runs",
    "find_runs",
    "png_size",
    "report",
]
