"""A pipeline stage's micro-batches: what each forward of a logged step measured combines into
the whole batch's, each weighted by its size (`normprobe.runtime.packing.read_micro_batches`)."""

from __future__ import annotations

import pytest
import torch

from normprobe.runtime.packing import Layout, Measurements, read_micro_batches


def test_micro_batches_of_unequal_sizes_combine_into_the_whole_batch() -> None:
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    layout = Layout()
    rms, mean, top, low = (layout.slot(1, r) for r in ("rms", "mean", "max", "min"))
    step = layout.slot(1, "sum")  # read once, at the step
    measured = Measurements()
    for part in (x[:2], x[2:]):  # 2 rows, then 1
        measured.put(rms, part.pow(2).mean().sqrt())
        measured.put(mean, part.mean())
        measured.put(top, part.amax())
        measured.put(low, part.amin())
        measured.end_forward(float(part.numel()))
    measured.put(step, torch.tensor(7.0))
    values = read_micro_batches(measured, layout, torch.device("cpu"), validation=False)
    want = {rms: x.pow(2).mean().sqrt(), mean: x.mean(), top: x.amax(), low: x.amin()}
    for slot, value in want.items():
        assert values.get(slot) == [pytest.approx(value.item(), rel=1e-6)], slot.reduce
    assert values.get(step) == [7.0]


def test_a_step_without_forwards_reads_what_the_step_measured() -> None:
    layout = Layout()
    slot, unread = layout.slot(2, "sum"), layout.slot(1, "mean")
    measured = Measurements()
    measured.put(slot, torch.tensor([1.0, 2.0]))
    values = read_micro_batches(measured, layout, torch.device("cpu"), validation=False)
    assert values.get(slot) == [1.0, 2.0] and values.get(unread) is None
