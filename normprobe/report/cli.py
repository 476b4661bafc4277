"""``normprobe report``: the command that reports one run or compares several."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from ..jsonout import dumps
from ..metrics.core.run import problems
from .compare import compare_runs
from .events import runs_under
from .summary import REPORT_SCHEMA, RunReport, report, report_document


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
