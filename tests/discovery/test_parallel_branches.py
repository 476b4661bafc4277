"""Parallel branches are sub-branches summed into the stream (GPT-J, Pythia, Falcon); a sum that
a nonlinearity then reads (an LSTM cell's W x + R h under its tanh, a divisor) is one branch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import normprobe

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
COMBINATIONS: dict[str, tuple[Combine, bool]] = {
    "summed into the stream": (lambda x, a, b: x + (a + b), True),
    "sum under a tanh": (lambda x, a, b: x + torch.tanh(a + b), False),
    "sum under a max": (lambda x, a, b: x + torch.maximum(a + b, torch.zeros_like(a)), False),
    "sum as a divisor": (lambda x, a, b: x + x.detach() / (1 + (a + b).abs()), False),
}


class Block(nn.Module):
    def __init__(self, combine: Combine, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.combine = combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.combine(x, self.a(h), self.b(h))


@pytest.mark.parametrize("name", COMBINATIONS)
def test_only_a_sum_into_the_stream_is_parallel(name: str) -> None:
    combine, parallel = COMBINATIONS[name]
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(combine) for _ in range(3)])
    found = normprobe.discover(model, torch.randn(2, 5, 16))
    assert len(found.residual_adds) == 3
    assert all(a.parallel is parallel for a in found.residual_adds)
    assert (found.stacks[0].placement == "parallel") is parallel
