"""Sanity check [f]: GPT-2's 1/sqrt(2N) scaling of the layers that write into the residual
stream (Radford et al. 2019; nanoGPT's `c_proj` init) keeps its variance bounded, read through
the probe's `resid_rms` metric.

    python examples/check_f_gpt2_scaling.py [--expect NAME=VALUE ...]

`Writes` below is a stack of N = 50 Pre-LN blocks, each writing into the stream twice (an
"attention" and an "MLP" branch: LayerNorm, then one Linear), 2N = 100 writes in all. With
weights of std 1/sqrt(width) each write is an O(1) update of unit variance, uncorrelated with
the stream (the weights are random), so the variance grows by one per write: x 101 after 100
writes on a unit-variance input. `normprobe.reinit(model, "gpt2", std=1/sqrt(width))` finds
the writing layers by discovery and draws them with std / sqrt(2N): each write then adds 1/100,
and the variance ends at x 2.0.
The unscaled model is the same draw for every layer (`reinit(model, "kaiming",
nonlinearity="linear")`: std 1/sqrt(fan_in)).

Growth of the variance = (resid_rms of the last block / RMS of the input)^2; the probe reads
the input's RMS as `norm_in_rms` of the first block's first LayerNorm. Expected: x 101 and
x 2.0, the counts above, tolerance ± 5% (this script measures x 99.9 and x 1.97).
"""

from __future__ import annotations

import sys
import tempfile

import torch
from _sanity import Checks, Expect
from torch import nn

import normprobe
from normprobe import tags

N_BLOCKS, WIDTH = 50, 256

CHECKS = Checks(
    "f",
    "residual-stream variance over 50 blocks (100 writes): unscaled vs GPT-2 1/sqrt(2N)",
    {
        "unscaled_growth": Expect(101.0, tol=0.05 * 101),
        "gpt2_growth": Expect(2.0, tol=0.05 * 2),
    },
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Writes(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def variance_growth(scheme: str) -> float:
    torch.manual_seed(0)
    model = Writes(N_BLOCKS, WIDTH)
    x = torch.randn(64, WIDTH)
    if scheme == "gpt2":
        normprobe.reinit(model, "gpt2", std=WIDTH**-0.5, example_inputs=(x,))
    else:
        normprobe.reinit(model, "kaiming", nonlinearity="linear")
    metrics = ["resid_rms", "norm_rms"]
    with (
        tempfile.TemporaryDirectory() as log_dir,
        normprobe.attach(model, metrics=metrics, log_dir=log_dir) as probe,
        torch.no_grad(),
    ):
        model(x)
        probe.step()
    assert probe.latest is not None
    s = probe.latest.scalars
    first = s[tags.format("norm_in_rms", "blocks", 0, "ln_1", depth=N_BLOCKS)]
    last = s[tags.format("resid_rms", "blocks", N_BLOCKS - 1, depth=N_BLOCKS)]
    slope = s[tags.format("resid_slope", "blocks")]
    print(f"{scheme}: input RMS {first:.3f}, after block 49 {last:.3f}, resid_slope {slope:.2f}")
    return (last / first) ** 2


def main() -> int:
    CHECKS.parse()
    CHECKS.check("unscaled_growth", "unscaled: variance growth", variance_growth("unscaled"))
    CHECKS.check("gpt2_growth", "gpt2 1/sqrt(2N): variance growth", variance_growth("gpt2"))
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
