"""A TensorBoard link that opens on the runs' health summary.

TensorBoard's Time Series tab orders its cards by tag name, and event files cannot change that;
its URL can pin cards, which it then shows first. `dashboard_url` pins the summary: the loss,
each stack's gradient ratio and residual growth, each stack's attention module with the largest
logit, and the count of modules with NaN/Inf outputs.

Example::

    print(normprobe.dashboard_url("runs"))   # open it once `tensorboard --logdir runs` runs
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from . import tags
from .metrics.core.run import run_tags
from .report import find_runs
from .sinks import LOSS_REGEX, SUMMARY

Points = list[tuple[int, float]]


def summary_tags(scalars: Mapping[str, Points]) -> list[str]:
    """The tags of the health summary among a run's scalars (tag -> points), in the order the
    Custom Scalars summary shows them, with the loss first. Of per-module series (attention
    logits), the module with the largest value of each stack."""
    loss = sorted(t for t in scalars if re.fullmatch(LOSS_REGEX, t))
    order = {series: i for i, (_, series) in enumerate(SUMMARY)}
    chosen: dict[tuple[str, str], tuple[float, str]] = {}
    for t in run_tags(list(scalars)):
        if t.parsed.series not in order:
            continue
        largest = max((v for _, v in scalars[t.tag] if math.isfinite(v)), default=-math.inf)
        key = (t.parsed.series, t.stack)
        if key not in chosen or largest > chosen[key][0]:
            chosen[key] = (largest, t.tag)
    ranked = sorted(chosen.items(), key=lambda item: (order[item[0][0]], item[0][1]))
    return loss + [tag for _, (_, tag) in ranked]


def dashboard_url(
    log_dir: str | Path, host: str = "localhost", port: int = 6006, scheme: str = "http"
) -> str:
    """The address of TensorBoard's Time Series tab for ``log_dir`` (as given to ``tensorboard
    --logdir``) with the summary cards of every run under it pinned first.

    Raises:
        FileNotFoundError: no event files under ``log_dir``.
    """
    runs = find_runs(log_dir)
    if not runs:
        raise FileNotFoundError(
            f"no TensorBoard event files under {str(log_dir)!r}: pass the folder given to "
            "`tensorboard --logdir` after the probe has logged a step"
        )
    pinned = list(dict.fromkeys(t for run in runs for t in summary_tags(_scalars(run))))
    cards = [{"plugin": "scalars", "tag": t} for t in pinned]
    query = quote(json.dumps(cards, separators=(",", ":")), safe="")
    return f"{scheme}://{host}:{port}/?pinnedCards={query}#timeseries"


def _scalars(run: Path) -> dict[str, Points]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(run), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    wanted = {series for _, series in SUMMARY}
    return {
        t: [(e.step, e.value) for e in acc.Scalars(t)]
        for t in acc.Tags()["scalars"]
        if re.fullmatch(LOSS_REGEX, t) or _series(t) in wanted
    }


def _series(tag: str) -> str | None:
    parsed = tags.parse(tag)
    return parsed.series if parsed is not None else None
