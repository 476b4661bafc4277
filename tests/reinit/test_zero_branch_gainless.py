"""``zero_branch`` on branches that end in a norm: its gain set to 0 where it has one; refused,
with nothing changed, where it has none (MONAI's default affine-free InstanceNorm)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe


class Block(nn.Module):
    """MONAI's ResidualUnit shape: conv, norm, activation, conv, norm, then the skip."""

    def __init__(self, channels: int, affine: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.InstanceNorm2d(channels, affine=affine)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.InstanceNorm2d(channels, affine=affine)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.branch(x))


def _net(affine: bool) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(8, affine) for _ in range(3)])
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), blocks, nn.Conv2d(8, 2, 1))


X = torch.randn(2, 1, 16, 16)


def _branches_write_nothing(model: nn.Sequential) -> bool:
    h = model[0](X)
    with torch.no_grad():
        for block in model[1]:
            if float(block.branch(h).abs().max()) != 0.0:
                return False
            h = block(h)
    return True


def test_a_branch_ending_in_a_norm_with_a_gain_is_zeroed() -> None:
    model = normprobe.reinit(_net(affine=True), "zero_branch", example_inputs=(X,))
    assert _branches_write_nothing(model)


def test_a_branch_ending_in_a_norm_without_a_gain_is_refused() -> None:
    model = _net(affine=False)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"1\.0\.norm2 \(InstanceNorm2d\) cannot be set to 0"):
        normprobe.reinit(model, "zero_branch", example_inputs=(X,))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_branch_scale_goes_after_a_norm_without_a_gain() -> None:
    # ReZero where zero_branch cannot: the scale, 0, multiplies the affine-free norm's output
    model = normprobe.insert_branch_scale(_net(affine=False), "rezero", example_inputs=(X,))
    assert _branches_write_nothing(model)
    assert len(normprobe.branch_scales(model)) == 3
