"""``nonfinite``: where NaN or Inf first appears, in a forward and in its backward.

A NaN or Inf in a tensor makes its sum NaN or Inf, so one sum per tensor says whether it holds
one. A logged step sums the output and gradients of every module outside the stacks' blocks and
of each block as a whole (`Watched`; a block's output that is the residual stream other families
read, `Streams`, from its row norms; a block of several modules from its streams alone), not of
the modules inside blocks: where the first NaN/Inf
is a block's, the step names the block, and the next step, logged for it (`Plan.capture`), reads
that block's modules too and names the module, if the NaN/Inf is still there and still first.
A block whose backward made a NaN/Inf is narrowed down on its own step as well, by which of its
modules' parameter gradients are non-finite (one more transfer, on that step only).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from .. import probes, tags
from ..nested import iter_tensors
from .core.base import MODEL, PROBLEM, Family, Flag, Out, Plan, Run, Series, Side, Values
from .core.grads import GradSquares
from .core.streams import StreamRead, Streams, last_adds, readable
from .core.watched import JOIN, Watched, watch_units

Ranks = dict[torch.device, torch.Tensor]  # 0, 1, 2, ... on each device, made once
# what follows a block's path in the texts while its module is not known
BLOCK = " (block; module not localized yet)"
_ZERO = torch.zeros(())


class _OutputSums:
    """The finite sum of each module's (and unit's) output on a logged forward, in the order
    they ran (each one's first call); an output that is the residual stream other families
    read (`Streams`) is summed from its row norms once they are reduced (non-finite where its
    sum is, or at an entry past 1e19, whose square overflows)."""

    def __init__(self, units: Mapping[tuple[str, int], int]) -> None:
        self.units = units
        self.modules: list[int] = []  # the modules and units read, in the order they ran
        # the finite sum of each one's output, or the stream read it is summed from
        self.sums: list[torch.Tensor | StreamRead] = []
        self._seen: set[int] = set()
        self._last: tuple[Any, torch.Tensor | StreamRead] | None = None  # output read last
        self._stream: tuple[torch.Tensor, StreamRead] | None = None  # the stream read last

    def streamed(self, streams: Streams, stack: str, block: int, t: torch.Tensor) -> None:
        here = streams.reads[stack][-1]
        self._stream = (t, here)
        unit = self.units.get((stack, block))
        if unit is not None and unit not in self._seen:
            self._seen.add(unit)
            self.modules.append(unit)
            self.sums.append(here)

    def read(self, index: int, out: Any) -> None:
        if index in self._seen:
            return
        if isinstance(out, torch.Tensor):
            if not out.is_floating_point():
                return
            total = self._sum(out)
        else:
            floats = [t for _, t in iter_tensors(out) if t.is_floating_point()]
            if not floats:
                return
            total = probes.finite_sums(floats).sum()
        self._seen.add(index)
        self.modules.append(index)
        self.sums.append(total)

    def _sum(self, out: torch.Tensor) -> torch.Tensor | StreamRead:
        # a module that returns what its last child returned (read just before): summed once
        if self._last is not None and self._last[0] is out:
            return self._last[1]
        if self._stream is not None and probes.same_values(self._stream[0], out):
            total: torch.Tensor | StreamRead = self._stream[1]
        else:
            total = probes.finite_sum(out)
        self._last = (out, total)
        return total

    def values(self) -> list[torch.Tensor]:
        """The sums, those of streams too (a stream dropped unreduced, changed in place after
        its read, counts as finite)."""
        return [
            s if isinstance(s, torch.Tensor) else s.norms.sum() if s.norms is not None else _ZERO
            for s in self.sums
        ]

    def clear(self) -> None:
        self._seen.clear()
        self._last = None
        self._stream = None
        self.modules.clear()
        self.sums.clear()


class NonFinite(Family):
    name = "nonfinite"
    description = (
        "number of modules read whose output holds NaN or Inf, and the first of them in "
        "execution order; in backward, number of modules read whose input gradient holds NaN "
        "or Inf, and the first, in backward order, that made it from a finite received "
        "gradient (both warned once; backward: not on compiled models). A block counts as one "
        "module (a block of several, such as lns.3 + lins.3, is read from the residual streams "
        "around it): where it is the first, the next step is logged with its modules read, to "
        "name the module"
    )
    series = (Series("nonfinite", "model"),)

    def plan(self, plan: Plan) -> None:
        order: Ranks = {}
        # blocks of several modules are read from their streams (not on compiled models: their
        # graph would have to compare storages)
        streamed = {
            stack: [b for b, add in last.items() if readable(add)]
            for stack, last in last_adds(plan.model_map).items()
        }
        watched = Watched(plan, {} if plan.compiled else streamed)
        if watched.units:  # their gradients: those of the streams
            Streams.of(plan).watchers.append(partial(watch_units, plan, watched.units))
        self._plan_forward(plan, order, watched)
        self._plan_backward(plan, order, watched)

    def _plan_forward(self, plan: Plan, order: Ranks, watched: Watched) -> None:
        # per module and unit: its rank in execution order, or inf
        slot = plan.slot(watched.size, "min")
        outputs = _OutputSums(watched.units)
        warned = [False]
        streams: list[Streams | None] = []  # looked for at the first logged forward

        def publish() -> None:
            if outputs.sums:
                # the i-th read is the i-th to run: its rank if its output was not finite
                values = torch.stack(_on_first_device(outputs.values()))
                ranks = torch.where(torch.isfinite(values), math.inf, _ranks(order, values))
                plan.measured.put_at([slot.offset + i for i in outputs.modules], ranks)

        def start() -> None:
            if not streams:  # the families are planned: a block's stream is read if they asked
                # (not on compiled models: their graph would have to compare storages)
                streams.append(None if plan.compiled else plan.made("streams"))
                if streams[0] is not None:
                    streams[0].watchers.append(partial(outputs.streamed, streams[0]))
            outputs.clear()

        plan.at_forward_start(start)
        plan.at_flush(publish)
        plan.on_clear(outputs.clear)

        def record(values: Values, out: Out) -> None:
            ranks = values.measured(slot)
            bad = sorted((r, i) for i, r in ranks.items() if r != math.inf)
            out.scalar("nonfinite", "modules", float(len(bad)))
            watched.suspect("forward", bad[0][1] if bad else None)
            if not bad:
                return
            first = _place(plan, watched, bad[0][1], ranks, out.step)
            out.text("nonfinite", "first", first)
            if not warned[0] and out.writes:
                warned[0] = True
                warnings.warn(
                    f"normprobe: NaN/Inf first appeared in the output of {first} "
                    f"at step {out.step} ({len(bad)} modules read affected)",
                    RuntimeWarning,
                    stacklevel=2,
                )

        plan.read_outputs(outputs.read)
        plan.on_record(record)

    def _plan_backward(self, plan: Plan, order: Ranks, watched: Watched) -> None:
        """Per module, the finite sums of its input gradients (each tensor's, accumulated over
        its consumers) and of the gradients its outputs received. At flush, a module whose input
        gradient is non-finite gets its rank in the order input gradients completed if what it
        received was finite (it made the NaN/Inf), else ``watched.size`` (it passed one on); inf
        if its input gradient is finite. Modules called with one tensor complete together, the
        first called (the outermost) first. As input gradients are accumulated, a module called
        with a tensor that an operation outside it also reads (the skip path, a sibling's
        input) is named when that operation made the NaN/Inf and no module around it was called
        with the same tensor."""
        spread = float(watched.size)
        slot = plan.slot(watched.size, "min")
        grads = GradSquares.of(plan)
        sums: list[torch.Tensor] = []  # the finite sum of each gradient, as they complete
        # by module, the positions in ``sums`` of its gradients; inputs in the order their
        # gradient completed (a module's last one)
        inputs: dict[int, list[int]] = {}
        outputs: dict[int, list[int]] = {}
        warned = [False]

        def read(modules: Sequence[tuple[int, Side]], grad: torch.Tensor) -> None:
            position = len(sums)
            sums.append(probes.finite_sum(grad))
            for index, side in modules:
                if side == "input":
                    inputs[index] = [*inputs.pop(index, []), position]
                else:
                    outputs.setdefault(index, []).append(position)

        def publish() -> None:
            if not inputs:
                return
            values = torch.stack(_on_first_device(sums))
            given = _group_sums(values, list(inputs.values()))
            received = _group_sums(values, [outputs.get(i, []) for i in inputs])
            made = torch.where(torch.isfinite(received), _ranks(order, given), spread)
            ranks = torch.where(torch.isfinite(given), math.inf, made)
            plan.measured.put_at([slot.offset + i for i in inputs], ranks)

        def clear() -> None:
            sums.clear()
            inputs.clear()
            outputs.clear()

        def record(values: Values, out: Out) -> None:
            ranks = values.measured(slot)
            if not ranks:
                return  # no backward of the step's forward
            bad = sorted((r, i) for i, r in ranks.items() if r != math.inf)
            out.scalar("nonfinite", "backward_modules", float(len(bad)))
            made = bad[0][1] if bad and bad[0][0] < spread else None
            watched.suspect("backward", made)
            if made is None:
                return  # finite, or non-finite where it entered: from the loss or the forward
            first = _place(plan, watched, made, ranks, out.step)
            narrowed = ""
            if made in watched.inside and not watched.localized(made, ranks):
                narrowed = _by_parameter_gradients(plan, grads, watched.inside[made])
            out.text("nonfinite", "first_backward", first + narrowed)
            if not warned[0] and out.writes:
                warned[0] = True
                warnings.warn(
                    f"normprobe: NaN/Inf first appeared in backward in the input gradient of "
                    f"{first} at step {out.step}, from a finite gradient at its output "
                    f"({len(bad)} read modules' input gradients affected){narrowed}",
                    RuntimeWarning,
                    stacklevel=2,
                )

        plan.read_gradients(read)
        plan.at_forward_start(clear)
        plan.at_flush(publish)
        plan.on_clear(clear)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        return _forward_flags(run) + _backward_flags(run)


def _place(
    plan: Plan, watched: Watched, index: int, measured: Mapping[int, float], step: int
) -> str:
    """Module (or unit) ``index``'s path; a block's whose modules were not read gets `BLOCK`,
    and the next step is logged to read them."""
    path = watched.name(index)
    if watched.localized(index, measured):
        return path
    plan.capture(step + 1)
    return path + BLOCK


def _by_parameter_gradients(plan: Plan, grads: GradSquares, inner: Sequence[int]) -> str:
    """Where a block's backward made a NaN/Inf, by its modules' parameter gradients as they were
    before any clipping (`GradSquares`: clipping by a non-finite total makes every gradient
    NaN): not finite in the modules that run before that place, finite in those after it, in
    the order modules are defined; the last module whose parameter gradients are not finite,
    and the next one whose are. Read back at once: a second transfer, on the step that found
    it."""
    if grads.squares is None:
        return ""
    held: list[tuple[str, int]] = []  # (path, number of gradients)
    picks: list[int] = []
    for i in inner:
        path = plan.modules_in_order[i]
        own = [
            grads.position[id(p)]
            for p in plan.modules[path].parameters(recurse=False)
            if id(p) in grads.position
        ]
        if own:
            held.append((path, len(own)))
            picks += own
    if not held:
        return ""
    squares = grads.squares[torch.tensor(picks, device=grads.squares.device)]
    sums = iter(squares.tolist())
    finite = [all([math.isfinite(next(sums)) for _ in range(n)]) for _, n in held]
    last = max((k for k, ok in enumerate(finite) if not ok), default=None)
    if last is None:
        return "; its parameter gradients are finite"
    after = next((held[k][0] for k in range(last + 1, len(held)) if finite[k]), None)
    return f"; parameter gradients not finite in {held[last][0]}" + (
        f", finite in {after}" if after else ""
    )


def _ranks(order: Ranks, like: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... as many as ``like`` holds, on its device."""
    device = like.device
    if device not in order or len(order[device]) < len(like):
        order[device] = torch.arange(len(like), dtype=torch.float32, device=device)
    return order[device][: len(like)]


def _group_sums(values: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """The sum of ``values`` at each group's positions (0 for an empty group)."""
    members = [p for group in groups for p in group]
    out = values.new_zeros(len(groups))
    if not members:
        return out
    owner = [g for g, group in enumerate(groups) for _ in group]
    device = values.device
    index = torch.tensor(members, device=device)
    return out.index_add_(0, torch.tensor(owner, device=device), values[index])


def _on_first_device(values: list[torch.Tensor]) -> list[torch.Tensor]:
    device = values[0].device
    return [v if v.device == device else v.to(device) for v in values]


def _forward_flags(run: Run) -> list[Flag]:
    series = run.scalars.get(tags.format("nonfinite", "modules"), [])
    onset = next(((s, v) for s, v in series if v > 0 or not math.isfinite(v)), None)
    if onset is None:
        return []
    step, count = onset
    texts = run.texts.get(tags.format("nonfinite", "first"), [])
    first = _localized(texts, step)
    where = f"first in the output of {first}" if first else "module not recorded"
    return [
        Flag(
            "nan onset",
            MODEL,
            step,
            count,
            0.0,
            f"NaN/Inf in {count:g} module outputs read, {where}; check the learning rate, the "
            "data of that step and fp16 overflow (earlier logged steps were finite)",
            PROBLEM,
        )
    ]


def _localized(texts: list[tuple[int, str]], step: int) -> str | None:
    """The place named at ``step``; for a block, the module inside it the next logged step
    named, if it did."""
    later = [(s, text) for s, text in texts if s >= step]
    if not later or later[0][0] != step:
        return None
    first = later[0][1]
    if BLOCK not in first:
        return first
    block = first[: first.index(BLOCK)]
    inside = len(later) > 1 and any(
        (later[1][1] + ".").startswith(module + ".") for module in block.split(JOIN)
    )
    if inside and BLOCK not in later[1][1]:
        return f"{later[1][1]} (block {block} at step {step}, the module at step {later[1][0]})"
    return first


def _backward_flags(run: Run) -> list[Flag]:
    """The first logged step whose backward made a NaN/Inf in a module (a gradient that was
    already non-finite where it entered the model is the loss's or the forward's)."""
    texts = run.texts.get(tags.format("nonfinite", "first_backward"), [])
    if not texts:
        return []
    step = texts[0][0]
    first = _localized(texts, step)
    counts = dict(run.scalars.get(tags.format("nonfinite", "backward_modules"), []))
    count = counts.get(step, math.nan)
    return [
        Flag(
            "nan onset in backward",
            MODEL,
            step,
            count,
            0.0,
            f"the gradient turned NaN/Inf in the backward of {first} (finite at its output, "
            f"not at its input; {count:g} read modules' input gradients affected); check its "
            "operations whose derivative is infinite where the forward is finite (sqrt, pow, "
            "log, division near zero) and fp16 overflow of gradients",
            PROBLEM,
        )
    ]
