"""Line charts: a grid of panels, each a few lines over one axis, with a shared legend below."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .style import (
    DPI,
    LEGEND_LABEL,
    LEGEND_ROW,
    LEGEND_WIDTH,
    MARKERS_UP_TO,
    RGB,
    TITLE_HEIGHT,
    matplotlib_classes,
    rgb,
    spans_decades,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D


@dataclass(frozen=True)
class Line:
    """A labelled line through ``points`` (x, y), with a marker at each if there are at most
    `MARKERS_UP_TO`; non-finite points are left out (and so are non-positive ones on a log
    axis)."""

    label: str
    points: list[tuple[float, float]]
    color: RGB


@dataclass(frozen=True)
class Panel:
    """One chart.

    Attributes:
        title: above the chart.
        lines: drawn in order.
        xlabel, ylabel: the axis labels.
        xticks: ``(value, label)`` ticks on the x axis; None or empty: integer ticks chosen
            by matplotlib (block indices).
        xlog: a log x axis (base 2: widths).
        ylog: a log y axis (its non-positive values left out); None: one when the values are
            positive and span more than `LOG_DECADES` decades.
    """

    title: str
    lines: list[Line]
    xlabel: str = ""
    ylabel: str = ""
    xticks: list[tuple[float, str]] | None = None
    xlog: bool = False
    ylog: bool | None = None


def grid_size(
    panels: int, columns: int, cell: tuple[int, int], title: bool = False, legend_rows: int = 0
) -> tuple[int, int]:
    """The size in pixels of a picture of ``panels`` panels ``columns`` wide, each ``cell``
    (width, height), with a title strip and legend rows below if asked."""
    cols, rows = max(1, min(columns, panels)), max(1, -(-panels // columns))
    head = TITLE_HEIGHT if title else 0
    return cols * cell[0], head + rows * cell[1] + LEGEND_ROW * legend_rows


def legend_rows(labels: int, width: int) -> int:
    """The rows of a legend of ``labels`` entries below a picture ``width`` pixels wide."""
    return -(-labels // _legend_columns(width))


def save(
    path: Path,
    panels: Sequence[Panel],
    columns: int,
    cell: tuple[int, int],
    title: str = "",
    legend: Literal["panel", "below"] = "panel",
    sharey: bool = False,
) -> Path:
    """Draw ``panels`` (`figure`) and write them to ``path`` as PNG."""
    fig = figure(panels, columns, cell, title, legend, sharey)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, facecolor="white")
    return path


def figure(
    panels: Sequence[Panel],
    columns: int,
    cell: tuple[int, int],
    title: str = "",
    legend: Literal["panel", "below"] = "panel",
    sharey: bool = False,
) -> Figure:
    """Draw ``panels`` in a grid ``columns`` wide, each in a ``cell`` of pixels, on a matplotlib
    `Figure` (with an Agg canvas) `grid_size` pixels big at `DPI`.

    ``legend``: each panel's own legend right of its chart (``"panel"``), or one legend of every
    line label below the grid (``"below"``, `legend_rows` rows of entries `LEGEND_WIDTH`
    pixels wide). ``title``, if given, heads the picture. ``sharey``: one y axis for all
    panels (a log one if any panel asks for it, or if their values together span decades).
    """
    figure_cls, canvas_cls = matplotlib_classes()
    entries = {ln.label: ln.color for p in panels for ln in p.lines}
    width = grid_size(len(panels), columns, cell)[0]
    rows_below = legend_rows(len(entries), width) if legend == "below" and entries else 0
    width, height = grid_size(len(panels), columns, cell, bool(title), rows_below)
    fig = figure_cls(
        figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained", facecolor="white"
    )
    canvas_cls(fig)
    if title:
        fig.suptitle(title, fontsize="medium")
    cols, rows = max(1, min(columns, len(panels))), max(1, -(-len(panels) // columns))
    grid = fig.add_gridspec(rows, cols)
    shared_log = any(p.ylog for p in panels) or (
        all(p.ylog is None for p in panels)
        and spans_decades([y for p in panels for ln in p.lines for _, y in ln.points])
    )
    first: Axes | None = None
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(grid[i // cols, i % cols], sharey=first if sharey else None)
        first = first or ax
        ylog = shared_log if sharey else panel.ylog
        _panel(ax, panel, _values_span(panel) if ylog is None else ylog)
        if sharey and i % cols:
            ax.tick_params(labelleft=False)
        if legend == "panel" and panel.lines:
            ax.legend(
                loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False
            )
    if rows_below:
        handles = [_handle(label, color) for label, color in entries.items()]
        fig.legend(
            handles=handles,
            loc="outside lower center",
            ncols=min(_legend_columns(width), len(handles)),
            fontsize="small",
            frameon=False,
        )
    return fig


def _legend_columns(width: int) -> int:
    return max(1, width // LEGEND_WIDTH)


def _values_span(panel: Panel) -> bool:
    return spans_decades([y for ln in panel.lines for _, y in ln.points])


def _panel(ax: Axes, panel: Panel, ylog: bool) -> None:
    from matplotlib.ticker import MaxNLocator, NullLocator

    if panel.xlog:
        ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
    drawn = 0
    for line in panel.lines:
        xs, ys = [], []
        for x, y in line.points:
            ok = math.isfinite(x) and math.isfinite(y)
            if ok and (not panel.xlog or x > 0) and (not ylog or y > 0):
                xs.append(x)
                ys.append(y)
        drawn += len(xs)
        marker = "o" if len(xs) <= MARKERS_UP_TO else ""
        ax.plot(
            xs, ys, color=rgb(line.color), marker=marker, markersize=4, lw=1.6, label=line.label
        )
    if panel.xticks:
        ax.set_xticks([x for x, _ in panel.xticks], [label for _, label in panel.xticks])
        ax.xaxis.set_minor_locator(NullLocator())
    else:  # integer ticks (block indices), a little room either side
        ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", integer=True, min_n_ticks=1))
        xs_all = [x for ln in panel.lines for x, _ in ln.points if math.isfinite(x)]
        if xs_all:
            lo, hi = min(xs_all), max(xs_all)
            pad = max(0.25, 0.03 * (hi - lo))
            ax.set_xlim(lo - pad, hi + pad)
    if not drawn:
        ax.text(0.5, 0.5, "nothing to draw", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(panel.title, fontsize="medium")
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.tick_params(which="both", labelsize="small")
    ax.grid(True, which="major", color="0.9", lw=0.6)


def _plain_log_labels(axis: Axis) -> None:
    """Label a log axis with plain numbers (0.01, 20) rather than powers of ten, its minor
    ticks too where it spans too few decades to show more than one or two powers."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _handle(label: str, color: RGB) -> Line2D:
    from matplotlib.lines import Line2D

    short = label if len(label) <= LEGEND_LABEL else label[: LEGEND_LABEL - 3] + "..."
    return Line2D([], [], color=rgb(color), marker="o", markersize=4, lw=1.6, label=short)
