"""Depth heatmaps: one metric over blocks and steps as an RGB array (block x step at the steps'
true positions, a clipped and labelled colour bar, and optionally the profile's shape)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..common import spread
from .style import DPI, LOG_DECADES, matplotlib_classes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

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
    figure_cls, canvas_cls = matplotlib_classes()
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
