"""The scalar summaries `TensorBoardSink` writes from a template of the tags, and the history of
each tag it folds in lazily for judging the flags."""

from __future__ import annotations

import math
import random
from collections import deque
from pathlib import Path

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary

from normprobe import TensorBoardSink, tags
from normprobe.sinks.record import Record
from normprobe.sinks.scalars import LAYOUTS, ScalarSummaries
from normprobe.sinks.summaries import HISTORY


def _values(summary: Summary) -> dict[str, float]:
    return {v.tag: v.simple_value for v in summary.value}


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
    made = ScalarSummaries().summary(scalars)
    want = Summary()
    for tag, value in scalars.items():
        want.value.add(tag=tag, simple_value=value)
    assert made.SerializeToString() == want.SerializeToString()
    # and again with new values into the same template
    scalars = {tag: float(i) + 0.25 for i, tag in enumerate(scalars)}
    got = _values(ScalarSummaries().summary(scalars))
    assert {t: _bits(v) for t, v in got.items()} == {t: _bits(v) for t, v in scalars.items()}


def test_companions_are_log2_ratios_and_each_stacks_largest_with_nan_winning() -> None:
    summaries = ScalarSummaries()
    logit = [tags.format("attn_logit_max", "blocks", b, "attn") for b in range(3)]
    other = tags.format("attn_logit_max", "enc", 0, "attn")
    ratio = tags.format("grad_ratio", "blocks")
    growth = tags.format("resid_growth", "blocks")
    top = tags.format("summary", "attn_logit_max/blocks")
    scalars = {ratio: 8.0, logit[0]: 3.0, growth: 0.0, logit[1]: 9.0, other: 2.0, logit[2]: 7.0}
    got = _values(summaries.summary(scalars))
    assert got[tags.format("summary", "grad_ratio_log2/blocks")] == 3.0
    assert math.isnan(got[tags.format("summary", "resid_growth_log2/blocks")])  # no log of 0
    assert got[top] == 9.0 and got[tags.format("summary", "attn_logit_max/enc")] == 2.0
    # a NaN anywhere in the stack is its value, before or after the largest finite one
    assert math.isnan(_values(summaries.summary({**scalars, logit[0]: math.nan}))[top])
    assert math.isnan(_values(summaries.summary({**scalars, logit[2]: math.nan}))[top])
    assert _values(summaries.summary({**scalars, logit[2]: math.inf}))[top] == math.inf


def test_records_with_other_tags_get_their_own_templates() -> None:
    summaries = ScalarSummaries()
    for n in range(1, 3 * LAYOUTS):
        scalars = {f"train/value_{i}": float(i * n) for i in range(n % 5 + 1)}
        assert _values(summaries.summary(scalars)) == scalars
        assert len(summaries._layouts) <= LAYOUTS


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
