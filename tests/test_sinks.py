"""The TensorBoard sink's checksums: TensorBoard's own, computed in C."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
from tb import read_events
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer

from normprobe import tags
from normprobe.sinks import Record, TensorBoardSink, charts, heatmap_tag, masked_crc32c


def test_masked_crc32c_is_tensorboards_own() -> None:
    rng = random.Random(0)
    samples = [b"", b"a", bytes(range(256))] + [
        rng.randbytes(rng.randrange(1, 5000)) for _ in range(50)
    ]
    for data in samples:
        assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)


def test_a_sink_writes_records_tensorboard_verifies(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path))
    assert record_writer.masked_crc32c is masked_crc32c
    for step in range(3):
        sink.write(
            Record(step, scalars={tags.format("x", str(i)): step + i / 10 for i in range(300)})
        )
    sink.close()
    # the reader recomputes every record's checksum in pure Python and drops what fails
    scalars = read_events(str(tmp_path)).scalars
    assert len(scalars) == 300
    series = scalars[tags.format("x", "7")]
    assert [step for step, _ in series] == [0, 1, 2]
    assert [value for _, value in series] == pytest.approx([0.7, 1.7, 2.7])


def _profile_records(n: int) -> list[Record]:
    tag = tags.format("grad_norm", "blocks")
    return [Record(step, profiles={tag: [1.0 + step, 2.0, 3.0]}) for step in range(n)]


@pytest.mark.parametrize(("seconds", "drawn"), [(3600.0, [3, 5]), (0.0, [3, 4, 5])])
def test_heatmaps_are_redrawn_at_a_bounded_cadence(
    tmp_path: Path, seconds: float, drawn: list[int]
) -> None:
    pytest.importorskip("matplotlib")
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=1, heatmap_seconds=seconds)
    for record in _profile_records(6):
        sink.write(record)
    sink.close()
    images = read_events(str(tmp_path)).images[heatmap_tag("grad_norm", "blocks")]
    # from 4 logged steps on, at every record but at most once an hour; and at the close
    # unless nothing changed since the last drawing
    assert images == drawn


def test_summary_tags_log2_ratios_and_each_stacks_largest_logit(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=0)
    logits = {tags.format("attn_logit_max", "blocks", b, "attn"): v for b, v in enumerate([3, 7])}
    ratios = [(100.0, 0.5), (0.0, math.inf)]
    for step, (grad, growth) in enumerate(ratios):
        scalars = {tags.format("grad_ratio", "blocks"): grad}
        scalars[tags.format("resid_growth", "blocks")] = growth
        sink.write(Record(step, scalars={**scalars, **logits}))
    sink.close()
    scalars = read_events(str(tmp_path)).scalars
    log2 = scalars[tags.format("summary", "grad_ratio_log2/blocks")]
    assert log2[0] == (0, pytest.approx(math.log2(100))) and math.isnan(log2[1][1])
    growth = scalars[tags.format("summary", "resid_growth_log2/blocks")]
    assert growth[0] == (0, -1.0) and math.isnan(growth[1][1])  # no log of 0 or inf
    assert scalars[tags.format("summary", "attn_logit_max/blocks")] == [(0, 7.0), (1, 7.0)]


def test_custom_scalars_chart_a_few_blocks_each_one_tag() -> None:
    names = [tags.format("resid_rms", "blocks", b, depth=10) for b in range(10)]
    names += [tags.format("grad_ratio", "blocks"), tags.format("summary", "grad_ratio_log2/x")]
    found = charts(names)
    # spread over the depth, first and last included; the summary's own tags chart nowhere
    titles = [title for _, title, _ in found]
    assert titles == ["blocks/0", "blocks/3", "blocks/6", "blocks/9", "blocks"]
    assert found[1][2] == "^" + re.escape(tags.format("resid_rms", "blocks", 3, depth=10)) + "$"
