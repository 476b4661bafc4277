"""Discovery, attach and one logged step on Pre-LN stacks of 125 to 1000 blocks (DeepNet scale).

    python benchmarks/scale.py [--model stack|transformer] [--depths 125 250 500 1000]

Prints one row per depth with the time (best of ``--repeat``) and peak memory of each phase and
the same per block, so that linear growth shows as flat per-block columns; then the size of
what one logged step writes (scalar tags, depth histograms, event file bytes).

* time: best of N, torch on one thread (``--threads``): on a shared CPU, several torch threads
  spin against other processes and times jump tenfold.
* memory, two columns, each measured in its own run (never timed):
  ``tensor``: peak bytes of tensor storage created while the phase runs, seen at the
  dispatcher (tests/helpers/memory.py: every storage an op returns, released when its last tensor
  dies): activations, statistics, copies. ``py``: peak of Python's own heap (tracemalloc):
  the map, hooks, slots, records, protobufs. Parameters that exist before the phase are in
  neither.
* attach includes discovery (``example_inputs=``); a logged step is forward, backward and the
  optimizer step with every metric, writing the event file; ``bare`` is the same step without
  a probe.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import normprobe
from normprobe.models import ResidualStack, TinyTransformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))
from memory import peak_bytes  # the dispatcher-level counter the tests use
from tb import read_events

Build = Callable[[int], tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


def build_stack(
    depth: int,
) -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model = ResidualStack(depth, 64)
    return model, torch.randn(8, 64), lambda out: out.pow(2).mean()


def build_transformer(
    depth: int,
) -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model = TinyTransformer(width=32, depth=depth, heads=2, context=16)
    tokens = torch.randint(0, 96, (2, 16))
    return model, tokens, lambda out: out.float().logsumexp(-1).mean()


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def py_peak(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(build: Build, depth: int, repeat: int, logs: str) -> dict[str, float]:
    torch.manual_seed(0)
    model, x, loss = build(depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    row: dict[str, float] = {}

    def step() -> None:
        loss(model(x)).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: first-call costs of the kernels
    row["bare"] = best_of(step, repeat)
    row["bare tensor"] = peak_bytes(step)

    row["discover"] = best_of(lambda: normprobe.discover(model, x), repeat)
    row["discover tensor"] = peak_bytes(lambda: normprobe.discover(model, x))
    row["discover py"] = py_peak(lambda: normprobe.discover(model, x))

    def attach(where: str) -> normprobe.Probe:
        return normprobe.attach(model, opt, log_dir=where, every=2, example_inputs=(x,))

    times = []
    for i in range(repeat):
        gc.collect()
        start = time.perf_counter()
        probe = attach(os.path.join(logs, f"t{i}"))
        times.append(time.perf_counter() - start)
        probe.remove()
    row["attach"] = min(times)
    holder: list[normprobe.Probe] = []
    row["attach tensor"] = peak_bytes(lambda: holder.append(attach(os.path.join(logs, "m1"))))
    holder.pop().remove()
    row["attach py"] = py_peak(lambda: holder.append(attach(os.path.join(logs, "m2"))))
    holder.pop().remove()

    # one logged step: every=2 logs steps 0, 2, 4...; time the logged ones of a longer run
    with attach(os.path.join(logs, "step")) as probe:
        logged = []
        for i in range(2 * repeat):
            gc.collect()
            start = time.perf_counter()
            step()
            if i % 2 == 0:
                logged.append(time.perf_counter() - start)
        row["step"] = min(logged)
        assert probe.step_count % 2 == 0  # the next step is logged
        row["step tensor"] = peak_bytes(step)
        step()
        row["step py"] = py_peak(step)

    # what one logged step writes
    one = os.path.join(logs, "one")
    with attach(one):
        step()
    events = read_events(one)
    row["tags"] = len(events.scalars)
    row["histograms"] = len(events.histograms)
    row["bytes"] = sum(f.stat().st_size for f in Path(one).iterdir())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["stack", "transformer"], default="stack")
    parser.add_argument("--depths", type=int, nargs="+", default=[125, 250, 500, 1000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build: Build = build_stack if args.model == "stack" else build_transformer
    what = "ResidualStack(depth, 64)" if args.model == "stack" else "TinyTransformer width 32"
    print(f"{what}, {args.threads} torch thread(s), best of {args.repeat}; MB = 2**20 bytes")
    header = (
        f"{'blocks':>6} | {'discover':>8} {'/blk':>6} {'tensor':>7} {'py':>6} "
        f"| {'attach':>8} {'/blk':>6} {'tensor':>7} {'py':>6} "
        f"| {'step':>7} {'/blk':>6} {'bare':>6} {'tensor':>7} {'bare':>6} {'py':>6} "
        f"| {'tags':>5} {'hists':>5} {'file KB':>7}"
    )
    print(header)
    print(f"{'':>6} | {'ms':>8} {'ms':>6} {'MB':>7} {'MB':>6} | {'ms':>8} {'ms':>6} {'MB':>7} "
          f"{'MB':>6} | {'ms':>7} {'ms':>6} {'ms':>6} {'MB':>7} {'MB':>6} {'MB':>6} |")  # fmt: skip
    mb = 2.0**20
    for depth in args.depths:
        with tempfile.TemporaryDirectory(prefix="normprobe-scale-") as logs:
            r = measure(build, depth, args.repeat, logs)
        print(
            f"{depth:>6} | {r['discover'] * 1e3:>8.0f} {r['discover'] * 1e3 / depth:>6.2f} "
            f"{r['discover tensor'] / mb:>7.2f} {r['discover py'] / mb:>6.1f} "
            f"| {r['attach'] * 1e3:>8.0f} {r['attach'] * 1e3 / depth:>6.2f} "
            f"{r['attach tensor'] / mb:>7.2f} {r['attach py'] / mb:>6.1f} "
            f"| {r['step'] * 1e3:>7.1f} {r['step'] * 1e3 / depth:>6.3f} {r['bare'] * 1e3:>6.1f} "
            f"{r['step tensor'] / mb:>7.2f} {r['bare tensor'] / mb:>6.2f} "
            f"{r['step py'] / mb:>6.1f} "
            f"| {r['tags']:>5.0f} {r['histograms']:>5.0f} {r['bytes'] / 1024:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
