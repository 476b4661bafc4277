"""Spike-triggered capture: a cheap detector of loss and gradient-norm spikes on every step.

Each step, on the device: the step's loss (when the probe sees one) and total gradient norm,
and each block's gradient norm (before any clipping; estimated from a sample of each large
gradient by default: `Spikes.sample`), are compared with their mean and standard deviation
over the last ``window`` steps, kept in a ring buffer on the device; a value above mean +
sigma std is a spike (OLMo's rule). Spike values enter the history like any other, so a
lasting shift is flagged for a few steps, not for good; NaN and Inf neither spike nor enter it
(``nonfinite`` reports them). The verdict goes to host memory by a copy nobody waits for
(pinned memory on CUDA) and is read on a later step, once the copy is done; on a CPU it is read
at once, at the spike's own step. Nothing is read back with ``.item()``: no host sync on the
step. A series has no spike before it has 16 steps of history (or ``window``, if fewer).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import probes, tags
from ..common import world_size
from ..metrics.core.base import Plan
from ..metrics.spikes import BlockRise, SpikeEvent, Watched
from ..sinks import Record, Sink
from .hooks import ProbeHook
from .spike_rule import HostRule, check

MIN_WINDOW = 8
TOP_BLOCKS = 3
# steps whose verdicts may be on their way to the host at once; past that, the oldest is waited
# for (the device is then that many steps behind the host: waiting costs it nothing)
SLOTS = 16
# entries read of each larger gradient tensor by default
SAMPLE = 4096


@dataclass(frozen=True)
class Spikes:
    """The spike detector's settings (``attach(spikes=...)``; ``spikes=None`` turns it off).

    Attributes:
        sigma: a value above mean + sigma std of its history is a spike.
        window: the history: the last this many steps (at least 8).
        capture: on a spike, log every metric for this many steps after it is found.
        sample: a gradient tensor of more than this many entries is estimated from about
            this many (runs of 16 at fixed positions spread over its rows and columns, scaled
            to its size: `normprobe.probes.SquareSums`); embedding tables are read whole. At
            4096, over 12 AdamW steps of a 12 x 256 MLP, TinyTransformers of width 64 to 256,
            a ResNet-18 and a 6-layer GPT-2, the total gradient norm stayed within 3% of the
            exact one and each block's within 10%; a rise confined to entries the sample
            skips goes unseen. None reads every entry.
    """

    sigma: float = 6.0
    window: int = 128
    capture: int = 10
    sample: int | None = SAMPLE

    def __post_init__(self) -> None:
        off = "or pass spikes=None to turn the detector off"
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, int | float):
            raise ValueError(f"Spikes(sigma={self.sigma!r}): sigma is a number, 6.0 by default")
        if not self.sigma > 0:
            raise ValueError(
                f"Spikes(sigma={self.sigma!r}): sigma must be positive (a spike is a value above "
                f"mean + sigma std; 6.0 by default), {off}"
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise ValueError(f"Spikes(window={self.window!r}): window is a number of steps")
        if self.window < MIN_WINDOW:
            raise ValueError(
                f"Spikes(window={self.window}): the history needs at least {MIN_WINDOW} steps "
                f"for a mean and std worth comparing against (128 by default), {off}"
            )
        if isinstance(self.capture, bool) or not isinstance(self.capture, int) or self.capture < 0:
            raise ValueError(
                f"Spikes(capture={self.capture!r}): capture is the number of steps to log after "
                "a spike, 0 or more (10 by default; 0 writes the spike alone)"
            )
        if self.sample is not None and (
            isinstance(self.sample, bool)
            or not isinstance(self.sample, int)
            or self.sample < probes.CHUNK
        ):
            raise ValueError(
                f"Spikes(sample={self.sample!r}): sample is the number of entries read of each "
                f"large gradient, at least {probes.CHUNK} ({SAMPLE} by default), or None to "
                "read every entry"
            )


DEFAULT_SPIKES = Spikes()


class SpikeDetector:
    """The history, the per-step check and the read-back of one probe's spike detector.

    Columns of the history: the loss, the total gradient norm (every trainable parameter),
    then each block's gradient norm. `observe_loss` takes the step's loss, `measure` the
    gradient norms before any clipping, `watch` checks the step before the optimizer step,
    `found` hands over the spikes whose verdicts have reached the host.
    """

    def __init__(
        self,
        spikes: Spikes,
        params: Sequence[nn.Parameter],
        blocks: Mapping[str, set[int]],
        tables: Sequence[bool] | None = None,
    ) -> None:
        """``tables``: which parameters are embedding tables, read whole (a step's gradient
        fills a few rows: a sample would mostly miss them)."""
        self.spikes = spikes
        self.params = list(params)
        self._tables = list(tables) if tables is not None else [False] * len(self.params)
        self.blocks = list(blocks)
        self.columns = 2 + len(self.blocks)
        # which parameters each gradient-norm column adds up: all of them, then each block's
        members = torch.zeros(1 + len(self.blocks), len(self.params))
        members[0] = 1.0
        for row, held in enumerate(blocks.values(), start=1):
            members[row, sorted(held)] = 1.0
        self._by_param = members.reshape(-1)  # flat, like every buffer here: viewed when used
        self._device: torch.device | None = None
        self._loss: torch.Tensor | None = None
        self._losses = 0
        self._explicit_loss = False
        self._checked = 0  # steps watched so far: the ring buffers' position
        self._measured = False  # the step's gradient norms are taken
        # each parameter's position by id in what `measure` reads, when it reads every gradient
        # whole (else None)
        self._positions: dict[int, int] | None = None
        # (step, host slot, the copy's CUDA event) of the verdicts not read yet
        self._pending: deque[tuple[int, int, torch.cuda.Event | None]] = deque()
        self._read_early: list[SpikeEvent] = []  # read to free their slot, not handed over yet

    @staticmethod
    def of(spikes: Spikes, model: nn.Module, plan: Plan) -> SpikeDetector | None:
        """A detector of ``model``'s trainable parameters and ``plan``'s blocks, or None when
        nothing trains."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return None
        index = {id(p): i for i, p in enumerate(params)}
        blocks = {}
        for stack in plan.stacks():
            name = plan.stack_name(stack.path)
            for b, members in enumerate(stack.members or tuple((m,) for m in stack.blocks)):
                held = {
                    index[id(p)]
                    for m in members
                    for p in plan.modules[m].parameters()
                    if id(p) in index
                }
                blocks[f"{name}/{tags.block_label(b, stack.depth)}"] = held
        tables = {
            id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
        }
        return SpikeDetector(spikes, params, blocks, [id(p) in tables for p in params])

    def observe_loss(self, loss: torch.Tensor, explicit: bool) -> None:
        """Add ``loss`` to the step's (several in a step, or a loss per sample, are averaged).
        The first ``explicit`` loss (`normprobe.Probe.observe_loss`) replaces what the model's
        output gave, from then on."""
        if explicit and not self._explicit_loss:
            self._explicit_loss = True
            self._loss, self._losses = None, 0
        elif self._explicit_loss and not explicit:
            return
        value = loss.detach().float()
        value = value if value.dim() == 0 else value.mean()
        self._loss = value if self._loss is None else self._loss + value
        self._losses += 1

    def measure(
        self, scale: torch.Tensor | None = None
    ) -> tuple[dict[int, int], torch.Tensor] | None:
        """Take the step's gradient norms from the gradients present now (complete and not
        clipped yet: at the end of the backward), divided by a loss scaler's ``scale``; the last
        measure before `watch` counts. Returns the squared norm of each parameter's gradient
        with each parameter's position in it by id, when every gradient was read whole."""
        device = self.params[0].device
        if self._device != device:
            self._allocate(device)
        with torch.no_grad():
            grads = [p.grad for p in self.params]
            if len(self._passes) == 1:  # one device: the list as it is
                squares = self._passes[0][1](grads)
            else:
                squares = torch.cat(
                    [s([grads[i] for i in at]).to(device) for at, s in self._passes]
                )
            torch.mv(self._members.view(self.columns - 1, -1), squares, out=self._sums)
            if scale is not None:
                self._sums.div_(scale.to(device) ** 2)
            torch.sqrt(self._sums, out=self._x[1:])
        self._measured = True
        return None if self._positions is None else (self._positions, squares)

    def unscale(self, scale: torch.Tensor) -> None:
        """Divide a loss scale found only at the step out of the gradient norms `measure`d."""
        if self._measured:
            with torch.no_grad():
                self._sums.div_(scale.to(self._sums.device) ** 2)
                torch.sqrt(self._sums, out=self._x[1:])

    def watch(self, step: int) -> None:
        """Check step ``step``'s loss and gradient norms (`measure`d now unless they were since
        the last check) against their history and send the verdict to the host."""
        if not self._measured:
            self.measure()
        x = self._x
        with torch.no_grad():
            if self._loss is None:
                x[0].fill_(math.nan)
            else:
                x[0].copy_(self._loss if self._losses == 1 else self._loss / self._losses)
            position = self._checked % self.spikes.window
            if self._host_rule is not None:
                self._host_rule(self._values, position)
            else:
                check(self._values, self._history, self._present, position, self.spikes)
        self._send(step)
        self._loss, self._losses = None, 0
        self._measured = False

    def found(self, wait: bool = False) -> list[SpikeEvent]:
        """The spikes among the checked steps whose verdicts have reached the host (all of
        them with ``wait``), in step order."""
        events, self._read_early = self._read_early, []
        while self._pending:
            copied = self._pending[0][2]
            if copied is not None and not copied.query():  # type: ignore[no-untyped-call]
                if not wait:
                    break
                copied.synchronize()
            events += self._read_oldest()
        return events

    # --------------------------------------------------------------------------------------------
    def _allocate(self, device: torch.device) -> None:
        """The passes over the gradients (one per device), the device buffers and the host
        rows; a model moved to another device starts a new history, once the verdicts still on
        their way are read.

        On a CPU the rule runs in Python floats (`HostRule`) on a numpy array that shares the
        row's memory: a dozen values cost less than a numpy call per operation.
        """
        window, columns = self.spikes.window, self.columns
        self._read_early += self.found(wait=True)
        self._device = device
        self._cuda = device.type == "cuda"
        on: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self.params):
            on.setdefault(p.device, []).append(i)
        self._passes = [
            (
                at,
                probes.SquareSums(
                    [self.params[i] for i in at],
                    self.spikes.sample,
                    [self._tables[i] for i in at],
                ),
            )
            for at in on.values()
        ]
        # the parameters in the order the passes give their sums
        order = [at[i] for at, squares in self._passes for i in squares.order]
        whole = not any(squares.runs for _, squares in self._passes)
        self._positions = {id(self.params[i]): j for j, i in enumerate(order)} if whole else None
        self._members = self._by_param.view(columns - 1, -1)[:, order].reshape(-1).to(device)
        self._sums = torch.empty(columns - 1, device=device)
        on_cpu = device.type == "cpu"
        self._host_rule = HostRule(self.spikes, columns) if on_cpu else None
        self._history = torch.zeros(0 if on_cpu else window * columns, device=device)
        self._present = torch.zeros_like(self._history)
        # what goes to the host each step: the two flags, then z, value, mean, history count
        size = 2 + 4 * columns
        if on_cpu:  # the rule's numpy array, the tensor that shares its memory
            self._values: Any = np.zeros(size, np.float32)
            self._row = torch.from_numpy(self._values)
        else:
            self._row = self._values = torch.zeros(size, device=device)
        self._x = self._row[2 + columns : 2 + 2 * columns]
        size = SLOTS * self._row.numel()
        if self._cuda:
            host = torch.empty(size, pin_memory=True)
            values = host.numpy()
        else:
            values = np.zeros(size, dtype=np.float32)
            host = torch.from_numpy(values)
        self._host = torch.split(host, self._row.numel())
        self._host_rows = values.reshape(SLOTS, -1)
        self._events = [torch.cuda.Event() for _ in range(SLOTS)] if self._cuda else []  # type: ignore[no-untyped-call]
        self._checked = 0

    def _send(self, step: int) -> None:
        """Copy the step's row to a host slot: on CUDA without waiting, read once its event
        has passed; elsewhere at once."""
        if len(self._pending) == SLOTS:  # the slot to write is the oldest one's: read it first
            copied = self._pending[0][2]
            if copied is not None:
                copied.synchronize()
            self._read_early += self._read_oldest()
        slot = self._checked % SLOTS
        self._host[slot].copy_(self._row, non_blocking=self._cuda)
        copied = None
        if self._cuda:
            copied = self._events[slot]
            copied.record()
        self._pending.append((step, slot, copied))
        self._checked += 1

    def _read_oldest(self) -> list[SpikeEvent]:
        step, slot, _ = self._pending.popleft()
        row = self._host_rows[slot]
        return [self._event(step, row)] if row[0] or row[1] else []

    def _event(self, step: int, row: Any) -> SpikeEvent:
        columns = self.columns
        z, x, mean, count = (row[2 + i * columns : 2 + (i + 1) * columns] for i in range(4))

        def watched(c: int) -> Watched:
            return Watched(float(x[c]), float(mean[c]), float(z[c]), int(count[c]), bool(row[c]))

        rises = np.nan_to_num(z[2:], nan=-np.inf, posinf=np.inf)
        top = [int(b) for b in np.argsort(-rises, kind="stable")[:TOP_BLOCKS] if rises[b] > 0]
        blocks = tuple(
            BlockRise(
                self.blocks[b],
                float(z[2 + b]),
                float(x[2 + b] / mean[2 + b]) if mean[2 + b] > 0 else math.inf,
            )
            for b in top
        )
        loss = watched(0) if math.isfinite(x[0]) else None
        return SpikeEvent(step, self.spikes.sigma, loss, watched(1), blocks)


class SpikeWatch:
    """A probe's detector at work: the loss it is handed (`observe_loss`) or reads off the
    model's training output (``.loss`` or ``["loss"]``), the check before each optimizer step,
    and the spikes written to the sinks, with the steps after each to log (`capture_until`)."""

    def __init__(
        self, detector: SpikeDetector, model: nn.Module, sinks: Sequence[Sink], read_output: bool
    ) -> None:
        self.detector = detector
        self.sinks = sinks
        self.capture_until = -1  # the last step a spike has logged
        self._warned = False
        self._output_hook = (
            model.register_forward_hook(ProbeHook(self._output_loss)) if read_output else None
        )

    @staticmethod
    def of(
        spikes: Spikes | None,
        model: nn.Module,
        plan: Plan,
        sinks: Sequence[Sink],
        read_output: bool,
    ) -> SpikeWatch | None:
        """The watch of ``model`` mapped by ``plan``, or None: ``spikes`` is None, nothing
        trains, or the model trains under torch.distributed (the ranks would have to agree on
        every step's verdict)."""
        if spikes is None or world_size() > 1:
            return None
        detector = SpikeDetector.of(spikes, model, plan)
        return None if detector is None else SpikeWatch(detector, model, sinks, read_output)

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._stop_reading_output()
        self.detector.observe_loss(loss, explicit=True)

    def _output_loss(self, module: nn.Module, args: Any, out: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation forward
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
            self.detector.observe_loss(loss, explicit=False)
        else:  # the model's training output carries no loss: stop looking for one
            self._stop_reading_output()

    def _stop_reading_output(self) -> None:
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def write(self, step: int, wait: bool = False) -> None:
        """Write the spikes whose verdicts reached the host (all of them with ``wait``), and
        log the ``capture`` steps after ``step``."""
        spikes = self.detector.spikes
        for event in self.detector.found(wait):
            if not wait:
                self.capture_until = max(self.capture_until, step + spikes.capture)
            for sink in self.sinks:
                sink.write(Record(event.step, scalars=event.scalars(), texts=event.texts()))
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"normprobe: {event.kind} at step {event.step} (z {event.z:.3g} > "
                    f"{spikes.sigma:g}): logging every metric for the next {spikes.capture} "
                    "steps; later spikes are written without a warning (normprobe/spike/* in "
                    "TensorBoard, flags in `normprobe report`)",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def remove(self, unwinding: bool) -> None:
        """Stop reading losses; write the last steps' verdicts unless an exception unwinds."""
        self._stop_reading_output()
        if not unwinding:
            self.write(-1, wait=True)
