"""The ``weight_rms`` family: per-block weight RMS, against values set by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import normprobe
from normprobe import tags
from normprobe.models import MLPStack, ResidualStack


def _constant_blocks(model: ResidualStack) -> None:
    """Block i of ``lins``: every weight and bias entry i + 1. ``lns``: gains 1, biases 0."""
    with torch.no_grad():
        for i, lin in enumerate(model.lins):
            lin.weight.fill_(i + 1.0)
            lin.bias.fill_(i + 1.0)


def test_block_rms_equals_the_constant_its_entries_hold() -> None:
    model = ResidualStack(4, 8)
    _constant_blocks(model)
    sink = normprobe.MemorySink()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with normprobe.attach(model, opt, sinks=[sink], metrics=["weight_rms"], every=1):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    scalars = sink.records[0].scalars
    for i in range(4):
        assert scalars[tags.format("weight_rms", "lins", i, depth=4)] == pytest.approx(i + 1.0)
        # a LayerNorm at init: 8 gains of 1 and 8 biases of 0
        assert scalars[tags.format("weight_rms", "lns", i, depth=4)] == pytest.approx(
            math.sqrt(0.5)
        )
    assert sink.records[0].profiles[tags.format("weight_rms", "lins")] == pytest.approx(
        [1.0, 2.0, 3.0, 4.0]
    )


def test_read_before_the_optimizer_step() -> None:
    model = ResidualStack(2, 4)
    _constant_blocks(model)
    sink = normprobe.MemorySink()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # gradient of sum(all lins.0 entries): 1 for each, so SGD takes every entry from 1 to 0
    probe = normprobe.attach(
        model,
        opt,
        sinks=[sink],
        metrics=["weight_rms"],
        every=1,
        example_inputs=(torch.ones(1, 4),),
    )
    with probe:
        for _ in range(2):
            opt.zero_grad()
            sum(p.sum() for p in model.lins[0].parameters()).backward()
            opt.step()
    tag = tags.format("weight_rms", "lins", 0, depth=2)
    assert sink.series(tag) == [(0, pytest.approx(1.0)), (1, pytest.approx(0.0))]


def test_report_reads_the_family_back(tmp_path: Path) -> None:
    model = ResidualStack(3, 4)
    _constant_blocks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), metrics=["weight_rms"], every=1):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    row = normprobe.report_run(tmp_path).row("lins", "weight_rms[mean]")
    assert row.values == pytest.approx((2.0, 2.0))  # the mean of 1, 2 and 3 at both steps


def test_large_tensors_are_read_from_a_sample_within_the_stated_bound() -> None:
    """Weights of 262,144 entries: RMS estimated from the update ratio's strided sample,
    within 0.8% of the exact one (the bound the family's description states)."""
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=256)
    sink = normprobe.MemorySink()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with normprobe.attach(model, opt, sinks=[sink], metrics=["weight_rms"], every=1):
        model(torch.randn(4, 256)).pow(2).mean().backward()
        opt.step()
    scalars = sink.records[0].scalars
    for i, block in enumerate(model.blocks):
        params = list(block.parameters())
        exact = math.sqrt(
            sum(p.detach().pow(2).sum().item() for p in params) / sum(p.numel() for p in params)
        )
        logged = scalars[tags.format("weight_rms", "blocks", i, depth=3)]
        assert logged == pytest.approx(exact, rel=0.008)
        assert logged != pytest.approx(exact, rel=1e-6)  # a sample, not every entry
