"""`nonfinite` reads each block as one module: where a block's output is the first to hold a
NaN/Inf, its step names the block and the next step, logged for it, reads the block's modules
and names the module; models without stacks read every module."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from nonfinite_net import Net, loss
from tb import read_events, read_texts
from torch import nn

import normprobe
from normprobe import probes, tags
from normprobe.metrics.nonfinite import BLOCK
from normprobe.report import report

FORWARD = tags.format("nonfinite", "modules")
FIRST = tags.format("nonfinite", "first")


def poisoned() -> Net:
    """`Net` with a finite backward, and a NaN weight in block 2's fc2."""
    model = Net()
    model.sqrt.eps = 1.0
    with torch.no_grad():
        model.blocks[2].fc2.weight[0, 0] = math.nan
    return model


def test_the_block_first_then_the_module_on_the_next_step(tmp_path: Path) -> None:
    model = poisoned()
    x = torch.randn(8, 16)
    with normprobe.attach(model, log_dir=str(tmp_path), every=5, metrics=["nonfinite"]) as probe:
        with pytest.warns(RuntimeWarning, match=r"output of blocks\.2 \(block; module not"):
            loss(model, x).backward()
            probe.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            for _ in range(3):
                model.zero_grad()
                loss(model, x).backward()
                probe.step()
    events = read_events(str(tmp_path))
    # step 0: blocks 2, 3, 4, ln_f, head and the root; step 1 (logged for it) adds fc2 inside
    # block 2; step 2 is not logged: the module is named
    assert events.scalars[FORWARD] == [(0, 6.0), (1, 7.0)]
    assert read_texts(str(tmp_path))[FIRST + "/text_summary"] == [
        (0, "blocks.2" + BLOCK),
        (1, "blocks.2.fc2"),
    ]
    (flag,) = [f for f in report(tmp_path).flags if f.kind == "nan onset"]
    assert flag.step == 0 and flag.severity == "problem"
    assert "blocks.2.fc2 (block blocks.2 at step 0, the module at step 1)" in flag.message


def test_only_the_blocks_as_wholes_are_hooked_until_one_is_first(tmp_path: Path) -> None:
    model = Net()
    model.sqrt.eps = 1.0
    x = torch.randn(8, 16)
    hooked: list[list[str]] = []

    def seen(module: nn.Module, args: object, out: object) -> None:
        hooked.append([p for p, m in model.named_modules() if m._forward_hooks])

    sinks = [normprobe.MemorySink()]
    with normprobe.attach(
        model, every=1, metrics=["nonfinite"], sinks=sinks, example_inputs=(x,)
    ) as probe:
        handle = model.register_forward_hook(seen)
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.blocks[4].fc1.weight[0, 0] = math.nan
            model.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                loss(model, x).backward()
                probe.step()
        handle.remove()
    outside = ["", "inp", "blocks", *(f"blocks.{b}" for b in range(5)), "ln_f", "head"]
    inside = [f"blocks.4.{m}" for m in ("ln", "fc1", "act", "fc2")]
    assert hooked[0] == hooked[1] == outside
    assert sorted(hooked[2]) == sorted(outside + inside)  # step 1 found block 4 first


def test_a_model_without_stacks_reads_every_module(tmp_path: Path) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    model = Two()
    with torch.no_grad():
        model.b.weight[0, 0] = math.nan
    x = torch.randn(2, 4)
    with normprobe.attach(
        model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"], example_inputs=(x,)
    ) as probe:
        assert probe.stacks == []
        with pytest.warns(RuntimeWarning, match=r"output of b at step 0 \(2 modules read"):
            model(x)
            probe.step()
    assert read_texts(str(tmp_path))[FIRST + "/text_summary"] == [(0, "b")]


@pytest.mark.parametrize("order", [("nonfinite", "resid_rms"), ("resid_rms", "nonfinite")])
def test_a_block_whose_stream_is_read_is_not_summed_again(
    monkeypatch: pytest.MonkeyPatch, order: tuple[str, ...]
) -> None:
    sums = [0]
    finite_sum = probes.finite_sum

    def counted(x: torch.Tensor) -> torch.Tensor:
        sums[0] += 1
        return finite_sum(x)

    monkeypatch.setattr(probes, "finite_sum", counted)
    x = torch.randn(8, 16)
    counts = []
    for metrics in (["nonfinite"], list(order)):
        model = poisoned()
        with normprobe.attach(
            model, every=1, metrics=metrics, sinks=[normprobe.MemorySink()], example_inputs=(x,)
        ) as probe:
            sums[0] = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                model(x)
            counts.append(sums[0])
            probe.step()
        record = probe.latest
        assert record is not None and record.texts[FIRST] == "blocks.2" + BLOCK
        assert record.scalars[FORWARD] == 6
    # inp, the 5 blocks, ln_f, head (the root returns head's output): the blocks' streams are
    # read for resid_rms, and their row norms say as much
    assert counts == [8, 3]
