"""Pictures drawn with matplotlib (the optional ``normprobe[plot]`` extra).

`save` writes a grid of line-chart panels as PNG: `report` draws its depth profiles this way,
`mup` its coordinate check. `depth_heatmap` renders one metric over blocks and steps as an
RGB array (block x step at the steps' true positions, a clipped and labelled colour bar, and
optionally the profile's shape: each step divided by its mean over blocks).

matplotlib is imported only inside the functions that draw, and only its Agg canvas is used
(a `Figure` of its own, never pyplot): importing this module costs nothing and leaves the
user's matplotlib backend alone. Without matplotlib they raise an ImportError that says
``pip install normprobe[plot]``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .common import spread

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
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
# a depth heatmap's width, its title strip, each panel's height (with the gap below it) and the
# x axis strip, in pixels: TensorBoard shows images 350 pixels wide
HEATMAP_WIDTH, HEATMAP_TOP, HEATMAP_PANEL, HEATMAP_BOTTOM = 480, 26, 210, 52
HEATMAP_GAP = 10
# the percentiles a heatmap's colour scale spans (beyond them: the end colours)
CLIP = (2.0, 98.0)
# ... where the values beyond reach further than this fraction of the range between them
CLIP_TAIL = 0.25
# a shape panel's colour scale spans at least 1/this to this times the mean
SHAPE_RANGE = 2.0
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


@dataclass(frozen=True)
class Heat:
    """How one heatmap panel colours its values.

    Attributes:
        norm: matplotlib's `Normalize` (or `LogNorm`) from value to colour.
        extend: which ends the colour scale clips (``neither``, ``min``, ``max``, ``both``):
            the colour bar ends in an arrow there.
    """

    norm: Normalize
    extend: Literal["neither", "min", "max", "both"]


def depth_heatmap(
    title: str,
    steps: Sequence[int],
    values: Sequence[Sequence[float]],
    log: bool,
    xlabel: str = "step",
    ylabel: str = "block",
    label: str = "",
    shape: bool = False,
    marks: Sequence[int] = (),
    marks_label: str = "",
) -> np.ndarray:
    """Render one metric over blocks and steps as an image: block (y, block 0 at the bottom)
    against logged step (x), each step's column at its true position (as wide as the gaps to
    its neighbours), with a labelled colour bar and a title. With other axis labels it draws
    any such grid (heads against blocks: ``steps`` are then blocks).

    The colour scale spans the `CLIP` percentiles of the values, so that one spike does not
    flatten the rest: values beyond keep the end colours and the colour bar ends in an arrow.

    Args:
        title: heads the image (the run, the metric, the stack).
        steps: the logged steps, one column each, increasing (else one column per step, in
            order).
        values: ``values[i][b]``: the value at step ``steps[i]`` of block ``b``; NaN (or a
            missing block) is not measured and stays blank.
        log: a log colour scale (norms, ratios), where values that are not positive stay blank
            too; else a linear one (cosines).
        label: the colour bar's label (the metric, its unit); the scale is added to it.
        shape: add a second panel below: each column divided by its mean over blocks, on a
            diverging log scale centred on 1 (where in depth the metric sits, whatever the
            step's scale).
        marks: steps marked with a red tick on the x axis (`off_cadence`: steps logged
            between the regular ones), described by ``marks_label`` below the axis.

    Returns:
        An RGB image, ``uint8`` of shape ``(H, W, 3)``, `heatmap_size` big.

    Raises:
        ImportError: matplotlib is not installed (``pip install normprobe[plot]``).
    """
    figure_cls, canvas_cls = _matplotlib()
    grid = _grid(steps, values)
    panels = 2 if shape else 1
    width, height = heatmap_size(panels)
    fig = figure_cls(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white")
    canvas = canvas_cls(fig)
    fig.suptitle(title, fontsize=11, y=1 - 4 / height, va="top")
    xs = _edges(steps)
    drawn = [(grid, _heat(grid, log), label, "viridis")]
    if shape:
        drawn.append((_shape(grid), _shape_heat(grid), "÷ mean over blocks", "RdBu_r"))
    for k, (data, heat, bar_label, cmap) in enumerate(drawn):
        box, bar = heatmap_axes(panels)[k]
        ax, cax = fig.add_axes(box), fig.add_axes(bar)
        _heat_panel(fig, ax, cax, data, heat, xs, bar_label, cmap)
        ax.set_ylabel(ylabel, fontsize=10)
        if k == panels - 1:
            _x_axis(fig, ax, steps, xs, xlabel, marks, marks_label)
        else:
            ax.tick_params(labelbottom=False)
    canvas.draw()  # type: ignore[no-untyped-call]
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # type: ignore[no-untyped-call]


def png(rgb: np.ndarray) -> bytes:
    """An RGB ``uint8`` image (``(H, W, 3)``) encoded as PNG, by Pillow (a matplotlib
    dependency), as TensorBoard's own image summaries are."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def heatmap_size(panels: int) -> tuple[int, int]:
    """The size in pixels (width, height) of a `depth_heatmap` of ``panels`` panels."""
    return HEATMAP_WIDTH, HEATMAP_TOP + panels * HEATMAP_PANEL + HEATMAP_BOTTOM


def heatmap_axes(
    panels: int,
) -> list[tuple[tuple[float, float, float, float], tuple[float, float, float, float]]]:
    """Where each panel of a `depth_heatmap` sits, top first: its chart's and its colour bar's
    (left, bottom, width, height), in fractions of the image."""
    width, height = heatmap_size(panels)
    left, chart, gap, bar = 48, 318, 10, 10
    boxes = []
    for k in range(panels):
        bottom = (HEATMAP_BOTTOM + (panels - 1 - k) * HEATMAP_PANEL) / height
        h = (HEATMAP_PANEL - HEATMAP_GAP) / height
        boxes.append(
            (
                (left / width, bottom, chart / width, h),
                ((left + chart + gap) / width, bottom, bar / width, h),
            )
        )
    return boxes


def off_cadence(steps: Sequence[int]) -> list[int]:
    """The steps logged between the regular ones (the extra steps a probe logs after a spike):
    off the grid of the gap that spans most of the run, at the offset of most steps that gap
    led to. The first step is never one (a trainer logs its step 0 before the grid starts)."""
    gaps = np.diff(np.asarray(steps, dtype=np.int64))
    if gaps.size < 2 or (gaps <= 0).any():
        return []
    found, counts = np.unique(gaps, return_counts=True)
    cadence = int(found[(found * counts).argmax()])
    regular = np.asarray(steps[1:])[gaps == cadence]  # the steps a cadence's gap led to
    offsets, counts = np.unique(regular % cadence, return_counts=True)
    grid = int(offsets[counts.argmax()])
    return [s for s in steps[1:] if s % cadence != grid]


def _grid(steps: Sequence[int], values: Sequence[Sequence[float]]) -> np.ndarray:
    """``values`` as a (block, step) array, NaN where a block is missing."""
    n_steps = len(steps)
    depth = max((len(row) for row in values[:n_steps]), default=0)
    grid = np.full((max(depth, 1), max(n_steps, 1)), np.nan)
    for i, row in enumerate(values[:n_steps]):
        grid[: len(row), i] = np.asarray(row, dtype=float)
    return grid


def _edges(steps: Sequence[int]) -> np.ndarray:
    """The x edges of the columns: halfway between logged steps (the first and last as wide
    as their neighbour's gap); column indices when the steps do not increase."""
    xs = np.asarray(steps, dtype=float)
    if xs.size < 2 or (np.diff(xs) <= 0).any():
        xs = np.arange(max(len(steps), 1), dtype=float)
    mid = (xs[1:] + xs[:-1]) / 2 if xs.size > 1 else np.empty(0)
    first = xs[0] - (mid[0] - xs[0] if mid.size else 0.5)
    last = xs[-1] + (xs[-1] - mid[-1] if mid.size else 0.5)
    return np.concatenate([[first], mid, [last]])


def _shown(grid: np.ndarray, log: bool) -> np.ma.MaskedArray[Any, Any]:
    """The values a panel colours: finite (and positive on a log scale)."""
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(grid) & (grid > 0 if log else True)
    return np.ma.masked_array(grid, mask=~ok)


def _heat(grid: np.ndarray, log: bool) -> Heat:
    """A colour scale over the shown values (their logs on a log scale), each end clipped at
    its `CLIP` percentile where the values beyond reach further than `CLIP_TAIL` of the range
    between the percentiles (a spike; a smooth spread keeps its ends)."""
    from matplotlib.colors import LogNorm, Normalize

    shown = _shown(grid, log).compressed()
    space = np.log10(shown) if log else shown
    if not space.size:
        space = np.array([0.0 if log else 0.5])
    lo, hi = (float(np.percentile(space, q)) for q in CLIP)
    tail = CLIP_TAIL * (hi - lo)
    under, over = float(space.min()) < lo - tail, float(space.max()) > hi + tail
    lo, hi = (lo if under else float(space.min())), (hi if over else float(space.max()))
    if hi - lo <= 1e-9 * max(1.0, abs(hi)):  # one value: a range around it
        pad = math.log10(2) if log else 0.5 * max(abs(lo), 1e-3)
        lo, hi = lo - pad, hi + pad
    norm = LogNorm(10.0**lo, 10.0**hi) if log else Normalize(lo, hi)
    ends = {(False, False): "neither", (True, False): "min", (False, True): "max"}
    return Heat(norm, ends.get((under, over), "both"))  # type: ignore[arg-type]


def _shape(grid: np.ndarray) -> np.ndarray:
    """Each column divided by its mean over blocks (its shown values)."""
    shown = _shown(grid, True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(shown.filled(np.nan) / shown.mean(axis=0).filled(np.nan))


def _shape_heat(grid: np.ndarray) -> Heat:
    """A log scale symmetric about 1, out to the `CLIP` upper percentile of the spread."""
    from matplotlib.colors import LogNorm

    ratios = _shown(_shape(grid), True).compressed()
    spread_ = np.abs(np.log2(ratios)) if ratios.size else np.zeros(1)
    top = max(float(np.percentile(spread_, CLIP[1])), math.log2(SHAPE_RANGE))
    clipped = bool(spread_.max() > top)
    return Heat(LogNorm(2.0**-top, 2.0**top), "both" if clipped else "neither")


def _heat_panel(
    fig: Figure,
    ax: Axes,
    cax: Axes,
    data: np.ndarray,
    heat: Heat,
    xs: np.ndarray,
    label: str,
    cmap_name: str,
) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    log = isinstance(heat.norm, LogNorm)
    shown = _shown(data, log)
    blank = "white" if cmap_name == "viridis" else "0.8"
    cmap = colormaps[cmap_name].with_extremes(bad=blank)
    ys = np.arange(data.shape[0] + 1) - 0.5
    mesh = ax.pcolorfast(xs, ys, shown, cmap=cmap, norm=heat.norm)
    ax.set_xlim(xs[0], xs[-1])
    bar = fig.colorbar(mesh, cax=cax, extend=heat.extend, extendfrac=0.06)
    scale = "log" if log else "linear"  # clipped: the bar's arrows say so
    bar.set_label(f"{label} ({scale})" if label else scale, fontsize=9)
    # at the image's right edge, clear of the widest tick labels (matplotlib skips minor ones)
    box = cax.get_position()
    cax.yaxis.set_label_coords((1 - 16 / HEATMAP_WIDTH - box.x0) / box.width, 0.5)
    if cmap_name != "viridis":  # the shape's powers of two: 0.25, 0.5, 1, 2, 4
        lo, hi = (math.log2(v) for v in (heat.norm.vmin, heat.norm.vmax))  # type: ignore[arg-type]
        every = 1 + int(hi - lo) // 6  # at most about 6 ticks
        powers = range(math.ceil(lo / every) * every, math.floor(hi) + 1, every)
        labels = [f"{2.0**k:g}" if k >= 0 else f"1/{2.0**-k:g}" for k in powers]
        bar.set_ticks([2.0**k for k in powers], labels=labels)
        bar.minorticks_off()
    elif log:
        _bar_log_labels(cax.yaxis, heat.norm)
    cax.tick_params(which="both", labelsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.tick_params(labelsize=9)
    if not shown.count():
        ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)


def _bar_log_labels(axis: Axis, norm: Normalize) -> None:
    """Plain numbers on a log colour bar (0.01, 20); within less than `LOG_DECADES` decades
    the minor ticks at 2, 3 and 5 times a power of ten are labelled too (0.2, 0.3, 0.5)."""
    from matplotlib.ticker import FuncFormatter

    lo, hi = (math.log10(v) for v in (norm.vmin, norm.vmax))  # type: ignore[arg-type]
    few = hi - lo < LOG_DECADES

    def minor(v: float, _: object) -> str:
        mantissa = round(v / 10 ** math.floor(math.log10(v) + 1e-9))
        return f"{v:.1g}" if few and mantissa in (2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _x_axis(
    fig: Figure,
    ax: Axes,
    steps: Sequence[int],
    xs: np.ndarray,
    xlabel: str,
    marks: Sequence[int],
    marks_label: str,
) -> None:
    """Ticks at round steps (the logged steps themselves if they do not increase), and the
    marked steps as red minor ticks."""
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import blended_transform_factory

    increasing = len(steps) > 1 and bool((np.diff(np.asarray(steps)) > 0).all())
    if increasing or len(steps) == 1:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=7, integer=True))
    else:
        picked = spread(len(steps), 8)
        ax.set_xticks([float(k) for k in picked], [str(steps[k]) for k in picked])
    shown = [m for m in marks if increasing and xs[0] <= m <= xs[-1]]
    ax.set_xlabel(xlabel, fontsize=10, loc="left" if shown else "center")
    if shown:
        ax.set_xticks(shown, minor=True)
        ax.tick_params(axis="x", which="minor", length=6, width=1, color="red")
        below = blended_transform_factory(ax.transAxes, fig.transFigure)
        ax.text(
            1.0, 8 / fig.bbox.height, f"red ticks: {marks_label}", color="red", fontsize=8,
            ha="right", va="baseline", transform=below,
        )  # fmt: skip


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
