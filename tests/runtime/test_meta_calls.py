"""A model that calls one of its layers on a meta tensor to learn an output shape (compressai's
checkerboard latent codec): the probe skips that call's reads; moving its statistics to the
host raised "Cannot copy out of meta tensor" at the first logged step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normprobe


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class Net(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(3)])
        self.out = nn.Conv2d(2 * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.blocks(x.to("meta")).shape  # the blocks' output shape, without the work
        return self.out(torch.cat([self.blocks(x), x.new_zeros(shape)], dim=1))


def test_meta_call_skipped_real_call_read() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 4, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen: dict[str, float] = {}
    model.blocks[2].register_forward_hook(
        lambda m, i, o: (
            seen.update(rms=float(o.detach().pow(2).mean().sqrt())) if not o.is_meta else None
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, every=1, sinks=[normprobe.MemorySink()]) as probe:
            for _ in range(2):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                assert probe.latest is not None
                got = probe.latest.scalars["normprobe/resid_rms/blocks/2"]
                assert got == pytest.approx(seen["rms"], rel=1e-5)
