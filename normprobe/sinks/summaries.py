"""What a `TensorBoardSink` writes besides the scalars: the custom-scalars layout and its
summary series, the depth profiles `report` reads, the heatmaps' tags, and fast checksums."""

from __future__ import annotations

import itertools
import re
import struct
import time
from collections.abc import Iterable
from typing import Any

import google_crc32c
import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from .. import tags
from ..common import spread
from ..metrics import SERIES
from .scalars import LOG2, STACK_MAX, kept, varint

# A chart of the custom-scalars dashboard: (category, title, regex of the tags it draws).
Chart = tuple[str, str, str]

# the run's health first: what `report` flags on, then the loss where the trainer logs one
SUMMARY = (
    ("gradient ratio, last / first block", "grad_ratio"),
    ("residual growth, last / first block", "resid_growth"),
    ("max attention logit", "attn_logit_max"),
    ("modules with NaN/Inf outputs", "nonfinite"),
)
LOSS_REGEX = r"^(train/loss|train_loss|loss)$"
# Custom Scalars charts of a per-block series: this many blocks spread over the depth, one chart
# each (TensorBoard colours a chart's lines by run, without a legend)
CHART_BLOCKS = 4
PROFILE_PLUGIN = "normprobe_profile"  # a depth profile, for `report`; TensorBoard shows none
# heatmaps keep at most this many logged steps (halved, keeping every other, when full)
HEATMAP_COLUMNS = 256
HEATMAP_MIN_COLUMNS = 4  # fewer logged steps say nothing a line chart does not
HISTORY = 32  # logged steps of each scalar kept to judge flags as the run goes
# the Images tab sorts tags by name: heatmaps are ranked, gradient norms first, per-head last
HEATMAP_ORDER = (
    ["grad_norm"]
    + [n for n, s in SERIES.items() if n != "grad_norm" and not s.heads]
    + [n for n, s in SERIES.items() if s.heads]
)
# a heatmap's colour bar: the metric and its unit
LABELS = {
    "grad_norm": "gradient L2 norm",
    "resid_rms": "residual stream RMS",
    "resid_cos": "cosine, stream in vs out",
    "outlier_ratio": "max |x| / median |x|",
    "outlier_channel": "channel of max |x|",
    "outlier_kurtosis": "kurtosis of channel RMS",
    "update_ratio": "|Δw| / |w| per step",
    "weight_rms": "parameter RMS",
    "attn_logits_head": "max |q·k|·scale",
    "attn_entropy_head": "attention entropy (nats)",
}


def heatmap_tag(series: str, stack: str, layer: str = "") -> str:
    """The Images tab's tag of the heatmap of ``series`` over ``stack`` (per-head series: its
    ``layer`` in the blocks): ``normprobe/heatmap/<rank>_<series>/<stack>[/<layer>]``, ranked by
    `HEATMAP_ORDER` since TensorBoard sorts images by tag."""
    rank = HEATMAP_ORDER.index(series) if series in HEATMAP_ORDER else len(HEATMAP_ORDER)
    return tags.format("heatmap", f"{rank:02d}_{series}/{stack}" + (f"/{layer}" if layer else ""))


def custom_scalars_layout(scalars: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars dashboard: the summary, then the charts of each series and stack."""
    names = list(scalars)
    summary: dict[str, list[Any]] = {}
    for title, series in SUMMARY:
        if series in LOG2:
            summary[f"log2 {title} (0: even)"] = _chart(_summary_prefix(f"{series}_log2") + ".*")
        elif series in STACK_MAX:
            summary[f"{title} (each stack's largest)"] = _chart(_summary_prefix(series) + ".*")
        elif len(found := [t for t in names if t.startswith(tags.prefix(series))]) > 1:
            for tag in found:  # a chart per tag: NaN/Inf in outputs, in gradients
                subject = tag.removeprefix(tags.prefix(series))
                summary[f"{title}: {subject}"] = _chart(re.escape(tag))
        else:
            summary[title] = _chart(re.escape(tags.prefix(series)) + ".*")
    summary["loss"] = ["Multiline", [LOSS_REGEX]]
    categories: dict[str, dict[str, list[Any]]] = {f"{tags.PREFIX} summary": summary}
    for category, title, regex in charts(names):
        categories.setdefault(category, {})[title] = ["Multiline", [regex]]
    return categories


def _chart(regex: str) -> list[Any]:
    """A multi-line chart of the tags that ``regex`` matches whole."""
    return ["Multiline", [f"^{regex}$"]]


def _summary_prefix(name: str) -> str:
    return re.escape(tags.prefix("summary", name))


def profile_summary(profiles: dict[str, list[float]]) -> Summary:
    """The depth profiles as float tensors under a plugin TensorBoard has no dashboard for."""
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_FLOAT

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PROFILE_PLUGIN))
    return Summary(
        value=[
            Summary.Value(
                tag=tag,
                metadata=metadata,
                tensor=TensorProto(
                    dtype=DT_FLOAT,
                    tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=len(values))]),
                    float_val=values,
                ),
            )
            for tag, values in profiles.items()
        ]
    )


# a float32 none of whose bytes is 0: filled in place of 0.0, it tells the floats' bytes apart
_MARK = float(np.frombuffer(b"\x9f\x9f\x9f\x9f", dtype="<f4")[0])


class ProfileSummaries:
    """Serializes each step's depth profiles as `profile_summary` would, into a template of
    their tags and lengths made once by it (the bytes where its floats go: those that differ
    between two fills), keeping the templates of the last few layouts."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[tuple[str, int], ...], tuple[np.ndarray, np.ndarray]] = {}

    def serialized(self, profiles: dict[str, list[float]]) -> bytes:
        layout = tuple((tag, len(values)) for tag, values in profiles.items())
        template, positions = kept(self._layouts, layout, _profile_template)
        count = len(positions) // 4
        values = np.fromiter(itertools.chain.from_iterable(profiles.values()), np.float64, count)
        with np.errstate(over="ignore"):  # past float32's range: inf, as protobuf rounds it
            template[positions] = values.astype("<f4").view(np.uint8)
        return template.tobytes()


def _profile_template(layout: tuple[tuple[str, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The serialized profiles of ``layout`` (zeros), and the positions of their floats' bytes
    in order."""

    def filled(value: float) -> np.ndarray:
        profiles = {tag: [value] * length for tag, length in layout}
        return np.frombuffer(profile_summary(profiles).SerializeToString(), dtype=np.uint8)

    zeros, marked = filled(0.0), filled(_MARK)
    positions = np.flatnonzero(zeros != marked)
    assert len(positions) == 4 * sum(length for _, length in layout)
    return zeros.copy(), positions


def write_summary(writer: Any, summary: bytes, step: int) -> None:
    """Write ``summary`` (a serialized ``Summary``) into the event file of ``writer`` (a
    ``SummaryWriter``) as the event of ``step``, serialized here: a join of bytes, where
    protobuf would parse it, copy it into an event and serialize that."""
    event = b"".join(
        (
            b"\x09" + struct.pack("<d", time.time()),  # wall_time (1), a double
            b"\x10" + varint(step & 0xFFFFFFFFFFFFFFFF),  # step (2), an int64
            b"\x2a" + varint(len(summary)),  # summary (5)
            summary,
        )
    )
    file_writer = writer._get_file_writer()
    queue = getattr(getattr(file_writer, "event_writer", None), "_async_writer", None)
    if queue is not None:  # TensorBoard's EventFileWriter, which serializes and queues events
        queue.write(event)
    else:
        file_writer.add_event(Event.FromString(event), step)


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``, computed in C."""
    crc = int(google_crc32c.value(data))
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def use_fast_checksums() -> None:
    """Give TensorBoard's record writer `masked_crc32c`.

    Without TensorFlow, TensorBoard checksums every record in pure Python: about 1 ms per
    15 KB, in the writer's thread but holding the GIL, so a training loop logging a few hundred
    scalars a step waits for it. The C version gives the same checksums, bit for bit.
    """
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    if record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c:
        record_writer.masked_crc32c = masked_crc32c


def depth_histogram(writer: Any, tag: str, values: list[float], step: int) -> None:
    """A histogram whose bucket i holds block i's value: the metric against depth."""
    finite = [v if v == v and abs(v) != float("inf") else 0.0 for v in values]
    if not finite:
        return
    # bucket i spans (i, i + 1]: every block gets the same width on the depth axis
    writer.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(finite)),
        num=float(sum(finite)),
        sum=float(sum((i + 0.5) * v for i, v in enumerate(finite))),
        sum_squares=float(sum((i + 0.5) ** 2 * v for i, v in enumerate(finite))),
        bucket_limits=[float(i + 1) for i in range(len(finite))],
        bucket_counts=finite,
        global_step=step,
    )


def charts(scalars: Iterable[str]) -> list[Chart]:
    """The custom-scalars charts of a record's tags, in the families' order: one per stack-wide
    or module tag, and per series and stack (and position within the blocks, for modules) one
    for each of `CHART_BLOCKS` blocks spread over the depth. Each chart holds one tag, a line
    per run: TensorBoard colours lines by run and shows no legend but the runs' list."""
    found: dict[tuple[str, str], str] = {}
    per_block: dict[tuple[str, str, str | None], dict[int, str]] = {}
    for tag in scalars:
        t = tags.parse(tag)
        if t is None or t.series == "summary":
            continue
        if t.block is None:
            found[(t.series, t.subject)] = "^" + re.escape(tag) + "$"
        else:
            per_block.setdefault((t.series, t.subject, t.layer), {})[t.block] = tag
    for (series, _, _), by_block in per_block.items():
        blocks = sorted(by_block)
        for k in spread(len(blocks), CHART_BLOCKS):
            tag = by_block[blocks[k]]
            found[(series, tag.split("/", 2)[2])] = "^" + re.escape(tag) + "$"
    order = {name: i for i, name in enumerate(SERIES)}
    ranked = sorted(found.items(), key=lambda item: order.get(item[0][0], len(order)))
    return [(f"{tags.PREFIX} {series}", title, regex) for (series, title), regex in ranked]
