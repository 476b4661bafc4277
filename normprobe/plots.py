"""Pictures drawn with matplotlib (the optional ``normprobe[plot]`` extra).

`save` writes a grid of line-chart panels as PNG: `report` draws its depth profiles this way,
`muparam` its coordinate check. `depth_heatmap` renders one metric over blocks and steps as an
RGB array (block x step, a colour bar).

matplotlib is imported only inside the functions that draw, and only its Agg canvas is used
(a `Figure` of its own, never pyplot): importing this module costs nothing and leaves the
user's matplotlib backend alone. Without matplotlib they raise an ImportError that says
``pip install normprobe[plot]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from .common import spread

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

RGB = tuple[int, int, int]

# categorical colours (matplotlib's tab10), for lines that are not ordered
PALETTE: tuple[RGB, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
DPI = 100
# a picture's title strip and each row of a legend below the panels, in pixels
TITLE_HEIGHT, LEGEND_ROW = 30, 22
# each entry of a legend below the panels gets this many pixels of the picture's width
LEGEND_WIDTH = 200
LEGEND_LABEL = 30  # characters; longer labels end in "..."
# lines of at most this many points get a marker at each
MARKERS_UP_TO = 24
# a positive metric is drawn on a log scale when its largest value is more than this many
# decades above its smallest
LOG_DECADES = 1.5
HEATMAP_SIZE = (640, 360)
# where a heatmap's chart and its colour bar sit: (left, bottom, width, height), figure fractions
HEATMAP_AXES = (0.09, 0.15, 0.74, 0.74)
HEATMAP_BAR = (0.85, 0.15, 0.025, 0.74)
INSTALL = "pip install normprobe[plot]"


def ramp(i: int, n: int) -> RGB:
    """The colour of line ``i`` of ``n`` ordered ones: light blue (first) to dark blue (last)."""
    t = 1.0 if n <= 1 else i / (n - 1)
    light, dark = (158, 202, 225), (8, 48, 107)
    r, g, b = (round(a + (z - a) * t) for a, z in zip(light, dark, strict=True))
    return r, g, b


def spans_decades(values: Sequence[float], decades: float = LOG_DECADES) -> bool:
    """Whether the finite ``values`` are all positive and their largest is more than
    ``decades`` decades above their smallest (then a log scale reads them best)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or min(finite) <= 0:
        return False
    return math.log10(max(finite) / min(finite)) > decades


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
    figure_cls, canvas_cls = _matplotlib()
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
            xs, ys, color=_rgb(line.color), marker=marker, markersize=4, lw=1.6, label=line.label
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
    return Line2D([], [], color=_rgb(color), marker="o", markersize=4, lw=1.6, label=short)


def _rgb(color: RGB) -> tuple[float, float, float]:
    r, g, b = color
    return r / 255, g / 255, b / 255


def depth_heatmap(
    title: str,
    steps: Sequence[int],
    values: Sequence[Sequence[float]],
    log: bool,
    xlabel: str = "step",
    ylabel: str = "block",
) -> np.ndarray:
    """Render one metric over blocks and steps as an image: block (y, block 0 at the bottom)
    against logged step (x), one column per step, with a colour bar and a title. With other
    axis labels it draws any such grid (heads against blocks: ``steps`` are then blocks).

    Args:
        title: heads the image.
        steps: the logged steps, one column each; the x ticks (at most 8) are labelled with them.
        values: ``values[i][b]``: the value at step ``steps[i]`` of block ``b``; NaN (or a
            missing block) is not measured and stays blank.
        log: a log colour scale (norms, ratios), where values that are not positive stay blank
            too; else a linear one (cosines).

    Returns:
        An RGB image, ``uint8`` of shape ``(H, W, 3)``, `HEATMAP_SIZE` (W, H) big.

    Raises:
        ImportError: matplotlib is not installed (``pip install normprobe[plot]``).
    """
    figure_cls, canvas_cls = _matplotlib()
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import MaxNLocator

    n_steps = len(steps)
    depth = max((len(row) for row in values[:n_steps]), default=0)
    grid = np.full((max(depth, 1), max(n_steps, 1)), np.nan)
    for i, row in enumerate(values[:n_steps]):
        grid[: len(row), i] = np.asarray(row, dtype=float)
    bad = ~np.isfinite(grid)
    if log:
        with np.errstate(invalid="ignore"):
            bad |= grid <= 0
    data = np.ma.masked_array(grid, mask=bad)
    shown = grid[~bad]
    lo, hi = (float(shown.min()), float(shown.max())) if shown.size else (1.0, 10.0)
    norm: Normalize
    if log:
        if hi <= lo * (1 + 1e-9):
            lo, hi = lo / 2, hi * 2
        norm = LogNorm(lo, hi)
    else:
        if not shown.size:
            lo, hi = 0.0, 1.0
        elif hi - lo <= 1e-12 * max(1.0, abs(hi)):
            lo, hi = lo - 0.5 * max(abs(lo), 1e-3), hi + 0.5 * max(abs(hi), 1e-3)
        norm = Normalize(lo, hi)
    cmap = colormaps["viridis"].with_extremes(bad="white")

    width, height = HEATMAP_SIZE
    fig = figure_cls(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white")
    canvas = canvas_cls(fig)
    ax = fig.add_axes(HEATMAP_AXES)
    cax = fig.add_axes(HEATMAP_BAR)
    gaps = np.diff(np.asarray(steps, dtype=float))
    even = n_steps > 0 and (gaps.size == 0 or (gaps[0] > 0 and bool((gaps == gaps[0]).all())))
    if even:  # evenly logged: columns at their steps, round step numbers as ticks
        gap = float(gaps[0]) if gaps.size else 1.0
        x0, x1 = steps[0] - gap / 2, steps[-1] + gap / 2
    else:  # a column per logged step, ticks at some of them
        x0, x1 = -0.5, max(n_steps, 1) - 0.5
    image = ax.imshow(
        data,
        cmap=cmap,
        norm=norm,
        origin="lower",
        aspect="auto",
        interpolation="nearest",
        extent=(x0, x1, -0.5, grid.shape[0] - 0.5),
    )
    fig.colorbar(image, cax=cax)
    if log:
        _plain_log_labels(cax.yaxis)
    cax.tick_params(which="both", labelsize="small")
    if even:  # round multiples of the logging interval
        picked = MaxNLocator(nbins=7, integer=True).tick_values(0, n_steps - 1)
        ticks = [round(k) for k in picked if 0 <= k <= n_steps - 1]
    else:
        ticks = spread(n_steps, 8)
    ax.set_xticks([steps[k] if even else k for k in ticks], [str(steps[k]) for k in ticks])
    ax.yaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    ax.tick_params(labelsize="small")
    ax.set_xlabel(xlabel, fontsize="small")
    ax.set_ylabel(ylabel, fontsize="small")
    ax.set_title(title, fontsize="medium")
    if not shown.size:
        ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
    canvas.draw()  # type: ignore[no-untyped-call]
    rgb = np.asarray(canvas.buffer_rgba())[..., :3].copy()  # type: ignore[no-untyped-call]
    fig.clear()
    return rgb


def _matplotlib() -> tuple[type[Figure], type[FigureCanvasAgg]]:
    """matplotlib's `Figure` and its Agg canvas, or an ImportError that says how to get them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"normprobe draws its pictures with matplotlib, which is not installed: {INSTALL}"
        ) from e
    return Figure, FigureCanvasAgg
