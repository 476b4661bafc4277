"""The scalar and depth-profile summaries `TensorBoardSink` writes from templates, the events it
serializes itself, and the history of each tag it folds in lazily for judging the flags."""

from __future__ import annotations

import math
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from normprobe import TensorBoardSink, tags
from normprobe.sinks.record import Record
from normprobe.sinks.scalars import LAYOUTS, ScalarSummaries
from normprobe.sinks.summaries import (
    HISTORY,
    ProfileSummaries,
    profile_summary,
    write_summary,
)


def _values(serialized: bytes) -> dict[str, float]:
    return {v.tag: v.simple_value for v in Summary.FromString(serialized).value}


def _bits(x: float) -> bytes:
    return np.float32(x).tobytes()


def test_a_template_summary_equals_one_built_value_by_value() -> None:
    long = "normprobe/resid_rms/" + "x" * 200 + "/3"  # a two-byte length
    scalars = {
        "normprobe/resid_rms/blocks/0": 0.0,
        "normprobe/grad_norm/blocks/1": -1.5,
        "normprobe/weight_rms/blöcke/2": 1e39,  # past float32: inf, as protobuf rounds it
        "train/loss": 1e-50,  # under float32: 0
        "normprobe/nonfinite/blocks": math.nan,
        long: math.inf,
        "normprobe/update_ratio/blocks/0": 1 / 3,
    }
    made = ScalarSummaries().serialized(scalars)
    want = Summary()
    for tag, value in scalars.items():
        want.value.add(tag=tag, simple_value=value)
    assert made == want.SerializeToString()
    # and again with new values into the same template
    scalars = {tag: float(i) + 0.25 for i, tag in enumerate(scalars)}
    got = _values(ScalarSummaries().serialized(scalars))
    assert {t: _bits(v) for t, v in got.items()} == {t: _bits(v) for t, v in scalars.items()}


def test_companions_are_log2_ratios_and_each_stacks_largest_with_nan_winning() -> None:
    summaries = ScalarSummaries()
    logit = [tags.format("attn_logit_max", "blocks", b, "attn") for b in range(3)]
    other = tags.format("attn_logit_max", "enc", 0, "attn")
    ratio = tags.format("grad_ratio", "blocks")
    growth = tags.format("resid_growth", "blocks")
    top = tags.format("summary", "attn_logit_max/blocks")
    scalars = {ratio: 8.0, logit[0]: 3.0, growth: 0.0, logit[1]: 9.0, other: 2.0, logit[2]: 7.0}
    got = _values(summaries.serialized(scalars))
    assert got[tags.format("summary", "grad_ratio_log2/blocks")] == 3.0
    assert math.isnan(got[tags.format("summary", "resid_growth_log2/blocks")])  # no log of 0
    assert got[top] == 9.0 and got[tags.format("summary", "attn_logit_max/enc")] == 2.0
    # a NaN anywhere in the stack is its value, before or after the largest finite one
    assert math.isnan(_values(summaries.serialized({**scalars, logit[0]: math.nan}))[top])
    assert math.isnan(_values(summaries.serialized({**scalars, logit[2]: math.nan}))[top])
    assert _values(summaries.serialized({**scalars, logit[2]: math.inf}))[top] == math.inf


def test_records_with_other_tags_get_their_own_templates() -> None:
    summaries = ScalarSummaries()
    for n in range(1, 3 * LAYOUTS):
        scalars = {f"train/value_{i}": float(i * n) for i in range(n % 5 + 1)}
        assert _values(summaries.serialized(scalars)) == scalars
        assert len(summaries._layouts) <= LAYOUTS


def test_a_profile_template_serializes_as_protobuf_does() -> None:
    summaries = ProfileSummaries()
    edges = [0.0, -1.5, 1e39, 1e-50, math.nan, math.inf, 1 / 3]  # 1e39 -> inf, 1e-50 -> 0
    layouts = [
        {"normprobe/resid_rms/blocks": edges},
        {"a": [2.0], "normprobe/grad_norm/" + "x" * 200: [float(i) for i in range(48)]},
        {"b": [float(i) / 7 for i in range(300)]},  # lengths of two bytes
    ]
    for profiles in layouts:
        want = profile_summary(profiles).SerializeToString()
        assert summaries.serialized(profiles) == want
        again = {tag: [v * 3 + 1 for v in values] for tag, values in profiles.items()}
        assert summaries.serialized(again) == profile_summary(again).SerializeToString()
    assert len(summaries._layouts) == len(layouts)


class _EventsOnly:
    """An event writer that takes `Event` objects alone (no queue of serialized ones)."""

    def __init__(self, inner: Any) -> None:
        self.add_event, self.flush, self.close = inner.add_event, inner.flush, inner.close


@pytest.mark.parametrize("queue", [True, False])
def test_an_event_serialized_here_reads_back(tmp_path: Path, queue: bool) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path))
    if not queue:
        file_writer = writer._get_file_writer()
        file_writer.event_writer = _EventsOnly(file_writer.event_writer)
    scalars = {"train/loss": 0.5, "normprobe/grad_ratio/blocks": 8.0}
    profiles = {"normprobe/resid_rms/blocks": [1.0, 2.0, 4.0]}
    summary = ScalarSummaries().serialized(scalars) + ProfileSummaries().serialized(profiles)
    before = time.time()
    for step in (0, 7, 2**40):
        write_summary(writer, summary, step)
    writer.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    loaded = [Event.FromString(record) for record in RawEventFileLoader(str(events)).Load()]
    written = [e for e in loaded if e.HasField("summary")]
    assert [e.step for e in written] == [0, 7, 2**40]
    assert all(before <= e.wall_time <= time.time() for e in written)
    values = {v.tag: v for v in written[-1].summary.value}
    assert values["train/loss"].simple_value == 0.5
    assert values["normprobe/grad_ratio/blocks"].simple_value == 8.0
    assert list(values["normprobe/resid_rms/blocks"].tensor.float_val) == [1.0, 2.0, 4.0]


def test_the_folded_history_holds_each_tags_last_values_and_its_first(tmp_path: Path) -> None:
    """Tags that come and go (spike records, a family logged now and then) keep their own last
    `HISTORY` values however many records came since."""
    rng = random.Random(0)
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=0)
    history: dict[str, deque[tuple[int, float]]] = {}
    first: dict[str, tuple[int, float]] = {}
    for step in range(11 * HISTORY):
        names = ["a", "b"] + [t for t in ("rare", "early", "late") if _present(t, step, rng)]
        scalars = {name: rng.random() for name in names}
        sink.write(Record(step, scalars=scalars))
        for tag, value in scalars.items():
            history.setdefault(tag, deque(maxlen=HISTORY)).append((step, value))
            first.setdefault(tag, (step, value))
        if step % 50 == 0:
            sink._fold()  # as a judging of the flags does, at any step
    sink._fold()
    assert sink._first == first
    assert {t: list(h) for t, h in sink._history.items()} == {
        t: list(h) for t, h in history.items()
    }
    assert len(history["early"]) == HISTORY and history["early"][-1][0] < 40
    sink.close()


def _present(tag: str, step: int, rng: random.Random) -> bool:
    if tag == "rare":
        return rng.random() < 0.05
    return step < 40 if tag == "early" else step > 300
