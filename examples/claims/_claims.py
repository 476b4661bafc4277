"""Shared by the claim scripts: the command line, seeds, training on the built-in corpus, the
table, the plot and the verdict.

Each script states one claim, measures it through normprobe over several seeds, prints a table
(mean ± spread: the sample standard deviation over seeds), draws a plot with `normprobe.plots`
and ends with a verdict: ``reproduced``, ``not reproduced at this scale`` or ``contradicted``,
with the reason. It also writes ``<out>/<claim>.json`` (the claim, the table, the verdict) and
``<out>/<claim>.png``. ``--quick`` shrinks every setting so that the script runs in seconds:
its numbers then say nothing, only that the script works.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

import normprobe
from normprobe import plots
from normprobe.corpus import CharCorpus
from normprobe.models import TinyTransformer

Verdict = Literal["reproduced", "not reproduced at this scale", "contradicted"]
VERDICTS: tuple[Verdict, ...] = ("reproduced", "not reproduced at this scale", "contradicted")


@dataclass(frozen=True)
class Claim:
    """What is claimed, by whom, and the setting it is measured in here."""

    key: str  # the script's name and its output files' stem
    statement: str
    source: str
    setting: str


@dataclass(frozen=True)
class Size:
    """The model and training sizes of a claim run on one TinyTransformer depth."""

    width: int
    depth: int
    heads: int
    context: int
    batch: int
    steps: int


def options(claim: Claim, seeds: int = 3) -> argparse.ArgumentParser:
    """The command line every claim script shares; a script adds its own options."""
    parser = argparse.ArgumentParser(description=f"{claim.statement} ({claim.source})")
    parser.add_argument("--quick", action="store_true", help="tiny settings: runs in seconds")
    parser.add_argument("--seeds", type=int, default=seeds, help=f"seeds (default {seeds})")
    parser.add_argument(
        "--out", type=Path, default=Path("claims_out"), help="folder for the plot and the JSON"
    )
    return parser


def torch_threads() -> None:
    """Two threads: the figures in the README are measured on two CPU cores."""
    torch.set_num_threads(min(2, torch.get_num_threads()))


# --- numbers ------------------------------------------------------------------------------------
def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value) of the finite values; NaN mean when
    none is finite."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def fmt(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± spread``, with the count of non-finite seeds when there are any."""
    mean, spread = mean_spread(values)
    bad = sum(not math.isfinite(v) for v in values)
    text = "diverged" if math.isnan(mean) else f"{mean:.{digits}g} ± {spread:.2g}"
    return text + (f" ({bad}/{len(values)} diverged)" if bad and not math.isnan(mean) else "")


def apart(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two settings' means differ by more than both spreads together (a difference
    the seeds do not explain)."""
    (ma, sa), (mb, sb) = mean_spread(a), mean_spread(b)
    return math.isfinite(ma) and math.isfinite(mb) and abs(ma - mb) > sa + sb


# --- training -----------------------------------------------------------------------------------
@dataclass
class Trained:
    """One training run: the loss of every step, and what the probe logged."""

    losses: list[float]
    sink: normprobe.MemorySink | None = None
    seconds_per_step: float = math.nan

    def final_loss(self, last: int = 10) -> float:
        """Mean loss of the last ``last`` steps (NaN when the run diverged)."""
        tail = self.losses[-last:]
        return statistics.fmean(tail) if tail and all(map(math.isfinite, tail)) else math.nan

    def series(self, tag: str) -> list[tuple[int, float]]:
        return self.sink.series(tag) if self.sink is not None else []


def train_char_lm(
    model: nn.Module,
    *,
    steps: int,
    lr: float,
    seed: int,
    batch: int = 16,
    context: int = 32,
    warmup: int = 0,
    probe_every: int | None = None,
    metrics: Sequence[str] | None = None,
    optimizer: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None,
) -> Trained:
    """Train ``model`` (ids -> logits) on the built-in corpus with AdamW (or ``optimizer``),
    a linear warmup over ``warmup`` steps, and a probe logging to memory every
    ``probe_every`` steps (None: no probe). The data order follows ``seed``."""
    corpus = CharCorpus(context=context, seed=seed)
    opt = (optimizer or _adamw)(model, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    sink = normprobe.MemorySink() if probe_every else None
    probe = (
        normprobe.attach(model, opt, sinks=[sink], every=probe_every, metrics=metrics)
        if sink is not None
        else None
    )
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    try:
        for _ in range(steps):
            inputs, targets = corpus.batch(batch)
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(loss.detach())
    finally:
        if probe is not None:
            probe.remove()
    elapsed = time.perf_counter() - start
    return Trained(torch.stack(losses).tolist(), sink, elapsed / max(steps, 1))


def unigram_entropy() -> float:
    """The built-in corpus's character entropy in nats: the loss of predicting each character
    by its frequency alone."""
    corpus = CharCorpus()
    counts = torch.bincount(corpus.ids, minlength=corpus.vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def placed_transformer(
    variant: str, vocab: int, width: int, depth: int, heads: int, context: int
) -> TinyTransformer:
    """A TinyTransformer as ``Pre-LN``, ``Post-LN`` or ``DeepNorm`` (Post-LN re-initialized
    by ``normprobe.reinit(model, "deepnorm")``)."""
    placement: Literal["pre", "post"] = "pre" if variant == "Pre-LN" else "post"
    model = TinyTransformer(vocab, width, depth, heads, context, placement=placement)
    if variant == "DeepNorm":
        ids = torch.zeros(2, context, dtype=torch.long)
        normprobe.reinit(model, "deepnorm", example_inputs=(ids,))
    return model


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds each of ``calls`` took in each of ``rounds`` rounds. Every call runs once a round,
    in an order that rotates from round to round, all in this process, so that a change in the
    machine's speed (other processes) hits each alike; ``warmup`` untimed calls each come first
    (compilation, the allocator). Take the median of each list."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


# --- output -------------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell."""
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Result:
    """What a claim script found: its table, its verdict and why, and the plot it drew."""

    claim: Claim
    header: list[str]
    rows: list[list[str]]
    verdict: Verdict
    why: str
    numbers: dict[str, object] = field(default_factory=dict)  # what the README table quotes
    quick: bool = False


def finish(result: Result, out: Path, panels: Sequence[plots.Panel], columns: int = 2) -> None:
    """Print the claim, the table and the verdict; write the plot and the JSON under ``out``."""
    if result.verdict not in VERDICTS:
        raise ValueError(f"verdict {result.verdict!r} is not one of {VERDICTS}")
    out.mkdir(parents=True, exist_ok=True)
    png = plots.save(out / f"{result.claim.key}.png", panels, columns=columns, cell=(480, 340))
    print(f"Claim: {result.claim.statement} ({result.claim.source})")
    print(f"Setting: {result.claim.setting}" + (" [--quick: numbers say nothing]" * result.quick))
    print()
    print(table(result.header, result.rows))
    print()
    print(f"Plot: {png}")
    print(f"Verdict: {result.verdict}: {result.why}")
    record = {
        "claim": asdict(result.claim),
        "header": result.header,
        "rows": result.rows,
        "verdict": result.verdict,
        "why": result.why,
        "numbers": result.numbers,
        "quick": result.quick,
        "plot": png.name,
    }
    (out / f"{result.claim.key}.json").write_text(json.dumps(record, indent=2) + "\n")


def curve_lines(runs: dict[str, list[list[float]]], smooth: int = 10) -> list[plots.Line]:
    """One line per setting: the mean over seeds of each step's loss, smoothed over ``smooth``
    steps (a running mean), non-finite steps left out."""
    lines = []
    for i, (label, per_seed) in enumerate(runs.items()):
        steps = min(len(s) for s in per_seed)
        mean = [
            statistics.fmean(s[t] for s in per_seed) if all(math.isfinite(s[t]) for s in per_seed)
            else math.nan
            for t in range(steps)
        ]  # fmt: skip
        points = []
        for t in range(steps):
            window = [v for v in mean[max(0, t - smooth + 1) : t + 1] if math.isfinite(v)]
            if window and math.isfinite(mean[t]):
                points.append((float(t), statistics.fmean(window)))
        lines.append(plots.Line(label, points, plots.PALETTE[i % len(plots.PALETTE)]))
    return lines
