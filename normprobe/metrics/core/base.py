"""What a metric family is, and the interfaces it works through.

A family (one file in this package) declares its name, what it measures, the series it writes
and how `report` reduces each over blocks; its `Family.plan` asks the runtime for reads and
slots through `Plan`, and turns the host values of a logged step into tags through `Out`; its
`Family.flags` reads a finished run back (`Run`). Thresholds live beside the code that uses
them, in the family's file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from ...discovery import Attention, ModelMap, NormLayer, Stack
from ...tags import Tag
from ...tags import format as format_tag
from .attention import AttentionInputs

Reduce = Literal["mean", "rms", "max", "min", "sum"]
Reader = Callable[[torch.Tensor], None]
AttentionReader = Callable[[AttentionInputs], None]
Side = Literal["input", "output"]  # which gradients of a module: w.r.t. its inputs or outputs
# (the modules a tensor belongs to, each as (index in ``modules()``, side), its gradient)
GradientReader = Callable[[Sequence[tuple[int, Side]], torch.Tensor], None]
# how `report` turns a series into one number per step and stack
RowReduce = Literal["last", "deep", "mean", "max", "value", "none"]
Shape = Literal["block", "stack", "module", "model"]


@dataclass(frozen=True)
class Series:
    """One series of tags a family writes.

    Attributes:
        name: the series, the second segment of its tags (`normprobe.tags`).
        shape: ``block`` (``<stack>/<block>``), ``stack`` (``<stack>``), ``module``
            (``<stack>/<block>.<layer>`` or a path) or ``model`` (a statistic's name).
        row: how `report` reduces it to one value per step and stack: the ``last`` block,
            the ``deep`` half's mean, the ``mean`` or ``max`` over blocks or modules, the
            one ``value``, or ``none``: no row (an index, or a value another row shows).
        first_block: per-block series: the first block that has a value (``resid_cos``: 1,
            block 0 has no predecessor).
        scale: how its depth heatmap colours values: ``log`` for norms and ratios, ``linear``
            for values near one another (cosines).
        heads: per-module series: a vector of one value per attention head (`Out.vector`),
            drawn as a heads x blocks heatmap per stack.
    """

    name: str
    shape: Shape
    row: RowReduce = "value"
    first_block: int = 0
    scale: Literal["log", "linear"] = "log"
    heads: bool = False


@dataclass(frozen=True)
class Slot:
    """Where one statistic lives in a logged step's packed vector, and how ranks combine it."""

    offset: int
    size: int
    reduce: Reduce


class Measured(Protocol):
    """The device tensors a logged step has measured so far."""

    def put(self, slot: Slot, value: torch.Tensor) -> None:
        """The whole slot (a scalar, or ``slot.size`` values)."""

    def put_max(self, slot: Slot, value: torch.Tensor) -> None:
        """A scalar slot: the maximum of what is put there during the step."""

    def put_at(self, positions: Sequence[int], values: torch.Tensor) -> None:
        """``values[i]`` at absolute position ``positions[i]`` of the packed vector."""


class Holdings(Protocol):
    """Where this rank holds the parameters' gradients and weights: the tensors the families
    read for a list of parameters (in its order), and each one's share of a sum over ranks.

    By default a parameter's own ``.grad`` and the parameter; under DeepSpeed ZeRO the part
    of each that the optimizer keeps on this rank (`normprobe.runtime.zero`).
    """

    partitioned: bool  # each rank holds a part of every parameter's gradient: sum over ranks

    def grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient of each parameter as this rank holds it (None: none here)."""

    def weights(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The weights of each parameter as this rank holds them."""

    def shares(self, params: Sequence[torch.Tensor]) -> list[float]:
        """The weight of each of `weights` in a sum over ranks."""


class Plan(Protocol):
    """What a family asks of the runtime when a probe is installed on a mapped model."""

    model_map: ModelMap
    modules: Mapping[str, nn.Module]
    modules_in_order: Sequence[str]  # every module's path, in ``model.modules()`` order
    # a pipeline stage: (its index, the number of stages), else None; and the global number of
    # each stack's first block held here, by path (0 but on a pipeline's later stages)
    pipeline: tuple[int, int] | None
    first: Mapping[str, int]
    norms: Sequence[NormLayer]  # the norm layers measured (at most max_block_tags per position)
    attention: Sequence[Attention]  # likewise for attention modules
    param_reduce: Reduce  # "mean", or "sum" when every rank holds a shard of the parameters
    holdings: Holdings  # the tensors that hold the parameters' gradients and weights here
    compiled: bool  # the hooks stay registered and must not change a compiled graph
    measured: Measured
    # while `on_gradients` callbacks run: the loss scale the gradients carry (a GradScaler's,
    # on the device), else None
    grad_scale: torch.Tensor | None
    # while `on_gradients` callbacks run: the squared norm of every trainable parameter's
    # gradient read whole just now (float32, the loss scale not divided out), with each
    # parameter's position in it by id (the spike detector's), else None
    grad_squares_read: tuple[Mapping[int, int], torch.Tensor] | None
    # while `before_step` callbacks run: a loss scale the gradients read by this step's
    # `on_gradients` callbacks still carried, found only at the step (a GradScaler stepping the
    # optimizer that was not handed to attach), else None
    late_scale: torch.Tensor | None
    # the `on_gradients` callbacks of this step read the gradients before any clipping and
    # `before_step` ones see them after it (False: both see the same gradients)
    clipping_visible: bool
    # the norm a trainer clips the total gradient to where the clipped gradients are not seen
    # (Lightning clips after its last hook before the step), when it clips every trainable
    # parameter by their total norm; else None
    clip_norm: float | None

    def slot(self, size: int, reduce: Reduce) -> Slot: ...

    def read(
        self,
        module: str,
        hook: Literal["pre", "post"],
        action: Reader,
        *,
        call: int | None = 0,
        key: tuple[str | int, ...] | None = None,
    ) -> None:
        """Hand ``action`` a tensor at a module boundary on the given call of a logged forward
        (None: on every call): the one at ``key`` of its inputs (pre) or output (post), else the
        first float one."""

    def read_add(self, module: str, call: int, index: int, action: Reader) -> None:
        """Hand ``action`` the result of the ``index``-th tensor add inside ``module``."""

    def read_attention(
        self, module: str, action: AttentionReader, *, logit_max: bool = False
    ) -> None:
        """Hand ``action`` the `AttentionInputs` of each attention product ``module`` forms on
        a logged forward. ``logit_max``: the action reads `AttentionInputs.logit_max` (eager
        attention takes it as the logits form, before a mask overwrites them: only when a
        reader asks)."""

    def head_slots(self, module: str, reduce: Reduce) -> tuple[Slot, Slot]:
        """A new slot of one value per query head of attention ``module``, and the part of it
        this rank computes (all of it unless tensor parallelism splits the heads)."""

    def read_outputs(self, action: Callable[[int, Any], None]) -> None:
        """Hand ``action(index, output)`` every module's output (index: in ``modules()``)."""

    def read_gradients(self, action: GradientReader) -> None:
        """Hand ``action(modules, grad)`` the gradients in the backward of a logged forward of
        every tensor a module was called with or returned, as they become complete, with the
        modules it belongs to: ``(index, side)``, index in ``modules()``, side ``input`` (the
        accumulated gradient of a tensor the module was called with) or ``output`` (that of a
        tensor it returned). A tensor one module returns and the next takes comes once.
        Not on compiled models (`compiled`): tensor hooks would break their graph."""

    def watch_gradient(self, index: int, side: Side, tensor: torch.Tensor) -> None:
        """During a logged forward, hand `read_gradients` actions ``tensor``'s gradient in its
        backward as ``(index, side)``'s, where ``index`` may be past ``modules()`` (a unit a
        family defines: a block of several modules). Not on compiled models."""

    def select_modules(self, indices: frozenset[int] | None) -> None:
        """From the next logged forward on, hand `read_outputs` and `read_gradients` actions
        the modules at these indices in ``modules()`` alone (None: every module). Not on
        compiled models (`compiled`): their hooks must not change."""

    def capture(self, step: int) -> None:
        """Log every step up to ``step`` (a finding to look at closer on the next step)."""

    def at_forward_start(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a logged forward starts: a step's last forward is the one that counts."""

    def at_forward_end(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a logged forward ends (also one that raised)."""

    def on_gradients(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a logged step where its gradients are complete and not clipped yet:
        at the end of each backward through the model's output (the step's last one counts),
        or before the optimizer step when none ended there; divide squares by `grad_scale`
        squared."""

    def before_step(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a logged step before the optimizer step (gradients are complete, and
        clipped if the trainer clips)."""

    def after_step(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a logged step after the optimizer step."""

    def at_flush(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before a logged step's values are packed."""

    def on_clear(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when what the step measured is dropped (written, or lost to an error)."""

    def on_record(self, fn: Callable[[Values, Out], None]) -> None:
        """Run ``fn`` with the step's host values to write its tags."""

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """One object per probe under ``key``, made on first use: reads two families share."""

    def made(self, key: str) -> Any:
        """What `shared` made under ``key`` when the families were planned, or None."""

    def stacks(self) -> Sequence[Stack]:
        """The stacks whose blocks have weights of their own (not a block run N times)."""

    def module_tag(self, path: str) -> str:
        """A module's subject in tags: ``<stack>/<block>.<layer>`` inside a block, else its
        path (`normprobe.tags`)."""

    def stack_name(self, path: str) -> str:
        """A stack's subject in tags."""


class Values(Protocol):
    """A logged step's values on the host."""

    validation: bool  # the values of a validation forward (BatchNorm only)

    def get(self, slot: Slot) -> list[float] | None:
        """The slot's values, or None when it was not measured on this step."""

    def measured(self, slot: Slot) -> dict[int, float]:
        """The values of the slot's positions that were measured, by index in the slot."""


class Out(Protocol):
    """A logged step's tags, as a family writes them."""

    step: int
    writes: bool  # this process writes (global rank zero): warn here, once

    def scalar(self, series: str, subject: str, value: float) -> None:
        """One scalar, tagged ``normprobe/<series>/<subject>``."""

    def text(self, series: str, subject: str, text: str) -> None: ...

    def per_block(self, series: str, stack: str, values: Mapping[int, float]) -> None:
        """A per-block series of a stack: tags for up to max_block_tags evenly spread blocks,
        and the depth profile (one value per block, NaN where none was measured)."""

    def vector(self, series: str, subject: str, values: Sequence[float]) -> None:
        """Several values of one subject (a module's heads), stored like a depth profile under
        ``normprobe/<series>/<subject>``: in the record's profiles, not as scalars."""


Severity = Literal["problem", "note"]
PROBLEM: Severity = "problem"  # worth stopping the run for: `normprobe report` exits 1
NOTE: Severity = "note"  # worth a look; healthy runs raise these too (exit status 0)


@dataclass(frozen=True)
class Flag:
    """Something in a run that crossed a threshold.

    Attributes:
        kind: ``residual growth``, ``residual jump``, ``representation collapse``, ``nan
            onset``, ``nan onset in backward``, ``batchnorm drift``, ``logit blow-up``,
            ``top-heavy gradients``, ``bottom-heavy gradients``, ``update too large``,
            ``massive activations``, ``loss spike`` or ``gradient spike``.
        stack: the stack (or ``"model"``) it concerns.
        step: the logged step the evidence comes from.
        value: the measured value that crossed ``threshold``.
        threshold: the limit it was compared against (a constant of the family's file).
        message: the evidence and a suggestion, in a sentence or two.
        severity: ``problem`` (no healthy run of the calibration set raises it:
            ``benchmarks/calibration.py``) or ``note`` (worth a look, healthy runs may).
    """

    kind: str
    stack: str
    step: int
    value: float
    threshold: float
    message: str
    severity: Severity

    def __str__(self) -> str:
        return f"[{self.kind}] {self.stack} at step {self.step}: {self.message}"


Points = list[tuple[int, float]]
MODEL = "model"  # the report's group of tags that belong to no stack (logits, ln_f, nonfinite)


@dataclass(frozen=True)
class RunTag:
    """A tag of a run as `report` groups it: by stack (or `MODEL`) and module."""

    tag: str
    parsed: Tag
    stack: str
    module: str  # per-module series: the module's subject in the tag, else ""


class Run(Protocol):
    """A finished run's event files, as families read them back."""

    @property
    def scalars(self) -> Mapping[str, Points]: ...

    @property
    def texts(self) -> Mapping[str, list[tuple[int, str]]]: ...

    @property
    def tags(self) -> Sequence[RunTag]: ...


class Family:
    """A metric family: subclass it in a file of its own and list it in `normprobe.metrics`."""

    name: ClassVar[str]
    description: ClassVar[str]
    series: ClassVar[tuple[Series, ...]]
    validation: ClassVar[bool] = False  # also measured on a validation forward
    # what the model lacks when the family finds nothing to read (warned at attach), or None
    requires: ClassVar[str | None] = None
    # what it reads is one many models lack (attention, BatchNorm, learned norm gains): the
    # lack is warned only when the family is asked for by name, not among all of them
    optional: ClassVar[bool] = False
    # it costs more than the probe's budget for a logged step: measured only when asked for by
    # name (``metrics=[..., name]``), not by default
    opt_in: ClassVar[bool] = False

    def plan(self, plan: Plan) -> None:
        """Ask for reads and slots on a mapped model; register how the step's values become
        tags (`Plan.on_record`)."""
        raise NotImplementedError

    def flags(self, run: Run) -> list[Flag]:
        """What in a finished run crossed this family's thresholds."""
        return []


# A flag needs its condition at the last this-many logged steps, one after the other: one step
# (step 0 above all, the model at init, which `diagnose` reads) is no trend, and a condition
# the run has left behind (BatchNorm statistics warming up) is no finding.
SUSTAIN = 2


def sustained(points: Points, condition: Callable[[float], bool]) -> Points:
    """The run of last (step, value) points, among the finite ones, that meet ``condition``."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    run: Points = []
    for s, v in reversed(finite):
        if not condition(v):
            break
        run.insert(0, (s, v))
    return run


def placement(run: Run, stack: str) -> str | None:
    """The stack's placement as the probe wrote it (``pre-ln``, ``post-ln``, ...), if it did."""
    return _last_text(run, "placement", stack)


def branch_gains(run: Run, stack: str) -> str | None:
    """What every residual branch of the stack writes through last when each has a learned gain
    there (``layer scale``: CaiT's, ConvNeXt's; ``norm gain``: the norm ending it, ResNet's last
    BatchNorm), as the probe wrote it; None when some branch has none."""
    return _last_text(run, "branch_gains", stack)


def block_params(run: Run, stack: str) -> tuple[int, int] | None:
    """The trainable parameter counts of the stack's first and last block as `grad_norm` wrote
    them where the two differ by more than 10%, else None."""
    text = _last_text(run, "block_params", stack)
    if text is None:
        return None
    first, last = (int(n) for n in text.split())
    return first, last


def _last_text(run: Run, series: str, stack: str) -> str | None:
    """The last text the probe wrote under ``series`` for ``stack``, if any."""
    texts = run.texts.get(format_tag(series, stack), [])
    return texts[-1][1] if texts else None
