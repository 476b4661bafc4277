"""``norm_gain`` reads a norm's gain whatever its parameter is called: torchtune's RMSNorm keeps
it in ``scale`` (Gemma's as ``1 + scale``); the family read only ``weight`` and logged nothing
for them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normprobe


class ScaleRMSNorm(nn.Module):
    """torchtune.modules.RMSNorm: ``x / rms(x) * scale`` (``offset=1``: Gemma's ``1 + scale``)."""

    def __init__(self, dim: int, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset
        self.scale = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed.type_as(x) * (self.offset + self.scale)


class Block(nn.Module):
    def __init__(self, dim: int, offset: float) -> None:
        super().__init__()
        self.norm = ScaleRMSNorm(dim, offset)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gain_named_scale(offset: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16, offset) for _ in range(3)], ScaleRMSNorm(16, offset))
    with torch.no_grad():
        for i, block in enumerate(model[:3]):
            block.norm.scale.copy_(torch.linspace(0.5, 1.5, 16) * (i + 1) - offset)
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(
            model, every=1, sinks=[normprobe.MemorySink()], metrics=["norm_gain"]
        ) as probe:
            model(x)
            probe.step()
    assert probe.latest is not None
    s = probe.latest.scalars
    for i in range(3):
        gain = torch.linspace(0.5, 1.5, 16) * (i + 1)  # the effective gain, offset included
        assert s[f"normprobe/norm_gain_mean/[0..2]/{i}.norm"] == pytest.approx(float(gain.mean()))
        assert s[f"normprobe/norm_gain_std/[0..2]/{i}.norm"] == pytest.approx(
            float(gain.std(unbiased=False)), rel=1e-4
        )
