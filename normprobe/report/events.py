"""Reading a run's TensorBoard event files: which directories are runs, and every scalar,
depth profile and text a run's files hold, merged by step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import tags
from ..metrics.core.base import Points
from ..sinks import PROFILE_PLUGIN

EVENT_GLOB = "events.out.tfevents.*"
# the prefix every normprobe tag starts with
PREFIX = tags.PREFIX + "/"


def find_runs(path: str | Path) -> list[Path]:
    """Every directory at or under ``path`` that holds event files itself, sorted.

    Example::

        for run in find_runs("lightning_logs"):   # lightning_logs/version_0, version_1, ...
            print(report(run))
    """
    root = Path(path)
    if root.is_file():
        return [root] if is_event_file(root) else []
    if not root.is_dir():
        return []
    dirs = {p.parent for p in root.rglob(EVENT_GLOB) if p.is_file()}
    return sorted(dirs)


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


@dataclass
class Events:
    files: int
    scalars: dict[str, Points]
    histograms: dict[str, list[tuple[int, list[float]]]]
    texts: dict[str, list[tuple[int, str]]]
    repeated: list[int]  # logged steps that more than one event file holds


def is_event_file(p: Path) -> bool:
    return p.name.startswith("events.out.tfevents.")


def read_events(run: Path) -> Events:
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
        repeated |= _read_scalars(acc, scalars)
        _read_tensors(acc, histograms, texts)
    return Events(
        len(files),
        {t: sorted(v.items()) for t, v in scalars.items()},
        {t: sorted(v.items()) for t, v in histograms.items()},
        {t: sorted(v.items()) for t, v in texts.items()},
        sorted(repeated),
    )


def _read_scalars(acc: Any, scalars: dict[str, dict[int, float]]) -> set[int]:
    """One event file's scalars into ``scalars``; the logged steps it repeats."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    repeated = set()
    for t in acc.Tags()[ea.SCALARS]:
        values = scalars.setdefault(t, {})
        for e in acc.Scalars(t):
            if t.startswith(PREFIX) and e.step in values:
                repeated.add(e.step)
            values[e.step] = float(e.value)
    return repeated


def _read_tensors(
    acc: Any, histograms: dict[str, dict[int, list[float]]], texts: dict[str, dict[int, str]]
) -> None:
    """One event file's depth profiles (and the histograms of runs written before 0.1) into
    ``histograms``, its texts into ``texts``."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    tags_here = acc.Tags()
    for t in tags_here[ea.HISTOGRAMS]:  # the depth view of runs written before 0.1
        if t.startswith(PREFIX):
            for e in acc.Histograms(t):
                buckets = [float(b) for b in e.histogram_value.bucket]
                histograms.setdefault(t, {})[e.step] = buckets
    for t in tags_here[ea.TENSORS]:
        if acc.SummaryMetadata(t).plugin_data.plugin_name == PROFILE_PLUGIN:
            for e in acc.Tensors(t):
                histograms.setdefault(t, {})[e.step] = list(e.tensor_proto.float_val)
        elif t.startswith(PREFIX) and t.endswith("/text_summary"):
            for e in acc.Tensors(t):
                text = b"".join(e.tensor_proto.string_val).decode("utf-8", "replace")
                texts.setdefault(t.removesuffix("/text_summary"), {})[e.step] = text


def _written_at(path: Path) -> tuple[float, str]:
    """When an event file was started: the time in its name (``events.out.tfevents.<time>.``),
    else its modification time."""
    parts = path.name.split(".")
    stamp = parts[3] if len(parts) > 3 and parts[3].isdigit() else None
    return (float(stamp) if stamp else path.stat().st_mtime, path.name)
