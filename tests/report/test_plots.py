"""`normprobe.plots`: the depth heatmap's image (the cell of a block at a step in its colour,
NaN blank, odd input), the panels' axes (integer block ticks, log scales where values span
decades), and matplotlib as an optional dependency."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from normprobe import plots


def cell_pixel(
    image: np.ndarray, x: float, b: int, xs: tuple[float, float], blocks: int, panel: int = 0
) -> np.ndarray:
    """The colour at step ``x`` (the x axis spans ``xs``), the centre of block ``b``'s row, in
    ``panel`` (0: the top one) of a heatmap of as many panels as the image is tall for."""
    height, width = image.shape[:2]
    panels = next(n for n in (1, 2) if plots.heatmap_size(n)[1] == height)
    left, bottom, w, h = plots.heatmap_axes(panels)[panel][0]
    u = (left + w * (x - xs[0]) / (xs[1] - xs[0])) * width
    v = (1 - bottom - h * (b + 0.5) / blocks) * height
    return image[round(v), round(u)].astype(int)


def bar_arrow(image: np.ndarray, panel: int = 0) -> bool:
    """Whether ``panel``'s colour bar ends at the top in an arrow (a triangle: coloured at the
    middle of the bar's top, blank at its corner) rather than square."""
    height, width = image.shape[:2]
    panels = next(n for n in (1, 2) if plots.heatmap_size(n)[1] == height)
    left, bottom, w, h = plots.heatmap_axes(panels)[panel][1]
    v = round((1 - bottom - h * 0.99) * height)
    middle, corner = (image[v, round((left + w * f) * width)] for f in (0.5, 0.1))
    return bool((middle < 250).any() and (corner == 255).all())


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.abs(a - b).sum() < 30)


def test_one_spike_does_not_flatten_the_rest() -> None:
    # blocks 1..2 at every step, block 5 at 1000 at step 110 only (1 of 96 values); the scale
    # spans the 2nd to 98th percentile, the spike is clipped at the top colour, with an arrow
    steps, blocks = list(range(0, 120, 10)), 8
    values = [[1.0 + b / 7 for b in range(blocks)] for _ in steps]
    values[-1][5] = 1000.0
    values[0][2] = math.nan  # not measured
    xs = (-5.0, 115.0)
    for log in (True, False):
        image = plots.depth_heatmap("resid_rms, stack blocks", steps, values, log=log, label="r")
        assert image.dtype == np.uint8 and image.shape == (*plots.heatmap_size(1)[::-1], 3)
        low, high = cell_pixel(image, 10, 0, xs, blocks), cell_pixel(image, 10, 7, xs, blocks)
        assert np.abs(low - high).sum() > 300  # 1 and 2 far apart on the colour map
        assert close(cell_pixel(image, 20, 7, xs, blocks), high)  # steps alike look alike
        spike = cell_pixel(image, 110, 5, xs, blocks)
        assert close(spike, high) and bar_arrow(image)  # the top colour, an arrow
        assert (cell_pixel(image, 0, 2, xs, blocks) == 255).all()  # NaN is blank
    smooth = plots.depth_heatmap("no spike", steps, [*values[:-1], values[0]], log=True)
    assert not bar_arrow(smooth)  # nothing clipped: no arrow


def test_steps_sit_at_their_true_position_and_extra_steps_are_marked() -> None:
    # logged every 10 steps, and at 31, 32, 33 after a spike at 30
    steps = [0, 10, 20, 30, 31, 32, 33, 40, 50]
    assert plots.off_cadence(steps) == [31, 32, 33]
    # a trainer that logs step 0, then 14, 29, ... (every 15 from its 15th step)
    assert plots.off_cadence([0, 14, 29, 44, 50, 51, 59, 74]) == [50, 51]
    assert plots.off_cadence([0, 5, 3]) == [] and plots.off_cadence([7]) == []
    values = [[1.0, 1.0] for _ in steps]
    values[steps.index(40)] = [50.0, 50.0]
    image = plots.depth_heatmap(
        "x", steps, values, log=True, marks=[31, 32, 33], marks_label="after a spike"
    )
    xs = (-5.0, 55.0)  # half a gap either side of the first and last step
    bright = cell_pixel(image, 40, 0, xs, 2)
    assert close(cell_pixel(image, 42, 1, xs, 2), bright)  # step 40's column is at 40
    assert not close(cell_pixel(image, 24, 1, xs, 2), bright)
    assert not close(cell_pixel(image, 47, 1, xs, 2), bright)
    # red ticks under the axis at 31..33 (and none under 10)
    height, width = image.shape[:2]
    left, bottom, w, _ = plots.heatmap_axes(1)[0][0]
    row = round((1 - bottom) * height) + 1

    def red(x: float) -> bool:
        col = round((left + w * (x + 5) / 60) * width)
        near = image[row : row + 4, col - 2 : col + 3].reshape(-1, 3).astype(int)
        return any(r > 200 and g < 100 and b < 100 for r, g, b in near)

    assert red(32) and not red(10)


def test_the_shape_panel_shows_where_in_depth_whatever_the_scale() -> None:
    # Post-LN's gradient: the top block 10x the others at every step, while the overall scale
    # falls 1000x over training. Each column / its mean: top 10 / (15 / 6) = 4, others 0.4
    steps, blocks = list(range(0, 100, 10)), 6
    values = [
        [10.0 ** (-k / 3) * (10.0 if b == 5 else 1.0) for b in range(blocks)] for k in range(10)
    ]
    image = plots.depth_heatmap("x", steps, values, log=True, shape=True)
    assert image.shape == (*plots.heatmap_size(2)[::-1], 3)
    xs = (-5.0, 95.0)
    first, last = cell_pixel(image, 0, 5, xs, blocks, 0), cell_pixel(image, 90, 5, xs, blocks, 0)
    assert not close(first, last)  # the value's own scale changes
    top = [cell_pixel(image, x, 5, xs, blocks, 1) for x in (0, 50, 90)]
    rest = [cell_pixel(image, x, 1, xs, blocks, 1) for x in (0, 50, 90)]
    assert all(close(t, top[0]) for t in top) and all(close(r, rest[0]) for r in rest)
    red, blue = top[0], rest[0]
    assert red[0] > red[2] + 50 and blue[2] > blue[0] + 50  # above the mean red, below blue


@pytest.mark.slow
def test_heatmap_odd_input() -> None:
    nan = math.nan
    one = (*plots.heatmap_size(1)[::-1], 3)
    blank = plots.depth_heatmap("all NaN", [0, 1, 2], [[nan] * 4] * 3, log=True)
    assert blank.shape == one and blank.dtype == np.uint8
    assert (cell_pixel(blank, 1, 1, (-0.5, 2.5), 4) == 255).all()
    zeros = plots.depth_heatmap("zeros", [0, 1], [[0.0, 0.0, -1.0], [0.0, 2.0, 3.0]], log=True)
    assert (cell_pixel(zeros, 0, 0, (-0.5, 1.5), 3) == 255).all()  # non-positive: masked on log
    assert not (cell_pixel(zeros, 1, 2, (-0.5, 1.5), 3) == 255).all()
    odd = (([], []), ([5], [[1.0]]), ([0, 3, 4, 100], [[1.0], [2.0, 3.0]]), ([4, 2], [[1.0]] * 2))
    for steps, values in odd:
        for log in (True, False):
            for shape in (False, True):
                image = plots.depth_heatmap("odd", steps, values, log=log, shape=shape)
                assert image.shape[:2] == plots.heatmap_size(2 if shape else 1)[::-1]
    flat = plots.depth_heatmap("cosines", [0, 1], [[0.5, 0.5], [0.5, 0.5]], log=False)
    assert flat.std() > 0


def test_heatmap_is_fast() -> None:
    rng = np.random.default_rng(0)
    values = rng.lognormal(0, 1, (200, 64)).tolist()
    steps = list(range(0, 2000, 10))
    plots.depth_heatmap("warm-up", steps, values, log=True)
    took = []
    for log in (True, False):
        start = time.perf_counter()
        plots.depth_heatmap("resid_rms", steps, values, log=log)
        took.append(time.perf_counter() - start)
    assert min(took) < 0.5, took  # about 0.08 s on two shared cores; 0.2 s is the budget


def test_png_holds_the_image_pixel_for_pixel() -> None:
    from PIL import Image

    image = plots.depth_heatmap("x", [0, 1, 2], [[1.0, 2.0], [2.0, 4.0], [3.0, 9.0]], log=True)
    decoded = np.asarray(Image.open(io.BytesIO(plots.png(image))))
    assert decoded.shape == image.shape and (decoded == image).all()


def test_panels_integer_block_ticks_and_log_scale_over_decades() -> None:
    blocks = [float(b) for b in range(7)]
    grows = plots.Line("step 8", [(b, 10.0**b) for b in blocks], plots.ramp(1, 2))
    flat = plots.Line("step 8", [(b, 1.0 + 0.1 * b) for b in blocks], plots.ramp(1, 2))
    cosine = plots.Line("step 8", [(0.0, math.nan)] + [(b, 0.9) for b in blocks[1:]], (0, 0, 0))
    panels = [
        plots.Panel("grad_norm", [grows], xlabel="block"),
        plots.Panel("resid_rms", [flat], xlabel="block"),
        plots.Panel("resid_cos", [cosine], xlabel="block"),
    ]
    fig = plots.figure(panels, 2, (480, 300))
    assert tuple(fig.get_size_inches() * fig.dpi) == plots.grid_size(3, 2, (480, 300))
    axes = fig.get_axes()
    assert len(axes) == 3
    assert [ax.get_yscale() for ax in axes] == ["log", "linear", "linear"]
    for ax in axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(t == int(t) for t in ticks) and 0 in ticks and 6 in ticks
        assert ax.get_legend().get_texts()[0].get_text() == "step 8"
    assert axes[0].get_title() == "grad_norm" and axes[0].get_xlabel() == "block"


@pytest.mark.slow
@pytest.mark.subprocess
def test_matplotlib_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys, normprobe, normprobe.plots, normprobe.report, normprobe.mup;"
        "assert 'matplotlib' not in sys.modules, 'imported at module import'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install normprobe\[plot\]"):
        plots.depth_heatmap("x", [0], [[1.0]], log=False)
    with pytest.raises(ImportError, match=r"pip install normprobe\[plot\]"):
        plots.figure([plots.Panel("x", [])], 1, (300, 200))
