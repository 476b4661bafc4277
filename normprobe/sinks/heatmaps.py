"""The depth heatmaps a `TensorBoardSink` draws on a thread of its own: what to draw (`Picture`)
and the drawing (`render`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tensorboard.compat.proto.summary_pb2 import Summary


@dataclass(frozen=True)
class Picture:
    """One heatmap to draw: its tag, and `depth_heatmap`'s arguments (the x axis's marks are
    found by the drawing thread: `off_cadence` for the steps of a ``marks_label``)."""

    tag: str
    title: str
    steps: list[int]
    values: list[list[float]]
    log: bool
    label: str
    shape: bool = False
    marks_label: str = ""
    xlabel: str = "step"
    ylabel: str = "block"


@dataclass(frozen=True)
class Rendered:
    """What the drawing thread hands back: (tag, PNG) pairs, the CPU seconds it took and when
    it finished (`time.monotonic`)."""

    images: list[tuple[str, Summary.Image]]
    cpu_seconds: float
    finished: float


def render(pictures: list[Picture]) -> Rendered:
    """Draw ``pictures`` as PNG-encoded TensorBoard images, timing the thread's CPU."""
    from ..plots import depth_heatmap, off_cadence, png

    start = time.thread_time()
    images = []
    for p in pictures:
        rgb = depth_heatmap(
            p.title,
            p.steps,
            p.values,
            log=p.log,
            xlabel=p.xlabel,
            ylabel=p.ylabel,
            label=p.label,
            shape=p.shape,
            marks=off_cadence(p.steps) if p.marks_label else (),
            marks_label=p.marks_label,
        )
        height, width = rgb.shape[:2]
        image = Summary.Image(
            height=height, width=width, colorspace=3, encoded_image_string=png(rgb)
        )
        images.append((p.tag, image))
    return Rendered(images, time.thread_time() - start, time.monotonic())
