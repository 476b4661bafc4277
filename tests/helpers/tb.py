"""Read TensorBoard event files back the way TensorBoard itself does, and a TensorBoard
server's JSON."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2


@dataclass
class Events:
    scalars: dict[str, list[tuple[int, float]]]
    histograms: dict[str, list[tuple[int, list[float]]]]
    texts: dict[str, list[int]]
    layouts: list[layout_pb2.Layout]
    profiles: dict[str, list[tuple[int, list[float]]]]  # normprobe's depth profiles
    images: dict[str, list[int]]  # tag -> the steps an image was written at


def read_events(log_dir: str) -> Events:
    acc = event_accumulator.EventAccumulator(
        log_dir,
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.TENSORS: 0,
            event_accumulator.IMAGES: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    histograms = {
        t: [(e.step, list(e.histogram_value.bucket)) for e in acc.Histograms(t)]
        for t in tags["histograms"]
    }
    texts = {t: [e.step for e in acc.Tensors(t)] for t in tags["tensors"] if "text" in t}
    # a layout is a tensor summary under this tag; count how many were written
    raw = [e for t in tags["tensors"] if t == "custom_scalars__config__" for e in acc.Tensors(t)]
    layouts = [layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in raw]
    profiles = {
        t: [(e.step, list(e.tensor_proto.float_val)) for e in acc.Tensors(t)]
        for t in acc.summary_metadata
        if acc.summary_metadata[t].plugin_data.plugin_name == "normprobe_profile"
    }
    images = {t: [e.step for e in acc.Images(t)] for t in tags["images"]}
    return Events(scalars, histograms, texts, layouts, profiles, images)


def read_texts(log_dir: str) -> dict[str, list[tuple[int, str]]]:
    """Text summaries as (step, text), the way TensorBoard's text plugin stores them."""
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return {
        t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
        for t in acc.Tags()["tensors"]
        if t.endswith("/text_summary")
    }


def get_json(url: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
