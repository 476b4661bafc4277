"""A DiT in a few lines (Peebles & Xie 2023): adaLN-Zero blocks, each branch's write multiplied
by a gate computed from the class embedding, the modulation layer zero at init."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdaLNZeroBlock(nn.Module):
    """A DiT block: a norm modulated by the condition, each branch's write multiplied by a gate
    from the condition; the modulation layer starts at zero."""

    def __init__(self, width: int, zero: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mix = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.modulation = nn.Linear(width, 6 * width)
        if zero:
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        mods = self.modulation(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        x = x + gate1 * self.mix(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class TinyDiT(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4, zero: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.cond = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(AdaLNZeroBlock(width, zero) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        h, c = self.embed(x), self.cond(label)
        for block in self.blocks:
            h = block(h, c)
        return self.head(self.norm(h))
