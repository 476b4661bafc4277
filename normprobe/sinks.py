"""Where logged statistics go: a `Sink` receives each logged step's `Record`.

`TensorBoardSink` writes event files (scalars, a custom-scalars layout, depth profiles);
`MemorySink` keeps the records in a list, for tests and notebooks. Any object with the
`Sink` methods can be passed to ``attach(..., sinks=[...])``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import google_crc32c
from tensorboard.compat.proto.summary_pb2 import Summary

from . import tags
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
    """

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


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


class TensorBoardSink:
    """Writes records to a `torch.utils.tensorboard.SummaryWriter`.

    Scalars become plain tags; the layout becomes a custom-scalars dashboard with one multi-line
    chart per metric family and stack; each depth profile becomes a histogram whose buckets are
    the block indices (Histograms tab: metric against depth, one slice per logged step).

    Writing never waits for the disk: the writer's own thread flushes the file (every
    ``flush_secs`` for a writer made here), `flush` and `close` force it, and so does the
    interpreter's exit, also after an uncaught exception.

    Args:
        writer: an existing ``SummaryWriter``, or None to create one in ``log_dir``.
        log_dir: directory for a new writer (``runs/<date>`` when both are None).
        close_writer: close the writer on `close` (default: only when this sink created it).
        flush_secs: how often a writer made here flushes in the background.
        layout: write the custom-scalars layout with the first record (False: the directory
            holds it already, as when a run resumes).
    """

    def __init__(
        self,
        writer: Any = None,
        log_dir: str | None = None,
        close_writer: bool | None = None,
        flush_secs: float = 1.0,
        layout: bool = True,
    ) -> None:
        _use_fast_checksums()
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)
            close_writer = True if close_writer is None else close_writer
        self.writer = writer
        self.close_writer = bool(close_writer)
        self.layout_written = not layout
        # at exit (or when this sink is collected): what is still queued reaches the disk
        self._at_exit = weakref.finalize(self, writer.flush)

    @property
    def log_dir(self) -> str:
        return str(self.writer.log_dir)

    def write(self, record: Record) -> None:
        if not self.layout_written:
            self.layout_written = True
            categories: dict[str, dict[str, list[Any]]] = {}
            for category, title, regex in charts(record.scalars):
                categories.setdefault(category, {})[title] = ["Multiline", [regex]]
            if categories:
                self.writer.add_custom_scalars(categories)
        if record.scalars:
            # one event holding every scalar: hundreds of add_scalar calls cost more than a step
            summary = Summary(
                value=[Summary.Value(tag=t, simple_value=v) for t, v in record.scalars.items()]
            )
            self.writer._get_file_writer().add_summary(summary, record.step)
        for tag, values in record.profiles.items():
            _depth_histogram(self.writer, tag, values, record.step)
        for tag, text in record.texts.items():
            self.writer.add_text(tag, text, record.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self._at_exit.detach()
        self.writer.flush()
        if self.close_writer:
            self.writer.close()


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
    """The custom-scalars charts of a record's tags: one multi-line chart per series and stack
    (per position within the stack's blocks for modules), in the families' order."""
    found: dict[tuple[str, str], str] = {}
    for tag in scalars:
        t = tags.parse(tag)
        if t is None:
            continue
        stack = tags.format(t.series, t.subject)
        if t.block is not None and t.layer is None:  # .../<stack>/<block>
            found[(t.series, t.subject)] = "^" + re.escape(stack) + r"/[^/]+$"
        elif t.block is not None:  # .../<stack>/<block>.<layer>
            layer = re.escape(t.layer or "")
            found[(t.series, f"{t.subject} {t.layer}")] = f"^{re.escape(stack)}/\\d+\\.{layer}$"
        else:
            found[(t.series, t.subject)] = "^" + re.escape(tag) + "$"
    order = {name: i for i, name in enumerate(SERIES)}
    ranked = sorted(found.items(), key=lambda item: order.get(item[0][0], len(order)))
    return [(f"{tags.PREFIX} {series}", title, regex) for (series, title), regex in ranked]
