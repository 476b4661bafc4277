"""``normprobe report RUN_DIR``: what a probed run's event files say, as a table and flags.

A *run* is one directory holding ``events.out.tfevents.*`` files directly (what
``attach(log_dir=...)`` or a Lightning ``TensorBoardLogger`` version folder writes). Several
event files in one directory (a resumed run) are read together, as TensorBoard does. Given a
directory without event files of its own, the runs below it are found (``lightning_logs`` ->
``version_0``, ``version_1``...): `report` wants exactly one, the CLI reports each.

The table has one row per (stack, metric): the first and last logged value, the min, the max
and the trend. Metrics logged per block are reduced to one number per step (see `ROW_REDUCE`),
metrics logged per module (norms, attention, BatchNorm) too, per position within the stack's
blocks. A value that was NaN is not in the event files (the probe skips it), so after a NaN
onset rows end early and say so. Flags compare the run against the thresholds below.

Exit status of ``normprobe report``: 0 when no run raised a flag, 1 when one did (so that a CI
job can fail on it), 2 on bad input (a path that does not exist, no event files, no
``normprobe/`` tags).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "normprobe/"
EVENT_GLOB = "events.out.tfevents.*"
MODEL = "model"  # the group of tags that belong to no stack (logits, ln_f, nonfinite)

# --- flag thresholds -------------------------------------------------------------------------
# Residual growth needs both a shape and a size. Shape: log RMS against log depth rising with a
# slope of at least 0.3; Pre-LN's sqrt(l) growth (seed tutorial §5.3) is 0.5, and the tutorial's
# 48-block Pre-LN stack reads 0.37 at init (its input already has RMS 1, which flattens the
# start). Size: the last block's RMS at least 3x the first one's, so that a deep block's write
# weighs a third of the first block's; that stack reads 3.5, a 4-block Pre-LN model under 2.
RESID_SLOPE_LIMIT = 0.3
RESID_GROWTH_MIN = 3.0
# Any shape: an unscaled stream of 50 layers grows its std x10 (variance x101, the tutorial's
# check [f]); a stack growing that much is flagged whatever its slope.
RESID_GROWTH_LIMIT = 10.0
# Representation collapse (the lecture, seed 004): consecutive blocks' streams nearly parallel.
COLLAPSE_COS = 0.95
# The lecture measures collapse over depth; below 4 blocks there is no deep half to speak of.
COLLAPSE_MIN_DEPTH = 4
# grad_ratio (last / first block), the tutorial's check [d]: Post-LN reads 2.35 (top-heavy, the
# reason it needs warmup) and DeepNorm brings it to 1.02, so 2.0 flags the first and not the
# second. Pre-LN reads 0.40 there, which the tutorial calls better conditioned (each block's
# scale shrinks evenly with depth): only a skew well past it, 4x, is flagged as bottom-heavy.
GRAD_TOP_LIMIT = 2.0
GRAD_BOTTOM_LIMIT = 0.25
# Gemma 2 soft-caps final logits at 30 and attention logits at 50: beyond these, softmax is
# saturated enough that those models chose to clip them.
LOGIT_LIMIT = 30.0
ATTN_LOGIT_LIMIT = 50.0
# Small-init heads start with logits near 0.1-1 and healthy training takes them to ~10, a rise
# of 10-100x; 100x from the first logged step is past that. A rise from a near-zero start (the
# attention of a block whose input is still tiny) counts only once the logit reaches 10, where
# softmax already favours one entry over another by e^10 = 22,000 to 1.
LOGIT_GROWTH_FACTOR = 100.0
LOGIT_GROWTH_FLOOR = 10.0
# BatchNorm: batch mean off the running mean by half a running std, batch variance off by a
# factor 2 (|log| = 0.69), eval output differing from train output by 20% of its RMS. Our
# choice: the tutorial's check [c] shows train != eval, without a number for "too far".
BN_MEAN_DRIFT_LIMIT = 0.5
BN_VAR_DRIFT_LIMIT = math.log(2.0)
BN_GAP_LIMIT = 0.2
# A change of less than 10% between the first and the last value reads as "flat".
TREND_FLAT = 0.1

# How a per-block or per-module family becomes one number per step and stack.
ROW_REDUCE: dict[str, str] = {
    "resid_rms": "last",  # the stream leaving the stack
    "resid_cos": "deep",  # mean over the deep half of the blocks (what collapse looks at)
    "grad_norm": "mean",
    "update_ratio": "mean",
    "norm_in_rms": "mean",
    "norm_out_rms": "mean",
    "norm_gain_mean": "mean",
    "norm_gain_std": "mean",
    "attn_logit_max": "max",
    "bn_mean_drift": "max",
    "bn_var_drift": "max",
    "bn_gap": "max",
    "val_bn_mean_drift": "max",
    "val_bn_var_drift": "max",
    "val_bn_gap": "max",
}
STACK_SCALARS = ("resid_growth", "resid_slope", "grad_ratio")
BLOCK_FAMILIES = ("resid_rms", "resid_cos", "grad_norm", "update_ratio")
BN_LIMITS = {
    "mean_drift": BN_MEAN_DRIFT_LIMIT,
    "var_drift": BN_VAR_DRIFT_LIMIT,
    "gap": BN_GAP_LIMIT,
}
FAMILY_ORDER = (
    "resid_rms",
    "resid_growth",
    "resid_slope",
    "resid_cos",
    "grad_norm",
    "grad_ratio",
    "update_ratio",
    "norm_in_rms",
    "norm_out_rms",
    "norm_gain_mean",
    "norm_gain_std",
    "attn_logit_max",
    "logits",
    "bn_mean_drift",
    "bn_var_drift",
    "bn_gap",
    "val_bn_mean_drift",
    "val_bn_var_drift",
    "val_bn_gap",
    "nonfinite",
)

# --- the depth-profile picture ---------------------------------------------------------------
PANEL_SIZE = (480, 300)
PANEL_COLUMNS = 2
MAX_PROFILE_LINES = 6
BACKGROUND = (255, 255, 255)

Series = list[tuple[int, float]]


@dataclass(frozen=True)
class Trend:
    """One row of the table: a metric of one stack over the logged steps.

    Attributes:
        stack: the stack's tag name, or ``"model"`` for what belongs to no stack.
        metric: the row's name: the family, with the reduction over blocks or modules in
            brackets (``resid_rms[last]``) and the norm's position in its block (``.ln_1``).
        steps: the logged steps that have a value.
        values: the value at each of those steps.
        tags: the TensorBoard tags the row was computed from.
    """

    stack: str
    metric: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    tags: tuple[str, ...]

    @property
    def first(self) -> float:
        return self.values[0]

    @property
    def last(self) -> float:
        return self.values[-1]

    @property
    def min(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return min(finite) if finite else math.nan

    @property
    def max(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return max(finite) if finite else math.nan

    @property
    def trend(self) -> str:
        """``flat``, ``up x3.2``, ``down x0.41``, ``up``/``down`` (sign change), ``non-finite``."""
        if len(self.values) < 2:
            return "one step"
        first, last = self.first, self.last
        if not (math.isfinite(first) and math.isfinite(last)):
            return "non-finite"
        scale = max(abs(first), abs(last))
        if scale == 0 or abs(last - first) <= TREND_FLAT * scale:
            return "flat"
        word = "up" if last > first else "down"
        if first > 0 and last > 0:
            return f"{word} x{last / first:.3g}"
        return word


@dataclass(frozen=True)
class Flag:
    """Something in the run that crossed a threshold.

    Attributes:
        kind: ``residual growth``, ``representation collapse``, ``nan onset``,
            ``batchnorm drift``, ``logit blow-up``, ``top-heavy gradients`` or
            ``bottom-heavy gradients``.
        stack: the stack (or ``"model"``) it concerns.
        step: the logged step the evidence comes from.
        value: the measured value that crossed ``threshold``.
        threshold: the limit it was compared against (one of this module's constants).
        message: the evidence and a suggestion, in a sentence or two.
    """

    kind: str
    stack: str
    step: int
    value: float
    threshold: float
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.stack} at step {self.step}: {self.message}"


@dataclass
class RunReport:
    """What `report` read from one run: rows, flags and depth profiles.

    Attributes:
        run_dir: the run's directory (or event file).
        event_files: how many event files were read.
        steps: every logged step, in order.
        trends: the table's rows, by stack then metric family.
        flags: what crossed a threshold.
        profiles: ``<family>/<stack>`` -> [(step, one value per block)], from the depth
            histograms (NaN where nothing was measured, e.g. block 0 of ``resid_cos``).
    """

    run_dir: str
    event_files: int
    steps: list[int]
    trends: list[Trend]
    flags: list[Flag]
    profiles: dict[str, list[tuple[int, list[float]]]] = field(default_factory=dict)

    def row(self, stack: str, metric: str) -> Trend:
        """The row of ``metric`` for ``stack``; KeyError lists the rows there are."""
        for t in self.trends:
            if t.stack == stack and t.metric == metric:
                return t
        have = ", ".join(f"{t.stack}:{t.metric}" for t in self.trends)
        raise KeyError(f"no row {metric!r} for stack {stack!r}; rows: {have}")

    def table(self) -> str:
        """The printable report: a header, the table and the flags."""
        if self.steps:
            span = f"steps {self.steps[0]}..{self.steps[-1]} ({len(self.steps)} logged)"
        else:
            span = "no logged steps"
        files = f"{self.event_files} event file{'s' if self.event_files != 1 else ''}"
        lines = [f"normprobe report: {self.run_dir}", f"{span}, {files}", ""]
        header = ("stack", "metric", "first", "last", "min", "max", "trend")
        last_step = self.steps[-1] if self.steps else None
        rows = [
            (
                t.stack,
                t.metric,
                _num(t.first),
                _num(t.last),
                _num(t.min),
                _num(t.max),
                t.trend if t.steps[-1] == last_step else f"{t.trend}, ends at step {t.steps[-1]}",
            )
            for t in self.trends
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for i, r in enumerate([header, *rows]):
            if i > 1 and r[0] == rows[i - 2][0]:
                r = ("", *r[1:])  # the stack's name once, on its first row
            cells = [
                c.rjust(w) if 2 <= j <= 5 else c.ljust(w)
                for j, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
        if self.flags:
            lines.append(f"Flags ({len(self.flags)}):")
            lines += [f"  {f}" for f in self.flags]
        else:
            lines.append("No flags.")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def write_png(self, path: str | Path) -> Path:
        """Draw the depth profiles: one panel per (metric, stack), a line per chosen step.

        Each panel plots the metric against the block index for up to `MAX_PROFILE_LINES`
        logged steps spread over the run (first and last included), lighter for earlier steps.
        The image is ``PANEL_COLUMNS`` panels wide; each panel is `PANEL_SIZE`.

        Raises:
            ValueError: the run has no depth histograms (no per-block metric was logged).

        Example::

            report("runs/a").write_png("runs/a/depth.png")
        """
        return _draw_profiles(self, Path(path))


# --- reading -----------------------------------------------------------------------------------
def find_runs(path: str | Path) -> list[Path]:
    """Every directory at or under ``path`` that holds event files itself, sorted.

    Example::

        for run in find_runs("lightning_logs"):   # lightning_logs/version_0, version_1, ...
            print(report(run))
    """
    root = Path(path)
    if root.is_file():
        return [root] if _is_event_file(root) else []
    if not root.is_dir():
        return []
    dirs = {p.parent for p in root.rglob(EVENT_GLOB) if p.is_file()}
    return sorted(dirs)


def report(run_dir: str | Path) -> RunReport:
    """Read one run's event files and summarize them: table rows, flags and depth profiles.

    Args:
        run_dir: a directory holding ``events.out.tfevents.*`` files (``attach(log_dir=...)``),
            a directory with exactly one such directory below it (``lightning_logs`` with one
            ``version_0``), or one event file.

    Returns:
        A `RunReport`; ``print(it)`` shows the table and the flags.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds no event files.
        ValueError: several runs below ``run_dir`` (report each of `find_runs`), or event
            files without any ``normprobe/`` tag (no probe was attached to that run).

    Example::

        rep = normprobe.report.report("runs/pre_ln")
        print(rep)                       # the table and the flags
        rep.write_png("depth.png")       # the depth profiles
        if any(f.kind == "nan onset" for f in rep.flags): ...
    """
    path = Path(run_dir)
    runs = _runs_under(path)
    if len(runs) > 1:
        listed = ", ".join(str(r) for r in runs[:8]) + (" ..." if len(runs) > 8 else "")
        raise ValueError(
            f"{str(path)!r} holds {len(runs)} runs ({listed}); report one of them, or each of "
            "normprobe.report.find_runs(path) (the CLI reports them all)"
        )
    run = runs[0]
    events = _read(run)
    if not any(t.startswith(PREFIX) for t in [*events.scalars, *events.histograms]):
        raise ValueError(
            f"the event files of {str(run)!r} hold no {PREFIX} tags (tags there: "
            f"{sorted(events.scalars)[:5]}); was the run logged with normprobe.attach or "
            "normprobe.NormProbe?"
        )
    steps = sorted({s for series in events.scalars.values() for s, _ in series})
    rows = _rows(events.scalars)
    return RunReport(
        run_dir=str(run),
        event_files=events.files,
        steps=steps,
        trends=rows,
        flags=_flags(events, rows),
        profiles=_profiles(events.histograms),
    )


@dataclass
class _Events:
    files: int
    scalars: dict[str, Series]
    histograms: dict[str, list[tuple[int, list[float]]]]
    texts: dict[str, list[tuple[int, str]]]


def _is_event_file(p: Path) -> bool:
    return p.name.startswith("events.out.tfevents.")


def _read(run: Path) -> _Events:
    from tensorboard.backend.event_processing import event_accumulator as ea

    everything = {ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0}
    acc = ea.EventAccumulator(str(run), size_guidance=everything)
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, float(e.value)) for e in acc.Scalars(t)] for t in tags[ea.SCALARS]}
    histograms = {
        t: [(e.step, [float(b) for b in e.histogram_value.bucket]) for e in acc.Histograms(t)]
        for t in tags[ea.HISTOGRAMS]
        if t.startswith(PREFIX)
    }
    texts: dict[str, list[tuple[int, str]]] = {}
    for t in tags[ea.TENSORS]:
        if t.startswith(PREFIX) and t.endswith("/text_summary"):
            texts[t.removesuffix("/text_summary")] = [
                (e.step, b"".join(e.tensor_proto.string_val).decode("utf-8", "replace"))
                for e in acc.Tensors(t)
            ]
    files = 1 if run.is_file() else len([p for p in run.glob(EVENT_GLOB) if p.is_file()])
    return _Events(files, scalars, histograms, texts)


# --- rows --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tag:
    tag: str
    family: str
    stack: str
    label: str  # the row's metric name
    block: int | None  # per-block families: the block index
    module: str  # per-module families: the module's tag name


def _parse(tag: str, stacks: set[str]) -> _Tag | None:
    if not tag.startswith(PREFIX):
        return None
    family, _, rest = tag[len(PREFIX) :].partition("/")
    if not rest:
        return None
    if family in STACK_SCALARS:
        return _Tag(tag, family, rest, family, None, "")
    if family in BLOCK_FAMILIES:
        m = re.fullmatch(r"(.+)/(\d+)", rest)
        if m is None:
            return None
        label = f"{family}[{ROW_REDUCE[family]}]"
        return _Tag(tag, family, m[1], label, int(m[2]), "")
    if family in ("logits", "nonfinite"):
        return _Tag(tag, family, MODEL, f"{family}/{rest}", None, "")
    if family in ROW_REDUCE:
        reduce = ROW_REDUCE[family]
        m = re.fullmatch(r"([^/]+)/(\d+)\.(.+)", rest)  # <stack>/<block>.<path in the block>
        if m is not None:
            stack, position = m[1], "." + m[3]
        elif "." in rest and rest.rsplit(".", 1)[0] in stacks and rest.rsplit(".", 1)[1].isdigit():
            stack, position = rest.rsplit(".", 1)[0], ""  # the block is the module (lns.3)
        else:
            stack, position = MODEL, rest
        if reduce == "max":  # attention and BatchNorm: the worst module of the stack
            position = ""
        label = f"{family}[{reduce}]" if not position else f"{family} {position}"
        if stack == MODEL and reduce != "max":
            label = f"{family} {rest}"
        return _Tag(tag, family, stack, label, None, rest)
    return None


def _stacks(tags: Sequence[str]) -> set[str]:
    found = set()
    for tag in tags:
        family, _, rest = tag[len(PREFIX) :].partition("/")
        if family in STACK_SCALARS:
            found.add(rest)
        elif family in BLOCK_FAMILIES and "/" in rest:
            found.add(rest.rsplit("/", 1)[0])
    return found


def _parsed(scalars: dict[str, Series]) -> list[_Tag]:
    stacks = _stacks(list(scalars))
    return [p for p in (_parse(t, stacks) for t in scalars) if p is not None]


def _members(kind: str, tags: list[_Tag]) -> list[_Tag]:
    """The tags a row reads: the last block, the deep half, or all of them."""
    if kind not in ("last", "deep"):
        return tags
    depth = max(t.block or 0 for t in tags) + 1
    if kind == "last":
        return [t for t in tags if t.block == depth - 1]
    return [t for t in tags if (t.block or 0) >= depth // 2]


def _reduce(kind: str, values: list[float]) -> float:
    if kind == "max":
        return max(values)
    if kind in ("mean", "deep"):
        return statistics.fmean(values)
    return values[0]  # "last" and "value": one tag


def _rows(scalars: dict[str, Series]) -> list[Trend]:
    grouped: dict[tuple[str, str], list[_Tag]] = {}
    for p in _parsed(scalars):
        grouped.setdefault((p.stack, p.label), []).append(p)
    rows = []
    for (stack, label), tags in grouped.items():
        kind = ROW_REDUCE.get(tags[0].family, "value")
        members = _members(kind, tags)
        by_step: dict[int, list[float]] = {}
        for m in members:
            for step, value in scalars[m.tag]:
                by_step.setdefault(step, []).append(value)
        # a step where some member was not logged (not measured there) would mix blocks
        steps = sorted(s for s, vs in by_step.items() if len(vs) == len(members))
        if not steps:
            continue
        values = tuple(_reduce(kind, by_step[s]) for s in steps)
        rows.append(
            Trend(stack, label, tuple(steps), values, tuple(sorted(m.tag for m in members)))
        )

    def order(t: Trend) -> tuple[bool, str, int, str]:
        family = t.metric.split("[")[0].split(" ")[0].split("/")[0]
        rank = FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)
        return (t.stack == MODEL, t.stack, rank, t.metric)

    return sorted(rows, key=order)


# --- flags -------------------------------------------------------------------------------------
def _last(series: Series) -> tuple[int, float] | None:
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    return finite[-1] if finite else None


def _flags(events: _Events, rows: list[Trend]) -> list[Flag]:
    scalars = events.scalars
    tags = _parsed(scalars)
    flags: list[Flag] = []
    flags += _nan_onset(events)
    stacks = sorted({t.stack for t in rows})
    for stack in stacks:
        flags += _growth(scalars, stack)
        flags += _collapse(tags, scalars, stack)
        flags += _gradients(scalars, stack)
        flags += _attention(tags, scalars, stack)
        flags += _batchnorm(tags, scalars, stack)
    flags += _logits(scalars)
    return flags


def _nan_onset(events: _Events) -> list[Flag]:
    series = events.scalars.get(f"{PREFIX}nonfinite/modules", [])
    onset = next(((s, v) for s, v in series if v > 0 or not math.isfinite(v)), None)
    if onset is None:
        return []
    step, count = onset
    texts = events.texts.get(f"{PREFIX}nonfinite/first", [])
    first = next((text for s, text in texts if s == step), None)
    where = f"first in the output of {first}" if first else "module not recorded"
    return [
        Flag(
            "nan onset",
            MODEL,
            step,
            count,
            0.0,
            f"NaN/Inf in {count:g} module outputs, {where}; check the learning rate, the data of "
            "that step and fp16 overflow (earlier logged steps were finite)",
        )
    ]


def _growth(scalars: dict[str, Series], stack: str) -> list[Flag]:
    slope = _last(scalars.get(f"{PREFIX}resid_slope/{stack}", []))
    growth = _last(scalars.get(f"{PREFIX}resid_growth/{stack}", []))
    if growth is None:
        return []
    step, g = growth
    s = slope[1] if slope is not None and slope[0] == step else math.nan
    if g >= RESID_GROWTH_LIMIT:
        why = f"resid_growth {g:.3g} >= {RESID_GROWTH_LIMIT:g}"
    elif g >= RESID_GROWTH_MIN and s >= RESID_SLOPE_LIMIT:
        why = (
            f"resid_growth {g:.3g} >= {RESID_GROWTH_MIN:g} and resid_slope {s:.3g} >= "
            f"{RESID_SLOPE_LIMIT} (0.5 is Pre-LN's sqrt(l) growth)"
        )
    else:
        return []
    return [
        Flag(
            "residual growth",
            stack,
            step,
            g,
            RESID_GROWTH_LIMIT if g >= RESID_GROWTH_LIMIT else RESID_GROWTH_MIN,
            f"{why}: the last block's stream has {g:.3g}x the RMS of the first block's, so deep "
            "blocks' writes are diluted; keep a final norm before the head, or scale the "
            "residual branches (normprobe.reinit(model, 'gpt2'), insert_branch_scale)",
        )
    ]


def _collapse(tags: list[_Tag], scalars: dict[str, Series], stack: str) -> list[Flag]:
    cos = [t for t in tags if t.family == "resid_cos" and t.stack == stack]
    if not cos:
        return []
    depth = max(t.block or 0 for t in cos) + 1
    if depth < COLLAPSE_MIN_DEPTH:
        return []
    step = max(s for t in cos for s, _ in scalars[t.tag])
    deep = {
        t.block: v
        for t in cos
        if (t.block or 0) >= depth // 2
        for s, v in scalars[t.tag]
        if s == step and math.isfinite(v)
    }
    if not deep:
        return []
    mean = statistics.fmean(deep.values())
    if mean <= COLLAPSE_COS:
        return []
    lo, hi = min(k or 0 for k in deep), max(k or 0 for k in deep)
    return [
        Flag(
            "representation collapse",
            stack,
            step,
            mean,
            COLLAPSE_COS,
            f"consecutive blocks' streams have cosine {mean:.3f} > {COLLAPSE_COS} on average over "
            f"blocks {lo}..{hi} (the deep half): those blocks barely change the representation "
            "(typical of Pre-LN, whose stream outgrows each block's write); consider DeepNorm, "
            "sandwich norms or branch scaling",
        )
    ]


def _gradients(scalars: dict[str, Series], stack: str) -> list[Flag]:
    series = scalars.get(f"{PREFIX}grad_ratio/{stack}", [])
    series = [(s, v) for s, v in series if math.isfinite(v) and v > 0]
    if not series:
        return []
    # the median over the run (one noisy step does not make a skew), then the first logged
    # step (where the tutorial measures: Post-LN's skew at init is why it needs warmup)
    median = statistics.median(v for _, v in series)
    checks = [
        (
            series[-1][0],
            median,
            "(median over the logged steps)" if len(series) > 1 else "at the only logged step",
        )
    ]
    if len(series) > 1:
        checks.append((series[0][0], series[0][1], "at the first logged step"))
    for step, ratio, when in checks:
        if ratio >= GRAD_TOP_LIMIT:
            return [
                Flag(
                    "top-heavy gradients",
                    stack,
                    step,
                    ratio,
                    GRAD_TOP_LIMIT,
                    f"grad_ratio (last / first block) {ratio:.3g} {when} >= {GRAD_TOP_LIMIT:g}: "
                    "gradients pile up near the output, as in Post-LN (2.35 in the tutorial); "
                    "warm the learning rate up, or use DeepNorm "
                    "(normprobe.reinit(model, 'deepnorm'))",
                )
            ]
        if ratio <= GRAD_BOTTOM_LIMIT:
            return [
                Flag(
                    "bottom-heavy gradients",
                    stack,
                    step,
                    ratio,
                    GRAD_BOTTOM_LIMIT,
                    f"grad_ratio (last / first block) {ratio:.3g} {when} <= "
                    f"{GRAD_BOTTOM_LIMIT:g}: the first block's gradient is {1 / ratio:.3g}x the "
                    "last one's (the direction of Pre-LN's skew, 2.5x in the tutorial); deep "
                    "blocks learn slowly: scale the residual branches or give deep blocks a "
                    "larger learning rate",
                )
            ]
    return []


def _blow_up(series: Series, limit: float) -> tuple[int, float, str] | None:
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if not finite:
        return None
    (s0, v0), (s1, v1) = finite[0], finite[-1]
    why = []
    if v1 >= limit:
        why.append(f"{v1:.3g} >= {limit:g}")
    if v0 > 0 and v1 / v0 >= LOGIT_GROWTH_FACTOR and v1 >= LOGIT_GROWTH_FLOOR:
        why.append(f"{v1:.3g}, {v1 / v0:.3g}x its value at step {s0}")
    return (
        (s1, v1, why[0] if len(why) == 1 else f"{why[0]} and {why[1].split(', ', 1)[1]}")
        if why
        else None
    )


def _logits(scalars: dict[str, Series]) -> list[Flag]:
    hit = _blow_up(scalars.get(f"{PREFIX}logits/max_abs", []), LOGIT_LIMIT)
    if hit is None:
        return []
    step, value, why = hit
    return [
        Flag(
            "logit blow-up",
            MODEL,
            step,
            value,
            LOGIT_LIMIT,
            f"the head's max |logit| is {why}: softmax saturates; lower the learning rate, add "
            "weight decay or z-loss on the head, or soft-cap the logits",
        )
    ]


def _attention(tags: list[_Tag], scalars: dict[str, Series], stack: str) -> list[Flag]:
    worst: tuple[float, _Tag, tuple[int, float, str]] | None = None
    for t in tags:
        if t.family != "attn_logit_max" or t.stack != stack:
            continue
        hit = _blow_up(scalars[t.tag], ATTN_LOGIT_LIMIT)
        if hit is not None and (worst is None or hit[1] > worst[0]):
            worst = (hit[1], t, hit)
    if worst is None:
        return []
    _, t, (step, value, why) = worst
    return [
        Flag(
            "logit blow-up",
            stack,
            step,
            value,
            ATTN_LOGIT_LIMIT,
            f"attention logits max |q.k|*scale of {t.module} is {why}: attention saturates "
            "toward one-hot; add QK-norm (TinyTransformer(qk_norm=True), convert_norms) or lower "
            "the learning rate",
        )
    ]


def _batchnorm(tags: list[_Tag], scalars: dict[str, Series], stack: str) -> list[Flag]:
    over: list[tuple[float, int, float, float, str]] = []
    for t in tags:
        if t.stack != stack or "bn_" not in t.family:
            continue
        limit = BN_LIMITS[t.family.split("bn_", 1)[1]]
        last = _last(scalars[t.tag])
        if last is not None and last[1] > limit:
            text = f"{t.family} {last[1]:.3g} > {limit:.3g} at {t.module}"
            over.append((last[1] / limit, last[0], last[1], limit, text))
    if not over:
        return []
    over.sort(reverse=True)  # the worst first, by its ratio to its own limit
    _, step, value, limit, _ = over[0]
    listed = "; ".join(o[4] for o in over[:4]) + ("; ..." if len(over) > 4 else "")
    return [
        Flag(
            "batchnorm drift",
            stack,
            step,
            value,
            limit,
            f"{listed}: batches differ from the running statistics that eval mode uses; look "
            "for a shifting input distribution, raise the momentum, or use GroupNorm/LayerNorm "
            "for small or correlated batches",
        )
    ]


# --- profiles and the picture -------------------------------------------------------------------
def _profiles(
    histograms: dict[str, list[tuple[int, list[float]]]],
) -> dict[str, list[tuple[int, list[float]]]]:
    out = {}
    for tag, events in histograms.items():
        family = tag[len(PREFIX) :].split("/", 1)[0]
        if family not in BLOCK_FAMILIES:
            continue
        profiles = []
        for step, values in sorted(events, key=lambda e: e[0]):
            values = list(values)
            if family == "resid_cos" and values:
                values[0] = math.nan  # block 0 has no predecessor; the sink wrote 0
            profiles.append((step, values))
        out[tag[len(PREFIX) :]] = profiles
    return out


def _chosen_steps(n: int) -> list[int]:
    if n <= MAX_PROFILE_LINES:
        return list(range(n))
    return sorted({round(i * (n - 1) / (MAX_PROFILE_LINES - 1)) for i in range(MAX_PROFILE_LINES)})


def _color(i: int, n: int) -> tuple[int, int, int]:
    """Light blue (earliest step) to dark blue (latest)."""
    t = 1.0 if n <= 1 else i / (n - 1)
    light, dark = (158, 202, 225), (8, 48, 107)
    return tuple(round(a + (b - a) * t) for a, b in zip(light, dark, strict=True))  # type: ignore[return-value]


def png_size(panels: int) -> tuple[int, int]:
    """The size in pixels of a picture of ``panels`` depth profiles."""
    cols = min(PANEL_COLUMNS, panels)
    rows = -(-panels // PANEL_COLUMNS)
    return cols * PANEL_SIZE[0], rows * PANEL_SIZE[1]


def _draw_profiles(rep: RunReport, path: Path) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    if not rep.profiles:
        raise ValueError(
            f"{rep.run_dir!r} has no depth histograms to draw: log a per-block metric "
            f"({', '.join(BLOCK_FAMILIES)}) to get them"
        )
    names = sorted(
        rep.profiles, key=lambda n: (n.split("/", 1)[1], BLOCK_FAMILIES.index(n.split("/")[0]))
    )
    image = Image.new("RGB", png_size(len(names)), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for i, name in enumerate(names):
        x0 = (i % PANEL_COLUMNS) * PANEL_SIZE[0]
        y0 = (i // PANEL_COLUMNS) * PANEL_SIZE[1]
        _panel(draw, font, (x0, y0), name, rep.profiles[name])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


def _panel(
    draw: Any,
    font: Any,
    origin: tuple[int, int],
    name: str,
    profiles: list[tuple[int, list[float]]],
) -> None:
    ox, oy = origin
    w, h = PANEL_SIZE
    left, right, top, bottom = ox + 58, ox + w - 78, oy + 26, oy + h - 34
    family, stack = name.split("/", 1)
    draw.text((ox + 8, oy + 6), f"{family}, stack {stack}", fill=(0, 0, 0), font=font)
    chosen = [profiles[k] for k in _chosen_steps(len(profiles))]
    values = [v for _, vs in chosen for v in vs if math.isfinite(v)]
    depth = max((len(vs) for _, vs in chosen), default=1)
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        lo, hi = lo - 0.5 * max(abs(lo), 1e-3), hi + 0.5 * max(abs(hi), 1e-3)
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad

    def sx(block: float) -> float:
        return left + (right - left) * (block / max(depth - 1, 1))

    def sy(v: float) -> float:
        return bottom - (bottom - top) * (v - lo) / (hi - lo)

    axis = (90, 90, 90)
    draw.rectangle((left, top, right, bottom), outline=axis)
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        y = sy(v)
        draw.line((left - 4, y, left, y), fill=axis)
        draw.text((ox + 4, y - 6), f"{v:.3g}", fill=axis, font=font)
    ticks = sorted(
        {round(k * (depth - 1) / min(7, max(depth - 1, 1))) for k in range(min(8, depth))}
    )
    for b in ticks:
        x = sx(b)
        draw.line((x, bottom, x, bottom + 4), fill=axis)
        draw.text((x - 6, bottom + 6), str(b), fill=axis, font=font)
    draw.text(((left + right) / 2 - 14, bottom + 18), "block", fill=axis, font=font)
    for n, (step, vs) in enumerate(chosen):
        color = _color(n, len(chosen))
        points = [(sx(b), sy(v)) for b, v in enumerate(vs) if math.isfinite(v)]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for x, y in points:
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=color)
        ly = top + 4 + 14 * n
        draw.line((right + 8, ly + 6, right + 24, ly + 6), fill=color, width=3)
        draw.text((right + 28, ly), f"step {step}", fill=(0, 0, 0), font=font)


# --- the command line --------------------------------------------------------------------------
def _num(v: float) -> str:
    if math.isnan(v):
        return "nan"
    return f"{v:.4g}"


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on an ``argparse`` subparsers object (``normprobe report``).

    Exit status of the command: 0 when no run raised a flag, 1 when some did, 2 on bad input
    (a path that does not exist, no event files, no ``normprobe/`` tags).

    Example::

        parser = argparse.ArgumentParser(prog="normprobe")
        report.add_cli(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["report", "runs/a", "--png", "depth.png"])
        raise SystemExit(args.run(args))
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="summarize a probed run's TensorBoard event files",
        description=(
            "Read the event files normprobe wrote and print, per stack, each metric's first, "
            "last, min and max over training with its trend, then flags (residual growth, "
            "representation collapse, NaN onset, BatchNorm drift, logit blow-up, top- or "
            "bottom-heavy gradients). Every run under RUN_DIR is reported. Exit status: 0 no "
            "flags, 1 flags raised, 2 bad input."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's log directory, or a parent")
    parser.add_argument(
        "--png",
        metavar="OUT.png",
        help="also draw the depth profiles there (one file per run: OUT-<run>.png if several)",
    )
    parser.set_defaults(run=_run)
    return parser


def _runs_under(path: Path) -> list[Path]:
    """`find_runs`, or FileNotFoundError naming the path and what to pass instead."""
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {str(path)!r}; pass a run's log_dir")
    runs = find_runs(path)
    if not runs:
        raise FileNotFoundError(
            f"no TensorBoard event files ({EVENT_GLOB}) in or under {str(path)!r}; pass the "
            "log_dir given to normprobe.attach (or a Lightning logger's directory)"
        )
    return runs


def _run(args: argparse.Namespace) -> int:
    root = Path(args.run_dir)
    try:
        runs = _runs_under(root)
    except FileNotFoundError as e:
        return _fail(str(e))
    reports, skipped = [], []
    for run in runs:
        try:
            reports.append(report(run))
        except ValueError:
            skipped.append(run)
    if not reports:
        listed = ", ".join(repr(str(r)) for r in skipped[:3])
        listed += f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        return _fail(
            f"no normprobe/ tags in the event files of {listed}; was the probe attached "
            "(normprobe.attach or normprobe.NormProbe)?"
        )
    for k, rep in enumerate(reports):
        if k:
            print()
        print(rep.table())
        if args.png:
            out = _png_path(Path(args.png), root, Path(rep.run_dir), len(reports))
            try:
                rep.write_png(out)
            except ValueError as e:
                print(f"no picture: {e}")
            else:
                print(f"depth profiles: {out}")
    if skipped:
        print(f"\nskipped (no normprobe/ tags): {', '.join(str(s) for s in skipped)}")
    return 1 if any(rep.flags for rep in reports) else 0


def _png_path(out: Path, root: Path, run: Path, count: int) -> Path:
    if count == 1:
        return out
    try:
        rel = run.relative_to(root)
    except ValueError:
        rel = Path(run.name)
    label = "_".join(rel.parts) or run.name
    return out.with_name(f"{out.stem}-{label}{out.suffix or '.png'}")


def _fail(message: str) -> int:
    print(f"normprobe report: error: {message}", file=sys.stderr)
    return 2
