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

from .charts import Line, Panel, figure, grid_size, legend_rows, save
from .heatmaps import (
    HEATMAP_WIDTH,
    Heat,
    depth_heatmap,
    heatmap_axes,
    heatmap_size,
    off_cadence,
    png,
)
from .style import LEGEND_ROW, PALETTE, RGB, TITLE_HEIGHT, ramp, spans_decades

__all__ = [
    "HEATMAP_WIDTH",
    "LEGEND_ROW",
    "PALETTE",
    "RGB",
    "TITLE_HEIGHT",
    "Heat",
    "Line",
    "Panel",
    "depth_heatmap",
    "figure",
    "grid_size",
    "heatmap_axes",
    "heatmap_size",
    "legend_rows",
    "off_cadence",
    "png",
    "ramp",
    "save",
    "spans_decades",
]
