"""`nonfinite` on blocks whose modules lie in several lists (`ListNet`, ResidualStack): each
block is read as one unit from the residual streams around it (its output the stream it leaves,
its input the one it was handed), and its modules only once it is found first."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from nonfinite_net import ListNet
from tb import read_texts
from torch import nn

import normprobe
from normprobe import tags
from normprobe.metrics.nonfinite import BLOCK
from normprobe.models import ResidualStack
from normprobe.report import report

FORWARD = tags.format("nonfinite", "modules")
FIRST = tags.format("nonfinite", "first")
BACKWARD = tags.format("nonfinite", "backward_modules")
FIRST_BACKWARD = tags.format("nonfinite", "first_backward")
UNIT_2 = "lns.2 + fc1s.2 + fc2s.2"  # block 2: its norm and its branch's layers


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _steps(model: nn.Module, tmp_path: Path, steps: int = 3) -> list[normprobe.Record]:
    records = []
    x = torch.randn(8, 16)
    with normprobe.attach(model, log_dir=str(tmp_path), every=1, metrics=["nonfinite"]) as probe:
        for _ in range(steps):
            model.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                _loss(model, x).backward()
                probe.step()
            assert probe.latest is not None
            records.append(probe.latest)
    return records


def test_forward_names_the_unit_then_the_module(tmp_path: Path) -> None:
    model = ListNet()
    model.sqrt.eps = 1.0
    with torch.no_grad():
        model.fc2s[2].weight[0, 0] = math.nan
    records = _steps(model, tmp_path)
    assert [r.texts.get(FIRST) for r in records] == [UNIT_2 + BLOCK, "fc2s.2", "fc2s.2"]
    # step 0: blocks 2, 3 and 4 (units), acts.3 and acts.4 (read on their own), ln_f, head and
    # the root; from step 1 on fc2s.2 too
    assert [r.scalars[FORWARD] for r in records] == [8, 9, 9]
    (flag,) = [f for f in report(tmp_path).flags if f.kind == "nan onset"]
    assert f"fc2s.2 (block {UNIT_2} at step 0, the module at step 1)" in flag.message


def test_backward_names_the_unit_narrowed_then_the_module(tmp_path: Path) -> None:
    records = _steps(ListNet(), tmp_path)
    assert [r.texts.get(FIRST_BACKWARD) for r in records] == [
        f"{UNIT_2}{BLOCK}; parameter gradients not finite in fc1s.2, finite in fc2s.2",
        "fc1s.2",
        "fc1s.2",
    ]
    assert [r.scalars[FORWARD] for r in records] == [0, 0, 0]
    texts = read_texts(str(tmp_path))[FIRST_BACKWARD + "/text_summary"]
    assert [step for step, _ in texts] == [0, 1, 2]


def test_only_the_modules_outside_units_are_hooked_while_healthy(tmp_path: Path) -> None:
    model = ListNet()
    model.sqrt.eps = 1.0
    hooked: list[str] = []

    def seen(module: nn.Module, args: object, out: object) -> None:
        hooked[:] = [p for p, m in model.named_modules() if m._forward_hooks]

    model.register_forward_hook(seen)
    records = _steps(model, tmp_path, steps=2)
    assert [r.scalars for r in records] == [{FORWARD: 0, BACKWARD: 0}] * 2
    # block 0 (no stream before it is read) and the activations are read on their own; blocks
    # 1-4 from their streams, which the norms after them are called with (hooked for that)
    block_0 = ["lns.0", "fc1s.0", "fc2s.0"]
    acts = [f"acts.{b}" for b in range(5)]
    lists = ["lns", "fc1s", "acts", "fc2s"]
    streams = [f"lns.{b}" for b in range(1, 5)]
    everything = ["", "inp", *lists, *block_0, *acts, *streams, "ln_f", "head"]
    assert sorted(hooked) == sorted(everything)


@pytest.mark.parametrize("pre_ln", [True, False])
def test_residual_stack_finds_the_module_inside_its_unit(tmp_path: Path, pre_ln: bool) -> None:
    model = ResidualStack(6, 16, pre_ln=pre_ln)
    with torch.no_grad():
        model.lins[3].weight[0, 0] = math.inf
    records = _steps(model, tmp_path, steps=2)
    assert [r.texts.get(FIRST) for r in records] == ["lns.3 + lins.3" + BLOCK, "lins.3"]
