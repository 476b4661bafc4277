"""`normprobe.plots`: the depth heatmap's image (the cell of a block at a step in its colour,
NaN blank, odd input), the panels' axes (integer block ticks, log scales where values span
decades), and matplotlib as an optional dependency."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import pytest

from normprobe import plots


def cell_pixel(image: np.ndarray, i: int, b: int, steps: int, blocks: int) -> np.ndarray:
    """The colour at the centre of the cell of step index ``i``, block ``b``."""
    height, width = image.shape[:2]
    left, bottom, w, h = plots.HEATMAP_AXES
    x = (left + w * (i + 0.5) / steps) * width
    y = (1 - bottom - h * (b + 0.5) / blocks) * height
    return image[round(y), round(x)].astype(int)


def column(image: np.ndarray, i: int, steps: int) -> np.ndarray:
    """The pixels of the chart's column of step index ``i`` (its edges left out)."""
    width = image.shape[1]
    left, _, w, _ = plots.HEATMAP_AXES
    x0, x1 = ((left + w * k / steps) * width for k in (i, i + 1))
    return image[:, round(x0) + 2 : round(x1) - 2].astype(int)


def test_heatmap_shows_the_block_that_grew() -> None:
    steps, blocks = list(range(0, 60, 10)), 8
    values = [[1.0 + 0.01 * b for b in range(blocks)] for _ in steps]
    values[-1][5] = 100.0  # block 5, at the last step only
    values[0][2] = math.nan  # not measured
    for log in (True, False):
        image = plots.depth_heatmap("resid_rms, stack blocks", steps, values, log=log)
        assert image.dtype == np.uint8 and image.shape == (360, 640, 3)
        grown = cell_pixel(image, 5, 5, len(steps), blocks)
        others = [(i, b) for i in range(len(steps)) for b in range(blocks)]
        for i, b in others:
            if (i, b) not in {(5, 5), (0, 2)}:
                assert np.abs(grown - cell_pixel(image, i, b, len(steps), blocks)).sum() > 150
        # the last step's other blocks look like the earlier steps
        assert np.abs(cell_pixel(image, 5, 4, 6, 8) - cell_pixel(image, 1, 4, 6, 8)).sum() < 30
        assert (cell_pixel(image, 0, 2, 6, 8) == 255).all()  # NaN is blank
        # the grown block's colour is in the last step's column and in no other one
        found = [(np.abs(column(image, i, 6) - grown).sum(axis=2) < 30).sum() for i in range(6)]
        assert found[5] > 100 and found[:5] == [0] * 5, found


def test_heatmap_odd_input() -> None:
    nan = math.nan
    blank = plots.depth_heatmap("all NaN", [0, 1, 2], [[nan] * 4] * 3, log=True)
    assert blank.shape == (360, 640, 3) and blank.dtype == np.uint8
    assert (cell_pixel(blank, 1, 1, 3, 4) == 255).all()
    zeros = plots.depth_heatmap("zeros", [0, 1], [[0.0, 0.0, -1.0], [0.0, 2.0, 3.0]], log=True)
    assert (cell_pixel(zeros, 0, 0, 2, 3) == 255).all()  # non-positive: masked on a log scale
    assert not (cell_pixel(zeros, 1, 2, 2, 3) == 255).all()
    for steps, values in (([], []), ([5], [[1.0]]), ([0, 3, 4, 100], [[1.0], [2.0, 3.0]])):
        for log in (True, False):
            image = plots.depth_heatmap("odd", steps, values, log=log)
            assert image.shape == (360, 640, 3)
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


def test_matplotlib_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys, normprobe, normprobe.plots, normprobe.report, normprobe.muparam;"
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
