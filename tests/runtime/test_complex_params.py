"""Complex-valued parameters (FEDformer's Fourier weights, `torch.cfloat`): the probe, the spike
detector and `diagnose` read them as the sums |re|^2 + |im|^2; asking for a float32 norm of a
complex tensor made the first backward with the probe attached raise."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import normprobe


class Spectral(nn.Module):
    """A learned complex map applied in the frequency domain, as FEDformer's FourierBlock."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width, width, dtype=torch.cfloat) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x, dim=1)
        return torch.fft.irfft(spectrum @ self.weight, n=x.shape[1], dim=1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.spectral = Spectral(width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.spectral(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_grad_norm_of_a_block_with_complex_weights() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, every=1, sinks=[normprobe.MemorySink()]) as probe:
            for _ in range(2):
                model(x).pow(2).mean().backward()
                want = [
                    math.sqrt(sum(float(p.grad.abs().pow(2).sum()) for p in b.parameters()))
                    for b in model.blocks
                ]
                opt.step()
                opt.zero_grad()
                assert probe.latest is not None
                got = [probe.latest.scalars[f"normprobe/grad_norm/blocks/{i}"] for i in range(3)]
                assert got == pytest.approx(want, rel=1e-4)


def test_diagnose_runs_on_complex_weights() -> None:
    torch.manual_seed(0)
    found = normprobe.diagnose(Net(), (torch.randn(4, 16, 8),))
    assert "no-final-norm" in {f.code for f in found.findings}
