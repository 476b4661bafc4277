"""The TensorBoard sink's checksums: TensorBoard's own, computed in C."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tb import read_events
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer

from normprobe import tags
from normprobe.sinks import Record, TensorBoardSink, masked_crc32c


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
