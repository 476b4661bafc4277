"""Time `normprobe.discover` on Pre-LN transformers of growing depth, next to one plain forward.

    python benchmarks/discovery.py

Prints one row per depth; time per block should stay flat (discovery is linear in depth).
"""

from __future__ import annotations

import time

import torch

import normprobe
from normprobe.models import TinyTransformer


def best_of(fn: object, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (2, 32))
    print(f"{'blocks':>6} {'forward ms':>11} {'discover ms':>12} {'ratio':>6} {'ms/block':>9}")
    for depth in (12, 24, 48, 96):
        model = TinyTransformer(width=64, depth=depth)
        with torch.no_grad():
            forward = best_of(lambda model=model: model(tokens))
        discover = best_of(lambda model=model: normprobe.discover(model, tokens))
        print(
            f"{depth:>6} {forward * 1e3:>11.1f} {discover * 1e3:>12.1f} "
            f"{discover / forward:>6.1f} {discover * 1e3 / depth:>9.2f}"
        )


if __name__ == "__main__":
    main()
