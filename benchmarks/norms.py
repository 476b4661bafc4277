"""Time forward+backward of the norm layers `convert_norms` swaps between, at transformer sizes.

    python benchmarks/norms.py [--tokens 4096] [--widths 768 1024 2048] [--device cpu]
                               [--dtype float32] [--rounds 20] [--threads 1] [--compile]

Times ``nn.LayerNorm``, ``nn.RMSNorm`` (torch's fused kernel, what ``"rmsnorm"`` builds),
``DyT`` and, when transformers is installed, ``LlamaRMSNorm`` (the Python RMSNorm Hugging Face
models ship, what ``"rmsnorm"`` replaces) on a ``(tokens, width)`` input. The layers run
interleaved, one call each per round in a rotating order, in one process, so a change in the
machine's speed hits all of them alike. ``--compile`` adds each layer under ``torch.compile``
(compiled before timing) to the same rounds. The table gives each layer's median time and its
ratio to eager ``nn.LayerNorm`` (below 1 is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from normprobe.layers import DyT


def layers(width: int) -> dict[str, Callable[[], nn.Module]]:
    found: dict[str, Callable[[], nn.Module]] = {
        "LayerNorm": lambda: nn.LayerNorm(width),
        "RMSNorm": lambda: nn.RMSNorm(width, eps=1e-6),
        "DyT": lambda: DyT(width),
    }
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return found
    found["LlamaRMSNorm"] = lambda: LlamaRMSNorm(width)
    return found


def step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    """One forward+backward; seconds."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    layer(x).backward(grad)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--widths", type=int, nargs="+", default=[768, 1024, 2048])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    parser.add_argument(
        "--compile", action="store_true", help="also time each layer under torch.compile"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    where = (
        f"{args.device} ({torch.get_num_threads()} threads)"
        if args.device == "cpu"
        else (torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    )
    print(
        f"forward+backward of one layer on ({args.tokens}, width) {args.dtype}, {where}, "
        f"torch {torch.__version__}; median of {args.rounds} interleaved rounds, ratio to LayerNorm"
    )
    names = list(layers(args.widths[0]))
    if args.compile:
        names += [f"{n} compiled" for n in names]
    print(f"{'width':>6}" + "".join(f"{n:>22}" for n in names))
    for width in args.widths:
        built = {n: make().to(args.device, dtype) for n, make in layers(width).items()}
        if args.compile:
            # one shape per layer: no dynamic-shape kernels after the first width
            built |= {
                f"{n} compiled": cast(nn.Module, torch.compile(m, dynamic=False))
                for n, m in built.items()
            }
        x = torch.randn(args.tokens, width, device=args.device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        for layer in built.values():  # warm-up: kernels loaded, allocator primed
            for _ in range(3):
                step(layer, x, grad)
        times: dict[str, list[float]] = {n: [] for n in built}
        order = list(built)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                times[name].append(step(built[name], x, grad))
        median = {n: statistics.median(t) for n, t in times.items()}
        base = median["LayerNorm"]
        cells = [f"{median[n] * 1e3:9.3f} ms ({median[n] / base:4.2f}x)" for n in names]
        print(f"{width:>6}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
