"""The depth-profile picture of a run: one panel per (metric, stack), a line per chosen step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from .. import plots, tags
from ..common import spread
from ..metrics import SERIES
from .events import PREFIX

if TYPE_CHECKING:
    from .summary import RunReport

PANEL_SIZE = (480, 300)
PANEL_COLUMNS = 2
MAX_PROFILE_LINES = 6
Profiles = dict[str, list[tuple[int, list[float]]]]  # "<family>/<stack>" -> (step, per block)


def profiles(histograms: Profiles) -> Profiles:
    """The per-block series' depth profiles from the run's depth histograms."""
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


def draw_profiles(rep: RunReport, path: Path) -> Path:
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
