"""A skip is the stream itself however the forward spells it: ``torch.as_tensor(x)`` (MONAI's
HighResBlock), ``x.data`` (MONAI's zero-padded ResNet shortcut), a cast or copy."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import normprobe

SKIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x": lambda x: x,
    "as_tensor": torch.as_tensor,
    "asarray": torch.asarray,
    "data": lambda x: x.data,
    "detach": lambda x: x.detach(),
    "contiguous": lambda x: x.contiguous(),
    "clone": lambda x: x.clone(),
    "to": lambda x: x.to(x.dtype),
    "padded": lambda x: torch.cat([x.data, torch.zeros_like(x)], dim=1)[:, : x.shape[1]],
}


class Block(nn.Module):
    def __init__(self, channels: int, skip: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(x))) + self.skip(x)


@pytest.mark.parametrize("spelling", SKIPS)
def test_every_spelling_of_the_skip_is_a_residual_add(spelling: str) -> None:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(8, SKIPS[spelling]) for _ in range(4)])
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), blocks, nn.Conv2d(8, 3, 1))
    found = normprobe.discover(model, torch.randn(2, 1, 16, 16))
    assert len(found.residual_adds) == 4
    assert [(s.path, s.depth, s.placement) for s in found.stacks] == [("1", 4, "pre-ln")]
    assert {n.role for n in found.norms} == {"pre"}
