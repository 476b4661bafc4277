"""Where logged statistics go: a `Sink` receives each logged step's `Record`.

`TensorBoardSink` writes event files (scalars, a custom-scalars layout, depth profiles);
`MemorySink` keeps the records in a list, for tests and notebooks. Any object with the
`Sink` methods can be passed to ``attach(..., sinks=[...])``.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import google_crc32c
from tensorboard.compat.proto.summary_pb2 import Summary

from . import tags
from .common import spread
from .metrics import SERIES

# A chart of the custom-scalars dashboard: (category, title, regex of the tags it draws).
Chart = tuple[str, str, str]


@dataclass
class Record:
    """Everything one logged step produced, already on the host.

    Attributes:
        step: the training step.
        scalars: tag -> value.
        profiles: tag -> one value per block (the depth view of a metric over a stack).
        texts: tag -> text (the first module with a non-finite output).

    The accessors read it the same way on any model, whatever its stacks are called:
    ``record.grad_ratio()``, ``record.resid_growth()`` (of the only stack, or ``stack=``),
    ``record.series("grad_ratio")`` (``{stack: value}``) and ``record.stacks``.
    """

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def stacks(self) -> list[str]:
        """The stacks of blocks measured at this step, as tags name them (``blocks``,
        ``model.layers``, ``transformer.h``)."""
        found = {
            t.subject
            for t in map(tags.parse, self.profiles)
            if t is not None and t.series in SERIES and SERIES[t.series].shape == "block"
        }
        return sorted(found)

    def series(self, name: str) -> dict[str, float]:
        """This step's values of the series ``name`` (``grad_ratio``, ``resid_rms``,
        ``norm_in_rms``...), by what follows ``normprobe/<name>/`` in their tags: a stack
        (``{"model.layers": 0.4}``), a block (``"blocks/03"``), a module or a statistic.

        Empty when the family writing it was not measured; ValueError for a name no family
        writes.
        """
        if name not in SERIES:
            close = difflib.get_close_matches(name, SERIES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"no series is called {name!r}{hint}; they are {', '.join(SERIES)}")
        start = tags.prefix(name)
        return {t[len(start) :]: v for t, v in self.scalars.items() if t.startswith(start)}

    def grad_ratio(self, stack: str | None = None) -> float:
        """The gradient norm of ``stack``'s last block over its first's (default: the only
        stack); ValueError names the stacks when there are several or none."""
        return self._of_stack("grad_ratio", stack)

    def resid_growth(self, stack: str | None = None) -> float:
        """The residual stream's RMS after ``stack``'s last block over after its first
        (default: the only stack), as `grad_ratio`."""
        return self._of_stack("resid_growth", stack)

    def _of_stack(self, series: str, stack: str | None) -> float:
        values = self.series(series)
        if stack in values or (stack is None and len(values) == 1):
            return values[stack] if stack is not None else next(iter(values.values()))
        if not values:
            raise ValueError(
                f"no {series} at step {self.step}: its family was not among the metrics, the "
                "model has no stack of blocks (see probe.model_map), or its first block's value "
                "was 0"
            )
        if stack is None:
            raise ValueError(
                f"{len(values)} stacks have a {series} ({', '.join(values)}): pass stack=..."
            )
        raise ValueError(f"no {series} for stack {stack!r}; stacks: {', '.join(values)}")


class Sink(Protocol):
    """Receives the records of a probe's logged steps (on global rank zero only).

    `flush` is called when a forward raises (what was written must reach the disk) and
    `close` when the probe is removed.
    """

    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record in `records`: the probe's output, in memory.

    Example::

        sink = normprobe.MemorySink()
        with normprobe.attach(model, opt, sinks=[sink], every=1):
            train()
        sink.series("normprobe/grad_ratio/blocks")   # [(step, value), ...]
    """

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.closed = False

    def write(self, record: Record) -> None:
        self.records.append(record)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def series(self, tag: str) -> list[tuple[int, float]]:
        """(step, value) of ``tag`` over the records that have it."""
        return [(r.step, r.scalars[tag]) for r in self.records if tag in r.scalars]


# the run's health first: what `report` flags on, then the loss where the trainer logs one
SUMMARY = (
    ("gradient ratio, last / first block", "grad_ratio"),
    ("residual growth, last / first block", "resid_growth"),
    ("max attention logit", "attn_logit_max"),
    ("modules with NaN/Inf outputs", "nonfinite"),
)
LOSS_REGEX = r"^(train/loss|train_loss|loss)$"
# the summary draws these ratios as log2 (``normprobe/summary/<series>_log2/<stack>``): a run at
# 100 and one at 0.5 both read on one axis
LOG2 = ("grad_ratio", "resid_growth")
# and these per-module series as each stack's largest (``normprobe/summary/<series>/<stack>``)
STACK_MAX = ("attn_logit_max",)
# Custom Scalars charts of a per-block series: this many blocks spread over the depth, one chart
# each (TensorBoard colours a chart's lines by run, without a legend)
CHART_BLOCKS = 4
PROFILE_PLUGIN = "normprobe_profile"  # a depth profile, for `report`; TensorBoard shows none
# heatmaps keep at most this many logged steps (halved, keeping every other, when full)
HEATMAP_COLUMNS = 256
HEATMAP_MIN_COLUMNS = 4  # fewer logged steps say nothing a line chart does not
HISTORY = 32  # logged steps of each scalar kept to judge flags as the run goes
# the Images tab sorts tags by name: heatmaps are ranked, gradient norms first, per-head last
HEATMAP_ORDER = (
    ["grad_norm"]
    + [n for n, s in SERIES.items() if n != "grad_norm" and not s.heads]
    + [n for n, s in SERIES.items() if s.heads]
)
# a heatmap's colour bar: the metric and its unit
LABELS = {
    "grad_norm": "gradient L2 norm",
    "resid_rms": "residual stream RMS",
    "resid_cos": "cosine, stream in vs out",
    "outlier_ratio": "max |x| / median |x|",
    "outlier_channel": "channel of max |x|",
    "outlier_kurtosis": "kurtosis of channel RMS",
    "update_ratio": "|Δw| / |w| per step",
    "weight_rms": "parameter RMS",
    "attn_logits_head": "max |q·k|·scale",
    "attn_entropy_head": "attention entropy (nats)",
}


class TensorBoardSink:
    """Writes records to a `torch.utils.tensorboard.SummaryWriter`.

    * Scalars: plain tags (the Scalars and Time Series tabs).
    * Custom Scalars: the run's health summary first (the `LOG2` ratios as log2 and each
      stack's largest `STACK_MAX` value, under ``normprobe/summary/``, which this sink adds;
      non-finite outputs; the loss), then per series and stack a chart per block for
      `CHART_BLOCKS` blocks spread over the depth: one tag, a line per run, each.
    * Images: per stack and per-block series, a depth heatmap (block against step, titled with
      the run: the log dir's name; log-scale series with a second, shape panel): one image per
      series and stack each time it is drawn (about 30 KB), from `HEATMAP_MIN_COLUMNS` logged
      steps on, at most `HEATMAP_COLUMNS` columns, under `heatmap_tag` (gradient norms first).
      Per-head series (``attn_logits_head``) get one heads x blocks image per stack and
      position in the block (``attn``) of the latest logged step.
    * Heatmaps are drawn on a background thread from a copy of their columns, and written by
      the next `write`: training does not wait for them. Drawing is considered every
      ``heatmap_every`` records, and starts only when no drawing is under way and the budget
      allows: the first waits ``heatmap_seconds`` from the first record, and each next one
      both ``heatmap_seconds`` and ``c / heatmap_cpu`` after the last finished, where ``c`` is
      the CPU time it took (about 0.15 s an image: ten images, 1.5 s, then 150 s at 1%), so that
      drawing takes at most ``heatmap_cpu`` of the wall time. A run shorter than
      ``heatmap_seconds`` gets its heatmaps when the sink closes: `close` waits for a drawing
      under way and draws (on its own thread) those with columns added since.
    * Text: ``normprobe/flags/run``, what `normprobe report` would flag so far, problems then
      notes under bold headings, judged every ``heatmap_every`` records and at `close`, and
      rewritten when it changes.
    * The depth profiles themselves are stored for `report` in summaries TensorBoard does not
      display; ``depth_histograms=True`` also writes them as histograms whose buckets are the
      blocks (the Histograms tab's view, whose shared scale hides most of the story).

    Writing never waits for the disk: the writer's own thread flushes the file (every
    ``flush_secs`` for a writer made here), `flush` and `close` force it, and so does the
    interpreter's exit, also after an uncaught exception (which neither waits for a drawing
    under way nor writes it). Heatmaps need matplotlib
    (``normprobe[plot]``); without it they are skipped with one warning.

    Args:
        writer: an existing ``SummaryWriter``, or None to create one in ``log_dir``.
        log_dir: directory for a new writer (``runs/<date>`` when both are None).
        close_writer: close the writer on `close` (default: only when this sink created it).
        flush_secs: how often a writer made here flushes in the background.
        layout: write the custom-scalars layout with the first record (False: the directory
            holds it already, as when a run resumes).
        heatmap_every: judge the flags, and consider drawing the heatmaps, every this many
            records (0: neither, not even at `close`).
        heatmap_seconds: the heatmaps wait this long from the first record, and between two
            drawings.
        heatmap_cpu: the share of the wall time drawing may take, in (0, 1].
        depth_histograms: also write the depth profiles as histograms.
    """

    def __init__(
        self,
        writer: Any = None,
        log_dir: str | None = None,
        close_writer: bool | None = None,
        flush_secs: float = 1.0,
        layout: bool = True,
        heatmap_every: int = 10,
        heatmap_seconds: float = 60.0,
        heatmap_cpu: float = 0.01,
        depth_histograms: bool = False,
    ) -> None:
        if not 0 < heatmap_cpu <= 1:
            raise ValueError(
                f"heatmap_cpu={heatmap_cpu!r} is not a fraction of the wall time in (0, 1]: pass "
                "0.01 (the default) for drawing in 1% of it, or heatmap_every=0 for no heatmaps"
            )
        _use_fast_checksums()
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if log_dir is not None:
                check_log_dir(log_dir)
            writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)
            close_writer = True if close_writer is None else close_writer
        self.writer = writer
        self.close_writer = bool(close_writer)
        self.layout_written = not layout
        self.heatmap_every = heatmap_every
        self.heatmap_seconds = heatmap_seconds
        self.heatmap_cpu = heatmap_cpu
        self._next_render = math.inf  # when the heatmaps may be drawn next (time.monotonic)
        self._pending: Future[Rendered] | None = None  # the drawing in the background
        self._pending_step = 0  # the step it draws
        self.depth_histograms = depth_histograms
        self._records = 0
        self._last_step = 0
        self._profiles: dict[str, list[tuple[int, list[float]]]] = {}
        # (series, stack, layer) -> block -> the latest value of each head
        self._heads: dict[tuple[str, str, str], dict[int, list[float]]] = {}
        self._drawn_heads: set[tuple[str, str, str]] = set()
        self._drawn: set[str] = set()  # profiles drawn since their last new column
        self._history: dict[str, deque[tuple[int, float]]] = {}
        self._first: dict[str, tuple[int, float]] = {}
        self._texts: dict[str, list[tuple[int, str]]] = {}
        self._flags_text: str | None = None
        self._no_plots = False
        # at exit (or when this sink is collected): what is still queued reaches the disk
        self._at_exit = weakref.finalize(self, writer.flush)

    @property
    def log_dir(self) -> str:
        return str(self.writer.log_dir)

    def write(self, record: Record) -> None:
        if self._pending is not None:
            self._collect()
        if not self._records:  # the heatmaps' first drawing waits from the first record on
            self._next_render = time.monotonic() + self.heatmap_seconds
        if not self.layout_written:
            self.layout_written = True
            self.writer.add_custom_scalars(_layout(record.scalars))
        if record.scalars:
            # one event holding every scalar: hundreds of add_scalar calls cost more than a step
            summary = Summary()
            add = summary.value.add  # in place: a Value object per scalar costs twice as much
            for tag, value in record.scalars.items():
                add(tag=tag, simple_value=value)
            for tag, value in _companions(record.scalars).items():
                add(tag=tag, simple_value=value)
            self.writer._get_file_writer().add_summary(summary, record.step)
        if record.profiles:
            self.writer._get_file_writer().add_summary(
                _profile_summary(record.profiles), record.step
            )
        for tag, values in record.profiles.items():
            parsed = tags.parse(tag)
            series = SERIES.get(parsed.series) if parsed is not None else None
            if parsed is not None and series is not None and series.heads:
                self._keep_heads(parsed, values)
                continue
            if self.depth_histograms:
                _depth_histogram(self.writer, tag, values, record.step)
            self._keep_column(tag, record.step, values)
        for tag, text in record.texts.items():
            self.writer.add_text(tag, text, record.step)
            self._texts.setdefault(tag, []).append((record.step, text))
        self._remember(record)
        self._records += 1
        self._last_step = record.step
        if self.heatmap_every and self._records % self.heatmap_every == 0:
            self._judge_flags()
            self._start_render()

    def _keep_column(self, tag: str, step: int, values: list[float]) -> None:
        columns = self._profiles.setdefault(tag, [])
        columns.append((step, values))
        if len(columns) > HEATMAP_COLUMNS:
            del columns[1::2]  # every other step, the first and the newest kept
        self._drawn.discard(tag)

    def _keep_heads(self, tag: tags.Tag, values: list[float]) -> None:
        """The latest per-head vector of a module inside a block, for the heads x blocks
        picture of its stack and position (``blocks``, ``attn``)."""
        if tag.block is None:
            return
        key = (tag.series, tag.subject, tag.layer or "")
        self._heads.setdefault(key, {})[tag.block] = values
        self._drawn_heads.discard(key)

    def _remember(self, record: Record) -> None:
        step, history = record.step, self._history
        for tag, value in record.scalars.items():
            kept = history.get(tag)
            if kept is None:
                kept = history[tag] = deque(maxlen=HISTORY)
                self._first[tag] = (step, value)
            kept.append((step, value))

    def _judge_flags(self) -> None:
        """Rewrite the flags text if what `report` would flag changed."""
        from .metrics.core.run import flag_lines, run_flags

        scalars = {
            t: ([self._first[t]] if self._first[t][0] < h[0][0] else []) + list(h)
            for t, h in self._history.items()
        }
        flags = run_flags(scalars, self._texts)
        # markdown: a blank line between entries; headings in bold
        text = "\n\n".join(
            line.strip() if line.startswith(" ") else f"**{line}**" for line in flag_lines(flags)
        )
        if text != self._flags_text:
            self._flags_text = text
            self.writer.add_text(tags.format("flags", "run"), text, self._last_step)

    def _start_render(self, now: bool = False) -> None:
        """Draw the heatmaps with new columns on a background thread, if none is drawing and
        the budget allows (``now``: on this thread, whatever the budget); `_collect` writes
        them when done."""
        if self._no_plots or self._pending is not None:
            return
        if not now and time.monotonic() < self._next_render:
            return
        pictures = self._snapshot()
        if not pictures:
            return
        pending: Future[Rendered] = Future()
        pending.set_running_or_notify_cancel()

        def run() -> None:
            try:
                pending.set_result(_render(pictures))
            except BaseException as err:  # raised on the training thread by `_collect`
                pending.set_exception(err)

        self._pending, self._pending_step = pending, self._last_step
        if now:
            run()
        else:  # a daemon: an interpreter on its way out does not wait for a picture
            threading.Thread(target=run, name="normprobe-heatmaps", daemon=True).start()

    def _collect(self, wait: bool = False) -> None:
        """Write the heatmaps drawn in the background if they are done (``wait``: once they
        are), and schedule the next drawing by their CPU time."""
        pending = self._pending
        if pending is None or not (wait or pending.done()):
            return
        self._pending = None
        try:
            rendered = pending.result()
        except ImportError as err:
            self._no_plots = True
            warnings.warn(f"normprobe: no depth heatmaps: {err}", UserWarning, stacklevel=3)
            return
        self._write_images(rendered, self._pending_step)
        wait_s = max(self.heatmap_seconds, rendered.cpu_seconds / self.heatmap_cpu)
        self._next_render = rendered.finished + wait_s

    def _write_images(self, rendered: Rendered, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=t, image=image) for t, image in rendered.images])
        self.writer._get_file_writer().add_summary(summary, step)

    def _snapshot(self) -> list[Picture]:
        """The heatmaps with new columns since they were last drawn, with copies of their data
        (the sink keeps appending to and thinning its own lists)."""
        run = os.path.basename(os.path.normpath(self.log_dir))
        pictures = []
        for tag, columns in self._profiles.items():
            if tag in self._drawn or len(columns) < HEATMAP_MIN_COLUMNS:
                continue
            parsed = tags.parse(tag)
            if parsed is None:
                continue
            series = SERIES.get(parsed.series)
            log = series is None or series.scale == "log"
            pictures.append(
                Picture(
                    heatmap_tag(parsed.series, parsed.subject),
                    f"{run}: {parsed.series}, stack {parsed.subject}",
                    [s for s, _ in columns],
                    [v for _, v in columns],  # each step's list is never changed once kept
                    log=log,
                    label=LABELS.get(parsed.series, parsed.series),
                    shape=log,
                    marks_label="extra steps logged after a spike",
                )
            )
            self._drawn.add(tag)
        for key, by_block in self._heads.items():
            if key in self._drawn_heads:
                continue
            series_name, stack, layer = key
            blocks = sorted(by_block)
            pictures.append(
                Picture(
                    heatmap_tag(series_name, stack, layer),
                    f"{run}: {series_name}, stack {stack}, {layer} at step {self._last_step}",
                    blocks,
                    [by_block[b] for b in blocks],
                    log=True,
                    label=LABELS.get(series_name, series_name),
                    xlabel="block",
                    ylabel="head",
                )
            )
            self._drawn_heads.add(key)
        return pictures

    def flush(self) -> None:
        self._collect()
        self.writer.flush()

    def close(self) -> None:
        """Wait for the heatmaps being drawn, draw the ones with new columns since (here, on
        the closing thread), write the flags, and flush (and close) the writer."""
        self._at_exit.detach()
        self._collect(wait=True)
        if self._records and self.heatmap_every:
            self._judge_flags()
            self._start_render(now=True)
            self._collect()
        self.writer.flush()
        if self.close_writer:
            self.writer.close()


@dataclass(frozen=True)
class Picture:
    """One heatmap to draw: its tag, and `depth_heatmap`'s arguments (the x axis's marks are
    found by the drawing thread: `off_cadence` for the steps of a ``marks_label``)."""

    tag: str
    title: str
    steps: list[int]
    values: list[list[float]]
    log: bool
    label: str
    shape: bool = False
    marks_label: str = ""
    xlabel: str = "step"
    ylabel: str = "block"


@dataclass(frozen=True)
class Rendered:
    """What the drawing thread hands back: (tag, PNG) pairs, the CPU seconds it took and when
    it finished (`time.monotonic`)."""

    images: list[tuple[str, Summary.Image]]
    cpu_seconds: float
    finished: float


def _render(pictures: list[Picture]) -> Rendered:
    """Draw ``pictures`` as PNG-encoded TensorBoard images, timing the thread's CPU."""
    from .plots import depth_heatmap, off_cadence, png

    start = time.thread_time()
    images = []
    for p in pictures:
        rgb = depth_heatmap(
            p.title,
            p.steps,
            p.values,
            log=p.log,
            xlabel=p.xlabel,
            ylabel=p.ylabel,
            label=p.label,
            shape=p.shape,
            marks=off_cadence(p.steps) if p.marks_label else (),
            marks_label=p.marks_label,
        )
        height, width = rgb.shape[:2]
        image = Summary.Image(
            height=height, width=width, colorspace=3, encoded_image_string=png(rgb)
        )
        images.append((p.tag, image))
    return Rendered(images, time.thread_time() - start, time.monotonic())


def check_log_dir(
    path: str | os.PathLike[str], given_as: str = "log_dir", fix: str | None = None
) -> None:
    """Create ``path`` (a directory for event files) or raise an OSError naming it, the reason
    and ``fix``, the way out; ``given_as`` says where the path came from."""
    name = os.fspath(path)
    try:
        os.makedirs(name, exist_ok=True)
    except OSError as err:
        error, reason = _why_not(name, err)
    else:
        if os.access(name, os.W_OK | os.X_OK):
            return
        error, reason = PermissionError, "it is not writable (permission denied)"
    raise error(
        f"{given_as} {name!r} cannot hold TensorBoard event files: {reason}; "
        + (fix or f"pass a {given_as} in a directory you can write to")
    )


def _why_not(path: str, err: OSError) -> tuple[type[OSError], str]:
    """The error to raise for a directory ``makedirs`` could not make, and why."""
    blocking = path
    while blocking and not os.path.exists(blocking):
        blocking = os.path.dirname(blocking.rstrip(os.sep))
    if blocking and not os.path.isdir(blocking):
        return NotADirectoryError, f"{blocking!r} is a file, not a directory"
    return type(err), err.strerror or str(err)


def heatmap_tag(series: str, stack: str, layer: str = "") -> str:
    """The Images tab's tag of the heatmap of ``series`` over ``stack`` (per-head series: its
    ``layer`` in the blocks): ``normprobe/heatmap/<rank>_<series>/<stack>[/<layer>]``, ranked by
    `HEATMAP_ORDER` since TensorBoard sorts images by tag."""
    rank = HEATMAP_ORDER.index(series) if series in HEATMAP_ORDER else len(HEATMAP_ORDER)
    return tags.format("heatmap", f"{rank:02d}_{series}/{stack}" + (f"/{layer}" if layer else ""))


def _layout(scalars: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars dashboard: the summary, then the charts of each series and stack."""
    names = list(scalars)
    summary: dict[str, list[Any]] = {}
    for title, series in SUMMARY:
        if series in LOG2:
            summary[f"log2 {title} (0: even)"] = _chart(_summary_prefix(f"{series}_log2") + ".*")
        elif series in STACK_MAX:
            summary[f"{title} (each stack's largest)"] = _chart(_summary_prefix(series) + ".*")
        elif len(found := [t for t in names if t.startswith(tags.prefix(series))]) > 1:
            for tag in found:  # a chart per tag: NaN/Inf in outputs, in gradients
                subject = tag.removeprefix(tags.prefix(series))
                summary[f"{title}: {subject}"] = _chart(re.escape(tag))
        else:
            summary[title] = _chart(re.escape(tags.prefix(series)) + ".*")
    summary["loss"] = ["Multiline", [LOSS_REGEX]]
    categories: dict[str, dict[str, list[Any]]] = {f"{tags.PREFIX} summary": summary}
    for category, title, regex in charts(names):
        categories.setdefault(category, {})[title] = ["Multiline", [regex]]
    return categories


def _chart(regex: str) -> list[Any]:
    """A multi-line chart of the tags that ``regex`` matches whole."""
    return ["Multiline", [f"^{regex}$"]]


def _summary_prefix(name: str) -> str:
    return re.escape(tags.prefix("summary", name))


@functools.lru_cache(maxsize=1 << 14)
def _companion(tag: str) -> tuple[str, str] | None:
    """The summary tag ``tag``'s value goes to, and how: ``log2`` or ``max`` (over a stack)."""
    t = tags.parse(tag)
    if t is None:
        return None
    if t.series in LOG2 and t.block is None:
        return tags.format("summary", f"{t.series}_log2/{t.subject}"), "log2"
    if t.series in STACK_MAX:
        return tags.format("summary", f"{t.series}/{t.subject}"), "max"
    return None


def _companions(scalars: dict[str, float]) -> dict[str, float]:
    """The summary's own tags: log2 of the `LOG2` ratios, each stack's largest `STACK_MAX`."""
    out: dict[str, float] = {}
    for tag, value in scalars.items():
        found = _companion(tag)
        if found is None:
            continue
        name, how = found
        if how == "log2":
            out[name] = math.log2(value) if value > 0 and math.isfinite(value) else math.nan
        elif not value <= out.get(name, -math.inf):  # NaN and Inf win: they are the news
            out[name] = value
    return out


def _profile_summary(profiles: dict[str, list[float]]) -> Summary:
    """The depth profiles as float tensors under a plugin TensorBoard has no dashboard for."""
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_FLOAT

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PROFILE_PLUGIN))
    return Summary(
        value=[
            Summary.Value(
                tag=tag,
                metadata=metadata,
                tensor=TensorProto(
                    dtype=DT_FLOAT,
                    tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=len(values))]),
                    float_val=values,
                ),
            )
            for tag, values in profiles.items()
        ]
    )


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``, computed in C."""
    crc = int(google_crc32c.value(data))
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _use_fast_checksums() -> None:
    """Give TensorBoard's record writer `masked_crc32c`.

    Without TensorFlow, TensorBoard checksums every record in pure Python: about 1 ms per
    15 KB, in the writer's thread but holding the GIL, so a training loop logging a few hundred
    scalars a step waits for it. The C version gives the same checksums, bit for bit.
    """
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    if record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c:
        record_writer.masked_crc32c = masked_crc32c


def _depth_histogram(writer: Any, tag: str, values: list[float], step: int) -> None:
    """A histogram whose bucket i holds block i's value: the metric against depth."""
    finite = [v if v == v and abs(v) != float("inf") else 0.0 for v in values]
    if not finite:
        return
    # bucket i spans (i, i + 1]: every block gets the same width on the depth axis
    writer.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(finite)),
        num=float(sum(finite)),
        sum=float(sum((i + 0.5) * v for i, v in enumerate(finite))),
        sum_squares=float(sum((i + 0.5) ** 2 * v for i, v in enumerate(finite))),
        bucket_limits=[float(i + 1) for i in range(len(finite))],
        bucket_counts=finite,
        global_step=step,
    )


def charts(scalars: Iterable[str]) -> list[Chart]:
    """The custom-scalars charts of a record's tags, in the families' order: one per stack-wide
    or module tag, and per series and stack (and position within the blocks, for modules) one
    for each of `CHART_BLOCKS` blocks spread over the depth. Each chart holds one tag, a line
    per run: TensorBoard colours lines by run and shows no legend but the runs' list."""
    found: dict[tuple[str, str], str] = {}
    per_block: dict[tuple[str, str, str | None], dict[int, str]] = {}
    for tag in scalars:
        t = tags.parse(tag)
        if t is None or t.series == "summary":
            continue
        if t.block is None:
            found[(t.series, t.subject)] = "^" + re.escape(tag) + "$"
        else:
            per_block.setdefault((t.series, t.subject, t.layer), {})[t.block] = tag
    for (series, _, _), by_block in per_block.items():
        blocks = sorted(by_block)
        for k in spread(len(blocks), CHART_BLOCKS):
            tag = by_block[blocks[k]]
            found[(series, tag.split("/", 2)[2])] = "^" + re.escape(tag) + "$"
    order = {name: i for i, name in enumerate(SERIES)}
    ranked = sorted(found.items(), key=lambda item: order.get(item[0][0], len(order)))
    return [(f"{tags.PREFIX} {series}", title, regex) for (series, title), regex in ranked]
