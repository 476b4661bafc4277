"""Units of one class that a residual branch runs in turn (MONAI's ResidualUnit holds its conv
units in an ``nn.Sequential``) are that branch's sublayers, not a stack: the blocks around them
are the stack, and no nested-stacks doubt blocks ``reinit``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normprobe


class Unit(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(Unit(channels), Unit(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


@pytest.mark.parametrize("blocks", [1, 3])
def test_a_branch_of_units_is_no_stack(blocks: int) -> None:
    torch.manual_seed(0)
    body = nn.Sequential(*[Block(8) for _ in range(blocks)])
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), body, nn.Conv2d(8, 2, 1))
    x = torch.randn(2, 1, 16, 16)
    found = normprobe.discover(model, x)
    expected = [("1", blocks, "in-branch")] if blocks > 1 else []
    assert [(s.path, s.depth, s.placement) for s in found.stacks] == expected
    assert found.doubts == []
    assert len(found.residual_adds) == blocks
    normprobe.reinit(model, "gpt2", example_inputs=(x,))  # refused under a nested-stacks doubt
