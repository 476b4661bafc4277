"""Discovery runs the model and leaves no trace of it: a forward that replaces a parameter's
memory (compressai's MaskedConv2d: ``self.weight.data = self.weight.data * self.mask``) gets its
weights back, and the random generators the model holds (torchtune's layer dropout draws from
its own) their states. Before, the first changed the state_dict and the second made a run with
the probe attached train differently from one without."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import normprobe


class MaskedConv2d(nn.Conv2d):
    """compressai.layers.MaskedConv2d (type A): the kernel's centre and what follows zeroed."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1)
        mask = torch.ones_like(self.weight)
        mask[:, :, 1, 1:] = 0
        mask[:, :, 2:] = 0
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = self.weight.data * self.mask
        return super().forward(x)


class DropBlock(nn.Module):
    """A residual block skipped at random with its own generator (torchtune's LayerDropout)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand((), generator=self.generator) > 0.5
        return x + self.conv(F.relu(x)) * keep


def test_a_replaced_parameter_memory_comes_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MaskedConv2d(4), DropBlock(4), DropBlock(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory = model[0].weight.data_ptr()
    normprobe.discover(model, torch.randn(2, 4, 8, 8))
    assert model[0].weight.data_ptr() == memory
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_models_own_generators_come_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 1), DropBlock(4), DropBlock(4))
    states = [block.generator.get_state() for block in model[1:]]
    normprobe.discover(model, torch.randn(2, 4, 8, 8))
    for block, state in zip(model[1:], states, strict=True):
        assert torch.equal(block.generator.get_state(), state)
