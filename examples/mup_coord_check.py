"""A muP coordinate check: activation size against width, standard parametrization vs muP.

    python examples/mup_coord_check.py [--steps 3] [--widths 64 128 256 512 1024] [--png]

An MLP (inp -> h1 -> h2 -> out, ReLU between) trains for a few Adam steps at each width on the
same batch; `normprobe.mup.coord_check` records the RMS of every layer's output and fits
the slope of log RMS against log width. Under the standard parametrization (one learning rate)
hidden activations grow with width once training starts (slope > 0); under muP
(`normprobe.mup(model, base_width=64)`, trained with `mup_param_groups`) they stay put (slope
near 0). `--png` also writes coord_check_sp.png and coord_check_mup.png here.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe.mup import coord_check


class MLP(nn.Module):
    def __init__(self, width: int, d_in: int = 32, n_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.h1 = nn.Linear(width, width)
        self.h2 = nn.Linear(width, width)
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.h2(F.relu(self.h1(F.relu(self.inp(x)))))))


def mup_mlp(width: int) -> nn.Module:
    return normprobe.mup(MLP(width), base_width=64, zero_readout=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--png", action="store_true", help="also write the plots as PNG")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    tables = {}
    for name, make in (("sp", MLP), ("mup", mup_mlp)):
        png = f"coord_check_{name}.png" if args.png else None
        table = coord_check(make, args.widths, x, y, steps=args.steps, lr=args.lr, plot=png)
        print(table, "\n")
        tables[name] = table

    layers = ["inp", "h1", "h2", "out"]
    print(f"slope of log RMS against log width after {args.steps} steps (0 = width-independent)")
    print(f"{'':<5}" + "".join(f"{m:>8}" for m in layers))
    for table in tables.values():
        print(f"{table.parametrization:<5}" + "".join(f"{table.slope(m):>+8.2f}" for m in layers))
    if args.png:
        print("\nwrote coord_check_sp.png and coord_check_mup.png")


if __name__ == "__main__":
    main()
