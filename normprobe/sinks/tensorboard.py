"""`TensorBoardSink`: records into TensorBoard event files."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary

from .. import tags
from ..metrics import SERIES
from .heatmaps import Picture, Rendered, render
from .log_dir import check_log_dir
from .record import Record
from .scalars import ScalarSummaries
from .summaries import (
    HEATMAP_COLUMNS,
    HEATMAP_MIN_COLUMNS,
    HISTORY,
    LABELS,
    ProfileSummaries,
    custom_scalars_layout,
    depth_histogram,
    heatmap_tag,
    use_fast_checksums,
    write_summary,
)


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
      notes under bold headings, judged every ``heatmap_every`` records (within the same
      ``heatmap_cpu`` share of the wall time as the heatmaps) and at `close`, and rewritten when
      it changes.
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
        use_fast_checksums()
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
        self._next_judge = 0.0  # when the flags may be judged next (likewise)
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
        self._scalar_summaries = ScalarSummaries()
        self._profile_summaries = ProfileSummaries()
        # the flags' history: each tag's last HISTORY (step, value) and its first, folded in
        # from the records not folded yet when the flags are judged
        self._history: dict[str, deque[tuple[int, float]]] = {}
        self._first: dict[str, tuple[int, float]] = {}
        self._unfolded: list[tuple[int, dict[str, float]]] = []
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
            self.writer.add_custom_scalars(custom_scalars_layout(record.scalars))
        # one event holding every scalar and depth profile of the step (serialized Summaries
        # joined are one Summary: their values in a row)
        summary = self._scalar_summaries.serialized(record.scalars) if record.scalars else b""
        if record.profiles:
            summary += self._profile_summaries.serialized(record.profiles)
            self._keep_profiles(record)
        if summary:
            write_summary(self.writer, summary, record.step)
        for tag, text in record.texts.items():
            self.writer.add_text(tag, text, record.step)
            self._texts.setdefault(tag, []).append((record.step, text))
        self._remember(record)
        self._records += 1
        self._last_step = record.step
        if self.heatmap_every and self._records % self.heatmap_every == 0:
            if time.monotonic() >= self._next_judge:
                self._judge_flags()
            self._start_render()

    def _keep_profiles(self, record: Record) -> None:
        """The depth profiles' columns kept for the heatmaps (and their histograms)."""
        for tag, values in record.profiles.items():
            parsed = tags.parse(tag)
            series = SERIES.get(parsed.series) if parsed is not None else None
            if parsed is not None and series is not None and series.heads:
                self._keep_heads(parsed, values)
                continue
            if self.depth_histograms:
                depth_histogram(self.writer, tag, values, record.step)
            self._keep_column(tag, record.step, values)

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
        self._unfolded.append((record.step, record.scalars))
        if len(self._unfolded) >= 4 * HISTORY:
            self._fold()

    def _fold(self) -> None:
        """Fold the records kept since the last fold into `_first` and `_history`."""
        records, self._unfolded = self._unfolded, []
        if not records:
            return
        first = self._first
        for step, scalars in records:
            if not scalars.keys() <= first.keys():
                for tag in scalars.keys() - first.keys():
                    first[tag] = (step, scalars[tag])
        # a tag in each of the last HISTORY records: those alone; any other: its every value
        recent = records[-HISTORY:]
        everywhere = set(recent[0][1]).intersection(*(scalars for _, scalars in recent[1:]))
        steps = [step for step, _ in recent]
        for tag in everywhere:  # a column at a time
            self._kept(tag).extend(zip(steps, [scalars[tag] for _, scalars in recent], strict=True))
        for step, scalars in records:
            if not scalars.keys() <= everywhere:
                for tag, value in scalars.items():
                    if tag not in everywhere:
                        self._kept(tag).append((step, value))

    def _kept(self, tag: str) -> deque[tuple[int, float]]:
        kept = self._history.get(tag)
        if kept is None:
            kept = self._history[tag] = deque(maxlen=HISTORY)
        return kept

    def _judge_flags(self) -> None:
        """Rewrite the flags text if what `report` would flag changed; the next judging waits
        until this one's CPU time is ``heatmap_cpu`` of the wall time since (on a run of many
        fast logged steps and hundreds of tags, a judging can cost more than a step)."""
        from ..metrics.core.run import flag_lines, run_flags

        started = time.thread_time()
        self._fold()
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
        spent = time.thread_time() - started
        self._next_judge = time.monotonic() + spent / self.heatmap_cpu

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
                pending.set_result(render(pictures))
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
