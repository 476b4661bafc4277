"""Parameters that do not train (``requires_grad=False``) keep their values under every scheme,
with a warning: YOLO's DFL projection is a frozen ``arange`` that decodes boxes, a frozen
backbone under LoRA holds the pretrained weights, and no optimizer could repair either once
redrawn. gpt2 drew the DFL weight at std 0.02 without a word."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normprobe


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    """Three blocks, then a frozen projection like ultralytics' DFL (a 1x1 conv of arange)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(3)])
        self.dfl = nn.Conv1d(width, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.dfl.weight.copy_(torch.arange(width, dtype=torch.float).view(1, width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dfl(self.blocks(x).unsqueeze(-1))


@pytest.mark.parametrize("scheme", ["gpt2", "kaiming", "xavier"])
def test_frozen_weight_kept(scheme: str) -> None:
    torch.manual_seed(0)
    model = Net()
    model.blocks[1].fc.requires_grad_(False)  # a frozen layer inside a block, as under LoRA
    frozen_fc = model.blocks[1].fc.weight.detach().clone()
    trained_fc = model.blocks[0].fc.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = normprobe.reinit_with_report(
            model, scheme, example_inputs=(torch.randn(4, 16),)
        )
    assert torch.equal(model.dfl.weight.view(-1), torch.arange(16, dtype=torch.float))
    assert torch.equal(model.blocks[1].fc.weight, frozen_fc)
    assert not torch.equal(model.blocks[0].fc.weight, trained_fc)  # the rest is re-initialized
    assert not model.dfl.weight.requires_grad
    said = [w for w in caught if "do not train" in str(w.message)]
    assert said and "dfl.weight" in str(said[0].message)
    left = dict(report.left)
    assert "requires_grad=False" in left["dfl.weight"]
    assert "requires_grad=False" in left["blocks.1.fc.weight"]
    assert all(c.path not in ("dfl.weight", "blocks.1.fc.weight") for c in report.changed)
