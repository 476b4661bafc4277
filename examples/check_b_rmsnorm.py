"""Sanity check [b]: `normprobe.convert_norms` turns a LayerNorm into an RMSNorm, and only
LayerNorm re-centers.

    python examples/check_b_rmsnorm.py [--expect NAME=VALUE ...]

A LayerNorm (d = 64, gain 1, bias 0) is converted to `nn.RMSNorm` by `convert_norms`, which keeps
its gain and eps. On rows with zero mean the two compute the same thing: the mean square is
the variance. Then every entry of a row is shifted by a constant c: LayerNorm subtracts the mean
and barely moves, RMSNorm only divides by the root mean square and changes (Zhang & Sennrich
2019, "Root Mean Square Layer Normalization", drop the re-centering on purpose). On
`torch.manual_seed(0)`'s `randn(8, 64)` and c = 5 this script measures LayerNorm |Δ| = 9.54e-07,
RMSNorm |Δ| = 3.05.
"""

from __future__ import annotations

import copy
import sys

import torch
from _sanity import Checks, Expect
from torch import nn

import normprobe

CHECKS = Checks(
    "b",
    "LayerNorm -> RMSNorm with convert_norms: same on zero-mean rows, only LN is shift-invariant",
    {
        "converted_kind": Expect("rmsnorm", op="=="),
        "zero_mean_diff": Expect(1e-5, op="<"),
        "ln_shift_change": Expect(1e-5, op="<"),
        "rms_shift_change": Expect(3.05, tol=0.005),
    },
)


def main() -> int:
    CHECKS.parse()
    shift = 5.0
    d = 64
    torch.manual_seed(0)
    x = torch.randn(8, d)
    layer_norm = nn.Sequential(nn.LayerNorm(d))
    rms_norm, report = normprobe.convert_norms_with_report(copy.deepcopy(layer_norm), "rmsnorm")
    print(report)
    (converted,) = normprobe.discover(rms_norm).norms
    CHECKS.check("converted_kind", "kind discovered after conversion", converted.kind)

    zero_mean = x - x.mean(dim=-1, keepdim=True)
    with torch.no_grad():
        same = (layer_norm(zero_mean) - rms_norm(zero_mean)).abs().max().item()
        ln_change = (layer_norm(x + shift) - layer_norm(x)).abs().max().item()
        rms_change = (rms_norm(x + shift) - rms_norm(x)).abs().max().item()
    CHECKS.check("zero_mean_diff", "max|LN - RMS|, zero-mean rows", same)
    CHECKS.check("ln_shift_change", f"max|LN(x+{shift:g}) - LN(x)|", ln_change)
    CHECKS.check("rms_shift_change", f"max|RMS(x+{shift:g}) - RMS(x)|", rms_change)
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
