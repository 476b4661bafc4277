"""Sanity check [e]: `normprobe.reinit(model, "kaiming")` keeps the second moment through a
ReLU layer; Xavier, made for linear layers, halves it.

    python examples/check_e_kaiming.py [--expect NAME=VALUE ...]

Linear(512, 512) + ReLU on 4096 rows with E[x^2] = 1; measured is the post-ReLU second moment
E[y^2] (the signal energy the next layer receives; not Var(y), which ReLU's non-zero mean makes
about 0.68). `reinit(..., "kaiming")` (defaults: fan_in, nonlinearity="relu") draws
std sqrt(2/fan_in), He et al. 2015's factor 2 for the half ReLU zeroes: E[y^2] = 1.000 expected.
`reinit(..., "xavier")` (Glorot & Bengio 2010; gain 1, the "linear" default) draws
std sqrt(2/(fan_in + fan_out)), which is sqrt(1/fan_in) on this square layer: Xavier's scale
under a ReLU keeps half, E[y^2] = 0.499 expected. Tolerance ± 0.03. The same schemes on
ten such layers show the per-layer factor (E[y^2] ** (1/10)): about 1 and 0.5 (± 0.05).
"""

from __future__ import annotations

import sys

import torch
from _sanity import Checks, Expect
from torch import nn

import normprobe

CHECKS = Checks(
    "e",
    "Kaiming vs Xavier through reinit: post-ReLU second moment",
    {
        "kaiming_std": Expect(2**0.5, tol=0.03),
        "xavier_std": Expect(1.0, tol=0.03),
        "kaiming_ey2": Expect(1.000, tol=0.03),
        "xavier_ey2": Expect(0.499, tol=0.03),
        "kaiming_per_layer": Expect(1.0, tol=0.05),
        "xavier_per_layer": Expect(0.5, tol=0.05),
    },
)


def relu_stack(depth: int, scheme: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(512, 512), nn.ReLU())])
    return normprobe.reinit(model, scheme)  # type: ignore[arg-type]


def main() -> int:
    CHECKS.parse()
    x = torch.randn(4096, 512, generator=torch.Generator().manual_seed(1))
    for scheme in ("kaiming", "xavier"):
        one = relu_stack(1, scheme)
        weight = one[0].weight
        with torch.no_grad():
            ey2 = one(x).pow(2).mean().item()
            deep = relu_stack(10, scheme)(x).pow(2).mean().item()
        std = weight.std().item() * 512**0.5
        CHECKS.check(f"{scheme}_std", f"{scheme}: weight std * sqrt(fan_in)", std)
        CHECKS.check(f"{scheme}_ey2", f"{scheme}: E[y^2] after Linear+ReLU", ey2)
        CHECKS.check(f"{scheme}_per_layer", f"{scheme}: E[y^2]^(1/10), 10 layers", deep**0.1)
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
