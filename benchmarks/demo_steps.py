"""Time a training step of each `make demo` model at 1 and 2 torch threads, alone or beside
busy processes.

    python benchmarks/demo_steps.py [--rounds 30] [--threads 1 2] [--busy 0 1]

Each demo model (Pre-LN, Post-LN, DeepNorm, Pre-LN converted to ``nn.RMSNorm``) trains on the
demo's batches with a probe attached as the demo has one (every 15th step logged, to memory).
The models step interleaved, one step each per round in one process, so a change in the
machine's load hits all of them alike. ``--busy N`` starts N processes that keep a core busy
while timing, as any other program on the machine does. The table gives each model's median
milliseconds per step and its ratio to Pre-LN: a model far from 1 (one norm layer's slow CPU
path), or two threads far slower than one beside a busy process (threads waiting for a core
at every operation), is what to look for.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch
from torch import nn

import normprobe
from normprobe import demo
from normprobe.corpus import CharBatches, CharCorpus


def _spin() -> None:
    while True:
        pass


def _time(threads: int, busy: int, rounds: int) -> dict[str, float]:
    """Median seconds per step of each demo model."""
    corpus = CharCorpus(context=demo.CONTEXT, seed=0)
    batches = iter(CharBatches(corpus, demo.BATCH))
    runs = {}
    for name, make in demo.RUNS.items():
        torch.manual_seed(0)
        model = make(corpus.vocab_size)
        opt = torch.optim.AdamW(model.parameters(), lr=demo.LR)
        sink = normprobe.MemorySink()
        runs[name] = (model, opt, normprobe.attach(model, opt, sinks=[sink], every=15))
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for _ in range(rounds):
            inputs, targets = next(batches)
            for name, (model, opt, _) in runs.items():
                start = time.perf_counter()
                logits = model(inputs)
                nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                opt.step()
                opt.zero_grad()
                times[name].append(time.perf_counter() - start)
    finally:
        for p in spinners:
            p.terminate()
            p.join()
        for _, _, probe in runs.values():
            probe.remove()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    print(f"{'threads':>7} {'busy':>4}  " + "  ".join(f"{n:>22}" for n in demo.RUNS))
    for busy in args.busy:
        for threads in args.threads:
            median = _time(threads, busy, args.rounds)
            base = median["pre-ln"]
            cells = [f"{1000 * t:>8.1f} ms ({t / base:4.2f}x)" for t in median.values()]
            print(f"{threads:>7} {busy:>4}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
