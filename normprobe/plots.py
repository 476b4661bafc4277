"""Line charts as PNG (Pillow): a grid of panels, each a set of lines in a box with ticks.

Callers build `Panel` values in plot coordinates (already on a log scale where the axis is one)
and `save` them with a `Layout`; `report` draws its depth profiles this way, `muparam` its
coordinate check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from PIL import ImageDraw, ImageFont

    _Font: TypeAlias = ImageFont.ImageFont | ImageFont.FreeTypeFont

RGB = tuple[int, int, int]

BACKGROUND: RGB = (255, 255, 255)
INK: RGB = (0, 0, 0)
AXIS: RGB = (90, 90, 90)
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
TITLE_HEIGHT = 20
LEGEND_ROW = 16
# a legend below the panels: this many entries a row, each this wide
LEGEND_COLUMNS, LEGEND_WIDTH = 3, 260


def ramp(i: int, n: int) -> RGB:
    """The colour of line ``i`` of ``n`` ordered ones: light blue (first) to dark blue (last)."""
    t = 1.0 if n <= 1 else i / (n - 1)
    light, dark = (158, 202, 225), (8, 48, 107)
    r, g, b = (round(a + (z - a) * t) for a, z in zip(light, dark, strict=True))
    return r, g, b


@dataclass(frozen=True)
class Line:
    """A labelled line through ``points`` (x, y); non-finite points are left out."""

    label: str
    points: list[tuple[float, float]]
    color: RGB


@dataclass(frozen=True)
class Panel:
    """One chart: its lines drawn over the ranges ``x`` and ``y``, ticks as (value, label)."""

    title: str
    lines: list[Line]
    x: tuple[float, float]
    y: tuple[float, float]
    xticks: list[tuple[float, str]]
    yticks: list[tuple[float, str]]
    xlabel: str = ""


@dataclass(frozen=True)
class Layout:
    """Panels in a grid ``columns`` wide, each in a ``cell`` (width, height) with its box inset
    by ``box`` (left, top, right, bottom), all inside a ``margin`` (x, y) on every side."""

    cell: tuple[int, int]
    columns: int
    box: tuple[int, int, int, int]
    margin: tuple[int, int] = (0, 0)

    def size(self, panels: int, title: bool = False, legend_rows: int = 0) -> tuple[int, int]:
        """The picture's size in pixels, with a title strip and legend rows below if asked."""
        cols, rows = min(self.columns, panels), -(-panels // self.columns)
        (w, h), (mx, my) = self.cell, self.margin
        head = TITLE_HEIGHT if title else 0
        return 2 * mx + cols * w, 2 * my + head + rows * h + LEGEND_ROW * legend_rows


def save(
    path: Path, panels: Sequence[Panel], layout: Layout, title: str = "", legend_below: bool = False
) -> Path:
    """Draw ``panels`` and write them to ``path`` as PNG.

    Each panel's legend sits right of its box, or (``legend_below``) one legend of every line
    label sits below the grid. ``title``, if given, heads the picture.
    """
    from PIL import Image, ImageDraw, ImageFont

    entries = {ln.label: ln.color for p in panels for ln in p.lines}
    legend_rows = -(-len(entries) // LEGEND_COLUMNS) if legend_below else 0
    image = Image.new("RGB", layout.size(len(panels), bool(title), legend_rows), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    (w, h), (mx, my), (bl, bt, br, bb) = layout.cell, layout.margin, layout.box
    top = my + (TITLE_HEIGHT if title else 0)
    draw.text((mx + bl, my + 4), title, fill=INK, font=font)
    for i, panel in enumerate(panels):
        x0, y0 = mx + (i % layout.columns) * w, top + (i // layout.columns) * h
        box = (x0 + bl, y0 + bt, x0 + w - br, y0 + h - bb)
        _panel(draw, font, box, panel)
        if not legend_below:
            own = {ln.label: ln.color for ln in panel.lines}
            _legend(draw, font, (box[2] + 8, box[1] + 4), own, br + bl - 8)
    if legend_below:
        below = (mx + bl, image.height - my - LEGEND_ROW * legend_rows)
        _legend(draw, font, below, entries, LEGEND_WIDTH, LEGEND_COLUMNS)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


def _panel(
    draw: ImageDraw.ImageDraw,
    font: _Font,
    box: tuple[int, int, int, int],
    panel: Panel,
) -> None:
    left, top, right, bottom = box
    (x_lo, x_hi), (y_lo, y_hi) = panel.x, panel.y

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (right - left) * (x - x_lo) / (x_hi - x_lo),
            bottom - (bottom - top) * (y - y_lo) / (y_hi - y_lo),
        )

    draw.text((left, top - 18), panel.title, fill=INK, font=font)
    draw.rectangle(box, outline=AXIS)
    for x, label in panel.xticks:
        px, _ = at(x, y_lo)
        draw.line((px, bottom, px, bottom + 4), fill=AXIS)
        draw.text((px - draw.textlength(label, font=font) / 2, bottom + 6), label, AXIS, font)
    for y, label in panel.yticks:
        _, py = at(x_lo, y)
        draw.line((left - 4, py, left, py), fill=AXIS)
        draw.text((left - 6 - draw.textlength(label, font=font), py - 6), label, AXIS, font)
    mid = (left + right - draw.textlength(panel.xlabel, font=font)) / 2
    draw.text((mid, bottom + 18), panel.xlabel, fill=AXIS, font=font)
    for line in panel.lines:
        points = [at(x, y) for x, y in line.points if math.isfinite(x) and math.isfinite(y)]
        if len(points) > 1:
            draw.line(points, fill=line.color, width=2)
        for px, py in points:
            draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=line.color)


def _legend(
    draw: ImageDraw.ImageDraw,
    font: _Font,
    origin: tuple[int, int],
    entries: dict[str, RGB],
    width: int,
    columns: int = 1,
) -> None:
    """A colour swatch and label per entry, ``columns`` entries ``width`` pixels wide a row;
    labels too long for that end in "..."."""
    for i, (label, color) in enumerate(entries.items()):
        x = origin[0] + (i % columns) * width
        y = origin[1] + (i // columns) * LEGEND_ROW
        text = label
        while draw.textlength(text, font=font) > width - 24:
            label = label[:-1]
            text = label + "..."
        draw.line((x, y + 6, x + 16, y + 6), fill=color, width=3)
        draw.text((x + 20, y), text, fill=INK, font=font)
