"""GPT-2's 1/sqrt(2N) for residual adds outside any stack: N counts the adds, not the blocks of
a stack without residual adds (a U-Net decoder of plain conv blocks, as MONAI's DynUNet)."""

from __future__ import annotations

import math

import torch
from torch import nn

import normprobe

WIDTH = 128


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.norm(x))))


class Down(Residual):
    """A block of its own class (DynUNet's input, down and bottleneck blocks differ)."""


class Bottom(Residual):
    pass


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class UNetLike(nn.Module):
    """Three residual blocks held one per attribute, then a chain of four plain blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.down, self.bottom = Residual(), Down(), Bottom()
        self.ups = nn.ModuleList(Plain() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bottom(self.down(self.first(x)))
        for up in self.ups:
            x = up(x)
        return x


def test_adds_outside_stacks_count_themselves_not_a_stack_without_adds() -> None:
    torch.manual_seed(0)
    model = UNetLike()
    x = torch.randn(4, WIDTH)
    found = normprobe.discover(model, x)
    assert [(s.path, s.depth, s.placement) for s in found.stacks] == [("ups", 4, "no-residual")]
    assert len(found.residual_adds) == 3 and all(a.stack is None for a in found.residual_adds)
    normprobe.reinit(model, "gpt2", example_inputs=(x,))
    expected = 0.02 / math.sqrt(2 * 3)  # three adds, not the four blocks of ups
    for block in (model.first, model.down, model.bottom):
        assert abs(float(block.out.weight.std()) / expected - 1) < 0.03
