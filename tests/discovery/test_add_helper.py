"""A residual add made by a helper module handed both operands, as EDM2's magnitude-preserving
``MPAdd(x, res)`` in denoising-diffusion-pytorch's KarrasUnet: with a projection on the skip it
is a projection add, its shortcut layer no unattached writer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normprobe


class MPAdd(nn.Module):
    """(x (1 - t) + res t) / sqrt((1 - t)^2 + t^2)."""

    def __init__(self, t: float = 0.3) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        return (x * (1 - self.t) + res * self.t) / math.sqrt((1 - self.t) ** 2 + self.t**2)


class Decoder(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.block1 = nn.Conv2d(dim_in, dim_out, 3, padding=1)
        self.block2 = nn.Conv2d(dim_out, dim_out, 3, padding=1)
        self.res_conv = nn.Conv2d(dim_in, dim_out, 1) if dim_in != dim_out else nn.Identity()
        self.res_mp_add = MPAdd()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = self.res_conv(x)
        return self.res_mp_add(self.block2(torch.relu(self.block1(torch.relu(x)))), res)


@pytest.mark.parametrize("dims", [(16, 16), (32, 16)], ids=["identity", "projection"])
def test_an_add_in_a_helper_module(dims: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Decoder(*dims), Decoder(dims[1], dims[1]))
    found = normprobe.discover(model, torch.randn(2, dims[0], 8, 8))
    first = found.residual_adds[0]
    assert len(found.residual_adds) == 2
    assert first.kind == ("projection" if dims[0] != dims[1] else "identity")
    assert first.writers == ("0.block2",)
    assert found.doubts == []
