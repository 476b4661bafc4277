"""A weight op that adds an activation to its product (``addmm(h, h, W)``, PyG's GCN2Conv)
holds a skip and a branch in one output: a doubt that makes ``reinit`` refuse rather than treat
the layer as a branch's last. ``addmm`` adding a bias (GPT-2's Conv1D) is a plain layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normprobe


class GCN2Layer(nn.Module):
    """GCNII's layer without the graph: h = (1 - a) h + a x0, then (1 - b) h + b h W."""

    def __init__(self, width: int, beta: float = 0.3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.beta = beta

    def forward(self, h: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        h = 0.9 * h + 0.1 * x0
        return torch.addmm(h, h, self.weight, beta=1 - self.beta, alpha=self.beta)


class GCNII(nn.Module):
    def __init__(self, width: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.lin_in = nn.Linear(8, width)
        self.convs = nn.ModuleList(GCN2Layer(width) for _ in range(layers))
        self.lin_out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = h = torch.relu(self.lin_in(x))
        for conv in self.convs:
            h = torch.relu(conv(h, x0))
        return self.lin_out(h)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: addmm(bias, x, W)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.02)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def test_a_skip_fused_into_addmm_is_a_doubt_reinit_refuses() -> None:
    torch.manual_seed(0)
    model, x = GCNII(), torch.randn(10, 8)
    found = normprobe.discover(model, x)
    assert [(d.kind, d.path) for d in found.doubts if d.kind == "fused-skip"] == [
        ("fused-skip", f"convs.{i}") for i in range(3)
    ]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"fused-skip at convs\.0"):
        normprobe.reinit(model, "gpt2", example_inputs=(x,))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_addmm_adding_a_bias_is_a_plain_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Conv1D(16) for _ in range(3)])
    found = normprobe.discover(model, torch.randn(4, 16))
    assert not [d for d in found.doubts if d.kind == "fused-skip"]
    assert set(found.weight_layers) == {"0", "1", "2"}
