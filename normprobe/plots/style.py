"""What every picture shares: colours, sizes, when an axis is logarithmic, and matplotlib, imported
only when a picture is drawn (its Agg canvas alone, never pyplot)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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


def rgb(color: RGB) -> tuple[float, float, float]:
    r, g, b = color
    return r / 255, g / 255, b / 255


def matplotlib_classes() -> tuple[type[Figure], type[FigureCanvasAgg]]:
    """matplotlib's `Figure` and its Agg canvas, or an ImportError that says how to get them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"normprobe draws its pictures with matplotlib, which is not installed: {INSTALL}"
        ) from e
    return Figure, FigureCanvasAgg
