"""The records of a pipeline's stages combined into the whole stack's
(`normprobe.runtime.pipeline_records.combined`): each block's value from its stage, the stack's
ratios from the combined profile, the totals from the stages' squares."""

from __future__ import annotations

import math

import pytest

from normprobe.probes import loglog_slope
from normprobe.runtime.pipeline_records import combined, encoded
from normprobe.sinks import Record

NAN = math.nan


def stage(
    first: int, grads: list[float], cosines: list[float], total: float, handed: bool
) -> bytes:
    """A stage of 2 blocks of a 4-block stack, as it writes its record."""
    record = Record(5)
    profile = [NAN] * 4
    profile[first : first + 2] = grads
    record.profiles["normprobe/grad_norm/blocks"] = profile
    record.profiles["normprobe/resid_rms/blocks"] = list(profile)
    cos = [NAN] * 4
    cos[first : first + 2] = cosines
    record.profiles["normprobe/resid_cos/blocks"] = cos
    for b in range(first, first + 2):
        record.scalars[f"normprobe/grad_norm/blocks/{b}"] = profile[b]
        if not math.isnan(cos[b]):
            record.scalars[f"normprobe/resid_cos/blocks/{b}"] = cos[b]
    record.scalars["normprobe/grad_ratio/blocks"] = grads[1] / grads[0]  # this stage's only
    record.scalars["normprobe/grad_norm_total/model"] = total
    record.texts["normprobe/placement/blocks"] = "pre-ln"
    return encoded(record, {"blocks": (first, handed)})


def test_the_stages_make_the_whole_stack() -> None:
    whole = combined(5, [stage(0, [1.0, 2.0], [NAN, 0.9], 3.0, True),
                         stage(2, [4.0, 8.0], [0.8, 0.7], 4.0, False)])  # fmt: skip
    assert whole.step == 5
    assert whole.profiles["normprobe/grad_norm/blocks"] == [1.0, 2.0, 4.0, 8.0]
    assert whole.scalars["normprobe/grad_norm/blocks/3"] == 8.0
    assert whole.scalars["normprobe/grad_ratio/blocks"] == 8.0  # last over first, both stages
    assert whole.scalars["normprobe/resid_growth/blocks"] == 8.0
    assert whole.scalars["normprobe/resid_slope/blocks"] == loglog_slope([1.0, 2.0, 4.0, 8.0])
    assert whole.scalars["normprobe/grad_norm_total/model"] == pytest.approx(5.0)
    assert whole.scalars["normprobe/resid_cos/blocks/2"] == 0.8  # stage 0 handed its stream on
    assert whole.texts == {"normprobe/placement/blocks": "pre-ln"}


def test_a_stage_that_did_not_hand_its_stream_on_drops_the_next_ones_first_cosine() -> None:
    whole = combined(5, [stage(0, [1.0, 2.0], [NAN, 0.9], 3.0, False),
                         stage(2, [4.0, 8.0], [0.8, 0.7], 4.0, False)])  # fmt: skip
    assert "normprobe/resid_cos/blocks/2" not in whole.scalars
    cos = whole.profiles["normprobe/resid_cos/blocks"]
    assert math.isnan(cos[2]) and cos[1:4:2] == [0.9, 0.7]


def test_a_value_two_stages_write_is_refused() -> None:
    one = stage(0, [1.0, 2.0], [NAN, 0.9], 3.0, True)
    with pytest.raises(RuntimeError, match="two pipeline stages writing normprobe/grad_norm"):
        combined(5, [one, one])
