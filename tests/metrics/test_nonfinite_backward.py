"""`nonfinite` in backward: the block whose backward made a NaN/Inf from a finite gradient is
named on its step (narrowed down by its parameter gradients), the module on the next step, which
is logged for it; on logged steps only, with one host transfer per healthy logged step; healthy
models with in-place activations train through it unchanged."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from nonfinite_net import Net, loss
from syncs import CountSyncs
from tb import read_events, read_texts
from torch import nn

import normprobe
from normprobe import tags
from normprobe.cli import main as normprobe_main
from normprobe.runtime import backward

BACKWARD = tags.format("nonfinite", "backward_modules")
FIRST_BACKWARD = tags.format("nonfinite", "first_backward")
FORWARD = tags.format("nonfinite", "modules")
FIRST = tags.format("nonfinite", "first")
# step 0's text: block 2 (fc1's weight gradient is NaN, fc2's finite: act lies between them)
BLOCK_2 = (
    "blocks.2 (block; module not localized yet); parameter gradients not finite in "
    "blocks.2.fc1, finite in blocks.2.fc2"
)


def healthy(record: normprobe.Record) -> bool:
    """Both parts measured, nothing non-finite."""
    named = {FIRST, FIRST_BACKWARD} & set(record.texts)
    return record.scalars == {FORWARD: 0, BACKWARD: 0} and not named


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of gradient hooks registered on module inputs and outputs (each is a
    `functools.partial` of `backward._gradient`), as a one-item list the test can reset."""
    count = [0]

    def counting(fn: Any, *args: Any) -> Any:
        count[0] += fn is backward._gradient
        return functools.partial(fn, *args)

    monkeypatch.setattr(backward, "partial", counting)
    yield count


def test_names_the_module_whose_backward_made_the_nan_and_warns_once(tmp_path: Path) -> None:
    model = Net()
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        with pytest.warns(
            RuntimeWarning, match=r"input gradient of blocks\.2 \(block; module not localized "
        ):
            loss(model, torch.randn(8, 16)).backward()
            probe.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise here
            model.zero_grad()
            loss(model, torch.randn(8, 16)).backward()
            probe.step()
    record = probe.latest
    assert record is not None and record.step == 1
    assert record.scalars[FORWARD] == 0  # the forward is finite
    assert record.texts == {FIRST_BACKWARD: "blocks.2.act"}
    # input gradients of the modules read: block 2's act, fc1, ln and the block (fc2 received
    # act's finite one), then blocks 1 and 0 as wholes; inp and the root were called with x
    assert record.scalars[BACKWARD] == 6
    assert read_texts(str(tmp_path))[FIRST_BACKWARD + "/text_summary"] == [
        (0, BLOCK_2),
        (1, "blocks.2.act"),
    ]


def test_a_healthy_backward_names_nothing(tmp_path: Path) -> None:
    model = Net()
    model.sqrt.eps = 1.0
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        loss(model, torch.randn(8, 16)).backward()
        probe.step()
    assert probe.latest is not None and healthy(probe.latest)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_gradient_non_finite_from_the_loss_names_no_module(tmp_path: Path) -> None:
    model = Net()
    model.sqrt.eps = 1.0
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        (model(torch.randn(8, 16)) * torch.tensor([1.0, 1.0, 1.0, math.inf])).sum().backward()
        probe.step()
    assert probe.latest is not None and FIRST_BACKWARD not in probe.latest.texts
    # every module read but inp and the root (called with x): head, ln_f and the 5 blocks
    assert probe.latest.scalars == {FORWARD: 0, BACKWARD: 7}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("poisoned", [0, 1])
def test_of_several_forwards_in_a_step_the_last_counts(tmp_path: Path, poisoned: int) -> None:
    model = Net()
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        for micro in range(2):  # gradient accumulation: one backward after each forward
            model.sqrt.eps = 0.0 if micro == poisoned else 1.0
            loss(model, torch.randn(8, 16)).backward()
        probe.step()
        # both forwards first, then one backward: the first forward's hooks stay quiet
        total = torch.zeros(())
        for micro in range(2):
            model.sqrt.eps = 0.0 if micro == poisoned else 1.0
            total = total + loss(model, torch.randn(8, 16))
        total.backward()
        probe.step()
    written = read_texts(str(tmp_path)).get(FIRST_BACKWARD + "/text_summary", [])
    assert written == ([(0, BLOCK_2), (1, "blocks.2.act")] if poisoned == 1 else [])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def _six_steps(model: nn.Module, tmp_path: Path, registered: list[int]) -> tuple[list, list]:
    """Six steps logging every 3rd with ``nonfinite`` alone: the gradient hooks registered and
    the host syncs of each step."""
    hooks, syncs = [], []
    x = torch.randn(8, 16)
    with normprobe.attach(
        model, log_dir=str(tmp_path), every=3, metrics=["nonfinite"], example_inputs=(x,)
    ) as probe:
        for _ in range(6):
            registered[0] = 0
            with CountSyncs() as counter:
                model.zero_grad()
                loss(model, x).backward()
                probe.step()
            hooks.append(registered[0])
            syncs.append(counter.count)
    return hooks, syncs


def test_nothing_is_watched_on_unlogged_steps_and_one_transfer_on_logged_ones(
    tmp_path: Path, registered: list[int]
) -> None:
    model = Net()
    model.sqrt.eps = 1.0
    hooks, syncs = _six_steps(model, tmp_path, registered)
    assert syncs == [1, 0, 0, 1, 0, 0]
    # logged: the input and output tensors of the modules read (inp, the blocks, ln_f, head)
    assert hooks[0] == hooks[3] == 8 and hooks[1:3] == hooks[4:] == [0, 0]
    assert read_events(str(tmp_path)).scalars[BACKWARD] == [(0, 0.0), (3, 0.0)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_block_found_logs_the_next_step_and_reads_its_modules(
    tmp_path: Path, registered: list[int]
) -> None:
    model = Net()
    hooks, syncs = _six_steps(model, tmp_path, registered)
    # step 0 reads its parameter gradients back too; step 1 is logged for block 2, whose
    # modules (the outputs of ln, fc1, act, fc2) are read from then on, as it stays first
    assert syncs == [2, 1, 0, 1, 0, 0]
    assert hooks == [8, 12, 0, 12, 0, 0]
    assert read_events(str(tmp_path)).scalars[BACKWARD] == [(0, 3.0), (1, 6.0), (3, 6.0)]
    written = read_texts(str(tmp_path))[FIRST_BACKWARD + "/text_summary"]
    assert written == [(0, BLOCK_2), (1, "blocks.2.act"), (3, "blocks.2.act")]


def test_not_on_compiled_models(registered: list[int]) -> None:
    # persistent hooks (what a compiled model needs) run on every step: no tensor hook there
    model = Net()
    x = torch.randn(8, 16)
    sink = normprobe.MemorySink()
    probe = normprobe.Probe(model, sinks=[sink], metrics=["nonfinite"], persistent_hooks=True)
    probe.discover_now(x)
    loss(model, x).backward()
    probe.step()
    probe.remove()
    assert registered[0] == 0
    assert [r.scalars for r in sink.records] == [{FORWARD: 0}]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_report_flags_the_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = Net()
    with normprobe.attach(model, log_dir=str(tmp_path), every=2) as probe:
        for step in range(5):
            model.sqrt.eps = 0.0 if step >= 2 else 1.0
            model.zero_grad()
            loss(model, torch.randn(8, 16)).backward()
            probe.step()
    assert normprobe_main(["report", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "[nan onset in backward] model at step 2:" in printed
    assert "the backward of blocks.2.act" in printed
    assert "[nan onset]" not in printed  # no probe.step() moved the weights: forwards are finite


@pytest.mark.slow
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_torchvision_resnet_with_inplace_relu_trains_unchanged() -> None:
    from torchvision.models import resnet18

    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    grads = []
    for probed in (False, True):
        torch.manual_seed(0)
        model = resnet18(num_classes=10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sinks = [normprobe.MemorySink()]
        probe = normprobe.attach(model, opt, sinks=sinks, every=1, metrics=["nonfinite"])
        if not probed:
            probe.remove()
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), target).backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            opt.step()
        probe.remove()
        if probed:
            assert [r.step for r in sinks[0].records] == [0, 1]
            assert all(healthy(r) for r in sinks[0].records)
    unprobed, probed = grads[:2], grads[2:]
    for a, b in zip(unprobed, probed, strict=True):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_healthy_gpt2_reports_no_backward_nonfinite() -> None:
    built = zoo.build("gpt2")
    model = built.model
    model.train()
    ids = built.args[0]
    assert isinstance(ids, torch.Tensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sinks = [normprobe.MemorySink()]
    with normprobe.attach(model, opt, sinks=sinks, every=1, metrics=["nonfinite"]):
        for _ in range(2):
            model(ids, labels=ids, **built.kwargs).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [r.step for r in sinks[0].records] == [0, 1]
    assert all(healthy(r) for r in sinks[0].records)
