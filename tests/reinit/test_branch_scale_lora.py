"""`insert_branch_scale` on a branch whose last layer is a LoRA layer: torchtune's ``LoRALinear``
holds its frozen matrix and runs ``lora_b`` inside its forward, so both are writers of the add.
One scale goes on the outer layer; a second swap landed on the new wrapper as a child that is
never called, leaving dead scale parameters and a duplicate state_dict key."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import normprobe


class LoRALinear(nn.Module):
    """torchtune.modules.peft.LoRALinear: ``x W^T + lora_b(lora_a(x)) * alpha / rank``."""

    def __init__(self, dim: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5, requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.out = LoRALinear(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.down(F.gelu(self.up(self.norm(x)))))


def test_one_scale_per_lora_branch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(3)], nn.LayerNorm(16))
    x = torch.randn(4, 16)
    want = model(x).detach()
    keys = set(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        normprobe.insert_branch_scale(model, "layerscale", init=1.0, example_inputs=(x,))
    torch.testing.assert_close(model(x), want)  # scales of 1 change nothing
    scales = {n: p for n, p in model.named_parameters() if n.endswith("scale")}
    assert len(scales) == 3, sorted(scales)  # one per block's add
    model(x).pow(2).sum().backward()
    dead = [n for n, p in scales.items() if p.grad is None]
    assert dead == []
    new = set(model.state_dict()) - keys
    assert all("lora_b.inner" not in k for k in new), sorted(new)
    normprobe.remove_branch_scale(model, fold=False)
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(model(x), want)
