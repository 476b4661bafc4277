"""Sanity check [a]: a LayerNorm written from scratch is nn.LayerNorm, and discovery sees it.

    python examples/check_a_layernorm.py [--expect NAME=VALUE ...]

`ScratchLN` below is a user's own class: population variance (divide by d) and eps inside
the square root. Its name does not end in "Norm", so `normprobe.discover` can only recognize it by
behaviour (scale invariance, re-centering, which elements share statistics, where eps sits) and
must report a LayerNorm with eps inside the root. A variant with eps outside the root must be
told apart. Its output must equal nn.LayerNorm's on the same rows up to float32 rounding (this
script measures max|Δ| = 2.38e-07; tolerance 1e-5).
"""

from __future__ import annotations

import sys
import warnings

import torch
from _sanity import Checks, Expect
from torch import nn

import normprobe


class ScratchLN(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, var divided by d."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, unbiased=False, keepdim=True)
        return centered / torch.sqrt(var + self.eps) * self.weight + self.bias


class EpsOutsideLN(ScratchLN):
    """The common slip: (x - mean) / (std + eps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=-1, keepdim=True)
        std = x.var(dim=-1, unbiased=False, keepdim=True).sqrt()
        return centered / (std + self.eps) * self.weight + self.bias


class Net(nn.Module):
    def __init__(self, norm: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


CHECKS = Checks(
    "a",
    "LayerNorm from scratch == nn.LayerNorm; discovery recognizes it by behaviour",
    {
        "kind": Expect("layernorm", op="=="),
        "eps_placement": Expect("inside-sqrt", op="=="),
        "recognized_by": Expect("behaviour", op="=="),
        "slip_eps_placement": Expect("outside-sqrt", op="=="),
        "max_abs_diff": Expect(1e-5, op="<"),
    },
)


def main() -> int:
    CHECKS.parse()
    d = 64
    torch.manual_seed(0)
    x = torch.randn(8, d)
    with warnings.catch_warnings():  # a lone norm has no residual adds: discovery says so
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        found = normprobe.discover(Net(ScratchLN(d), d), x).norms
        slip = normprobe.discover(Net(EpsOutsideLN(d), d), x).norms
    (norm,) = found
    print(
        f"discovered: {norm.class_name} at {norm.path!r}, {norm.kind}, eps {norm.eps} "
        f"{norm.eps_placement}, recognized by {norm.recognized_by}"
    )
    CHECKS.check("kind", "discovered kind", norm.kind)
    CHECKS.check("eps_placement", "discovered eps placement", norm.eps_placement)
    CHECKS.check("recognized_by", "recognized by", norm.recognized_by.split(" ")[0])
    CHECKS.check("slip_eps_placement", "eps placement of (x-m)/(std+eps)", slip[0].eps_placement)

    with torch.no_grad():
        diff = (ScratchLN(d)(x) - nn.LayerNorm(d)(x)).abs().max().item()
    CHECKS.check("max_abs_diff", "max|scratch - nn.LayerNorm|", diff)
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
