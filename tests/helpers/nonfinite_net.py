"""A residual stack whose block 2 makes a NaN gradient in backward from a finite one."""

from __future__ import annotations

import torch
from torch import nn


class SqrtAbs(nn.Module):
    """sqrt(|x| + eps): finite forward; with eps 0 its gradient is NaN where x is exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() + self.eps).sqrt()


class Block(nn.Module):
    def __init__(self, width: int, act: nn.Module) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = act
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(self.act(self.fc1(self.ln(h))))


class Net(nn.Module):
    """A Pre-LN residual stack; block 2's branch goes through `SqrtAbs` of a feature that is
    exactly 0 (fc1's first row and bias zeroed), the other blocks' through tanh."""

    def __init__(self, depth: int = 5, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            Block(width, SqrtAbs() if b == 2 else nn.Tanh()) for b in range(depth)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)
        with torch.no_grad():
            self.blocks[2].fc1.weight[0].zero_()
            self.blocks[2].fc1.bias[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    @property
    def sqrt(self) -> SqrtAbs:
        act = self.blocks[2].act
        assert isinstance(act, SqrtAbs)
        return act


def loss(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


class SqrtLinear(nn.Linear):
    """sqrt(|linear(x)| + eps): a weight layer whose gradient is NaN where its output is 0."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__(width_in, width_out)
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x).abs() + self.eps).sqrt()


class ListNet(nn.Module):
    """Pre-LN blocks ``h + fc2(tanh(fc1(ln(h))))`` whose modules lie in four lists zipped by
    the forward (each list a stack of its own); block 2's fc1 is a `SqrtLinear` with its first
    feature exactly 0."""

    def __init__(self, depth: int = 5, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.lns = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.fc1s = nn.ModuleList(
            SqrtLinear(width, 2 * width) if b == 2 else nn.Linear(width, 2 * width)
            for b in range(depth)
        )
        self.acts = nn.ModuleList(nn.Tanh() for _ in range(depth))
        self.fc2s = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)
        with torch.no_grad():
            self.fc1s[2].weight[0].zero_()
            self.fc1s[2].bias[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for ln, fc1, act, fc2 in zip(self.lns, self.fc1s, self.acts, self.fc2s, strict=True):
            h = h + fc2(act(fc1(ln(h))))
        return self.head(self.ln_f(h))

    @property
    def sqrt(self) -> SqrtLinear:
        fc1 = self.fc1s[2]
        assert isinstance(fc1, SqrtLinear)
        return fc1
