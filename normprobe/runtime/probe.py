"""The probe's lifecycle: when a step is logged, arming and removing hooks, one transfer per
logged step, ranks, and the sinks."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import tags
from ..common import EVERY, MAX_BLOCK_TAGS, check_every, is_writer, world_size
from ..discovery import DiscoveryWarning, ModelMap, discover
from ..metrics import DEFAULTS, METRICS, chosen, family
from ..metrics.core.base import Reduce
from ..metrics.core.params import OwnTensors
from ..sinks import Record, Sink
from . import pipeline as pp
from . import tensor_parallel
from .backward_end import BackwardEnd
from .ds_engine import Engine0
from .forward import Forwards
from .hooks import OptimizerSteps, ProbeHook, unwrapped_optimizer, warn_unlogged
from .packing import read_back, read_micro_batches
from .pipeline_records import Exchange, combined, encoded
from .plan import ProbePlan
from .scaler import loss_scale, stepping_scaler
from .spikes import Spikes, SpikeWatch
from .zero import Zero, ZeroSteps, warn_spikes, without_partitioned


class Probe:
    """Hooks on one model that log normalization, residual and gradient statistics.

    Create it with `normprobe.attach`. Steps advance with the optimizer's step (or `step`
    without an optimizer); step 0 and every step with ``step % every == phase`` are logged.
    Between logged steps only the root module carries a hook; the reading hooks are registered
    when a logged forward starts and removed when it ends. With ``persistent_hooks`` they stay
    registered and return at once on other steps (what a compiled model needs: no hook added
    later). With ``spikes``, a detector checks the loss and the gradient norm on every step
    (`normprobe.Spikes`): a spike is written as ``normprobe/spike/*`` and the steps after it
    are logged like scheduled ones. Gradients are read where they are complete and before any
    clipping: at the end of each backward through the model's output (the step's last one
    counts; `normprobe.runtime.backward_end`), else just before the optimizer step; a
    ``scaler`` (``torch.amp.GradScaler``; found on Accelerate's optimizer, or when its
    ``step`` steps the optimizer: `normprobe.runtime.scaler`) divides out the loss scale they
    carry there. Drivers that count steps themselves (the Lightning and
    Hugging Face callbacks) call `begin_step`, `before_optimizer_step` and `end_step`, and pass
    what only they know as the underscored arguments: how ranks combine parameter statistics
    (``"sum"`` when each holds a shard), the step phase of their logging schedule, a prefix
    for module names, their optimizer when it may be DeepSpeed's ZeRO (then gradients are
    read when its step starts, and `before_optimizer_step` is theirs to skip), and where
    gradients are read (``"step"``: in `before_optimizer_step`, which the driver calls where
    they are complete, unscaled and not clipped). ``pipeline``: the
    ``torch.distributed.pipelining`` stage that runs the model (`normprobe.runtime.pipeline`).
    """

    stage: pp.Stage | None = None  # a pipeline stage's place in its stacks, once mapped

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        sinks: Sequence[Sink] = (),
        every: int = EVERY,
        metrics: Iterable[str] | None = None,
        max_block_tags: int = MAX_BLOCK_TAGS,
        start_step: int = 0,
        persistent_hooks: bool = False,
        spikes: Spikes | None = None,
        scaler: Any = None,
        _param_reduce: Reduce = "mean",
        _phase: int = 0,
        _name_prefix: str = "",
        _zero_optimizer: Any = None,
        _gradients_at: Literal["backward", "step"] = "backward",
        _clip_norm: float | None = None,
        pipeline: Any = None,
    ) -> None:
        _check_arguments(model, every, max_block_tags)
        pp.checked(model, pipeline, persistent_hooks)
        self.model, self._pipeline = model, pipeline
        spikes = self._find_deepspeed(
            optimizer if optimizer is not None else _zero_optimizer, spikes
        )
        # read at the step: ZeRO's gradients, and a pipeline's (its schedule scales them by the
        # number of micro-batches after the last backward)
        _gradients_at = "step" if self._zero is not None or pipeline is not None else _gradients_at
        # Accelerate's AcceleratedOptimizer holds the GradScaler of fp16 training (a stage-0
        # DeepSpeed engine its torch.autocast one)
        held = (scaler, getattr(optimizer, "scaler", None), getattr(self._zero, "scaler", None))
        self.scaler = next((s for s in held if s is not None), None)
        self.optimizer = optimizer = unwrapped_optimizer(optimizer)
        self.sinks = list(sinks)
        self.every = every
        self.metrics = self._chosen(metrics)
        self.max_block_tags = max_block_tags
        self.step_count = start_step
        self.phase = _phase % every
        self.name_prefix = _name_prefix
        self._param_reduce = _param_reduce
        self._clip_norm = _clip_norm
        self.persistent_hooks = persistent_hooks
        self.spikes = spikes
        self.paused = False
        self.model_map: ModelMap | None = None
        self.latest: Record | None = None
        self._plan: ProbePlan | None = None
        self._forwards = Forwards(persistent_hooks)
        self._spikes: SpikeWatch | None = None
        self._logged = self._is_logged(start_step)
        self._validating = self._removed = False
        self._forward_count = self._steps_ended = 0  # for the warning when nothing was logged
        self._gradients_read = False  # this step's gradients were read before the step
        self._ranks_checked = False  # that every rank probes the same blocks
        self._backward = (
            BackwardEnd(model, self.gradients_complete, persistent_hooks)
            if _gradients_at == "backward"
            else None
        )
        self._handles: list[RemovableHandle | ZeroSteps] = []
        self._hook_steps(optimizer)

    def _find_deepspeed(self, optimizer: Any, spikes: Spikes | None) -> Spikes | None:
        """DeepSpeed ZeRO: its gradients and step are its own (a driver that counts steps
        itself passes its optimizer as ``_zero_optimizer``): read when its step starts, before
        it clips them, no step counted; an engine without ZeRO likewise (`Engine0`). The spike
        detector, off under ZeRO."""
        zero = Zero.of(optimizer)
        self._zero: Zero | Engine0 | None = zero or Engine0.of(self.model)
        if zero is None:
            return spikes
        warn_spikes(zero.stage, spikes)
        return None

    def _chosen(self, metrics: Iterable[str] | None) -> tuple[str, ...]:
        """The families to read: ``metrics`` (None: the defaults) less those the model's layout
        keeps from being read: tensor parallelism's (refused by name) and,
        without a ZeRO optimizer to read them from, DeepSpeed's partitioned parameters'."""
        self._tensor_parallel = tensor_parallel.layout(self.model)
        self._explicit = metrics is not None
        kept = chosen(metrics)
        if self._tensor_parallel is not None:
            refused = tensor_parallel.refused_at_attach(self.model, self._tensor_parallel)
            kept = tensor_parallel.checked(self.model, kept, self._explicit, refused)
        if self._pipeline is not None:
            kept = tensor_parallel.checked(
                self.model, kept, self._explicit, pp.REFUSED, pp.SUPPORTED
            )
        return kept if self._zero is not None else without_partitioned(self.model, kept)

    def _hook_steps(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The root's hooks (each forward; the output's gradient, for the end of the backward)
        and the optimizer's (or DeepSpeed ZeRO's) step hooks."""
        model = self.model
        self._handles.append(model.register_forward_pre_hook(ProbeHook(self._root_pre)))
        if self._backward is not None and not self.persistent_hooks:
            self._handles.append(model.register_forward_hook(ProbeHook(self._output)))
        self._steps: OptimizerSteps | ZeroSteps
        if self._zero is not None:
            after = self._next_step if optimizer is not None else None
            self._steps = self._zero.steps(self.before_optimizer_step, after)
            self._handles += self._steps.handles
        elif optimizer is not None:
            self._steps = OptimizerSteps(optimizer, self.before_optimizer_step, self._next_step)
            self._handles += self._steps.handles

    # set-up ------------------------------------------------------------------------------------
    def discover_now(self, *args: Any, **kwargs: Any) -> None:
        """Map the model on these inputs and install the hooks."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DiscoveryWarning)  # one summary warning instead
            model_map = discover(self.model, *args, **kwargs)
        if self._pipeline is not None:  # one collective, on every stage alike
            self.stage = pp.numbered(model_map, self._pipeline)
            self._exchange = Exchange(self.stage.group, self.stage.device)
            self._forwards.micro_batches = True
        self._install(model_map)

    def discover_lazily(self) -> None:
        """Map the model on its first real forward, then record that forward already (outside
        ``torch.compile``'s tracing of it, if compiled)."""

        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def first(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._discovery_hook.remove()
            pp.refuse_call()
            self.discover_now(*args, **kwargs)
            self.start_forward()

        self._discovery_hook = self.model.register_forward_pre_hook(
            ProbeHook(first), with_kwargs=True, prepend=True
        )
        self._handles.append(self._discovery_hook)

    def _install(self, model_map: ModelMap) -> None:
        if self._tensor_parallel is not None:  # an output head or heads split otherwise
            attention = [a.path for a in model_map.attention]
            refused = tensor_parallel.refused_at_install(
                self.model, self._tensor_parallel, model_map.head, attention
            )
            self.metrics = tensor_parallel.checked(
                self.model, self.metrics, self._explicit, refused
            )
        plan = self._forwards.install(
            self.model,
            model_map,
            (family(name) for name in self.metrics),
            self._root_post,
            max_block_tags=self.max_block_tags,
            param_reduce=self._param_reduce,
            holdings=self._zero or OwnTensors(),
            name_prefix=self.name_prefix,
            blocks=None if self.stage is None else self.stage.blocks,
            pipeline=None if self.stage is None else (self.stage.index, self.stage.count),
        )
        self.model_map, self._plan = model_map, plan
        plan.clip_norm = self._clip_norm
        # a compiled model's output is not read for its loss: no hook added later
        self._spikes = SpikeWatch.of(
            self.spikes, self.model, plan, self.sinks, not self.persistent_hooks
        )
        if self.persistent_hooks or self._logged:  # last: the root's hook ends every read
            self._forwards.armed.arm()
        plan.warn_missing(every_family=set(self.metrics) in (set(DEFAULTS), set(METRICS)))
        plan.warn_doubts()

    # the schedule ------------------------------------------------------------------------------
    def _is_logged(self, step: int) -> bool:
        return step == 0 or step % self.every == self.phase or step <= self._captured()

    def _captured(self) -> int:
        """The last step a spike (or a family, `ProbePlan.capture`) has logged."""
        spikes = -1 if self._spikes is None else self._spikes.capture_until
        return spikes if self._plan is None else max(spikes, self._plan.capture_until)

    def _root_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._pipeline is not None:
            if pp.inferring():
                return  # the schedule's forward that finds the stage's output shapes
            self._forwards.size = pp.micro_batch_size(args)
        self._forward_count += 1
        if self._forward_count == 1 and self._pipeline is None:
            pp.refuse_call()
        if self.optimizer is not None:
            self._steps.forward_started()
        self.start_forward()

    def start_forward(self) -> None:
        """A forward of the model starts now: record it if the step is logged.

        The probe calls it from a hook on the model; a driver whose own hook runs first (and
        attaches the probe there) calls it for that forward.
        """
        wanted = self.persistent_hooks or self._validating or (self._logged and not self.paused)
        self._forwards.start(wanted and not self._removed)

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._validating = False
        if self._forwards.end(out, keep_armed=self.every == 1) and is_writer():
            # the forward raised: what earlier steps logged is put on disk, in case this ends
            # the training
            for sink in self.sinks:
                sink.flush()

    def _output(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._backward is not None and self._reads_gradients():
            self._backward.watch(out)

    def _next_step(self) -> None:
        self.end_step()
        self.begin_step(self.step_count + 1)

    def begin_step(self, step: int, logged: bool | None = None) -> None:
        """Start training step ``step`` (for drivers that count steps themselves); ``logged``
        overrides the probe's schedule for a driver that keeps its own cadence.

        A logged step gets its hooks now, before its forward starts: a hook added to the root
        module while the root's own hooks run would miss that call.
        """
        self.step_count = step
        self._gradients_read = False
        if logged is None:
            self._logged = self._is_logged(step)
        else:  # the driver's cadence, and the steps after a spike
            self._logged = logged or step <= self._captured()
        if self._logged and self._plan is not None and not self._removed:
            self._forwards.armed.arm()

    def _reads_gradients(self) -> bool:
        """This step's gradients are read: a logged step, or the spike detector is on."""
        logged = self._logged and not self.paused and self._plan is not None
        return not self._removed and (logged or self._spikes is not None)

    def gradients_complete(self, at_step: bool = False) -> None:
        """The step's gradients are complete and not clipped yet (the end of a backward): read
        them; a later call in the same step (the next micro-batch's backward) reads again.
        ``at_step``: read at the optimizer step, where clipping cannot be told apart."""
        if not self._reads_gradients():
            return
        self._gradients_read = True
        scale = loss_scale(self.scaler, self.optimizer, at_step)
        read = self._spikes.detector.measure(scale) if self._spikes is not None else None
        if self._logged and self._plan is not None:
            self._plan.grad_scale = scale
            self._plan.grad_squares_read = read
            self._plan.clipping_visible = not at_step
            try:
                self._plan.run("gradients")
            finally:
                self._plan.grad_scale = self._plan.grad_squares_read = None

    def before_optimizer_step(self) -> None:
        """Read the gradients unless a backward's end read them (no backward through the
        model's output); read the gains, and keep what the update ratio compares against;
        check the step for a spike."""
        late = self._scaler_found()
        if not self._gradients_read:
            self.gradients_complete(at_step=True)
        if self._spikes is not None:
            if late is not None:
                self._spikes.detector.unscale(late)
            self._spikes.detector.watch(self.step_count)
        if self._logged and self._plan is not None:
            self._plan.late_scale = late
            try:
                self._plan.run("before_step")
            finally:
                self._plan.late_scale = None

    def _scaler_found(self) -> torch.Tensor | None:
        """Take a GradScaler that steps the optimizer (`stepping_scaler`) when none was handed
        over; the scale that the gradients read at this step's backward end carry, if they were."""
        if self.scaler is not None or self._zero is not None or not self._reads_gradients():
            return None
        self.scaler = stepping_scaler()
        return loss_scale(self.scaler, None, False) if self._gradients_read else None

    @property
    def reads_zero_step(self) -> bool:
        """Whether gradients are read when a DeepSpeed ZeRO optimizer's step starts (a
        driver's `before_optimizer_step` would come after it)."""
        return self._zero is not None

    def end_step(self, stepped: bool = True) -> None:
        """After the optimizer step: measure the update and write the step (if logged), and
        the spikes found since the last step. ``stepped``: an optimizer step ran."""
        self._steps_ended += 1
        if self._logged and self._plan is not None:
            if stepped:
                self._plan.run("after_step")
            self.flush()
        if self._spikes is not None:
            self._spikes.write(self.step_count)

    def validate_next_forward(self) -> None:
        """Record BatchNorm statistics on the next forward; `flush_validation` writes them."""
        self._validating = True
        if self._plan is not None and not self._removed:
            self._forwards.armed.arm()

    def flush_validation(self) -> None:
        """Write what the validation forward measured, as ``normprobe/val_bn_*`` tags."""
        self._steps_ended += 1  # a validation pass has no training step, and logs anyway
        self.flush(validation=True)

    def step(self) -> None:
        """End a step by hand (training without an optimizer passed to `attach`).

        On a logged step, reads the gradients present now and writes the step's statistics.
        """
        if self.optimizer is not None:
            raise RuntimeError(
                "this probe advances with its optimizer's step(); don't call probe.step() too"
            )
        self.before_optimizer_step()
        self.end_step(stepped=False)
        self.begin_step(self.step_count + 1)

    # spikes --------------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Hand the spike detector this step's training loss (several in a step are averaged);
        nothing is read back here. Not needed when the model's output carries its loss
        (``.loss`` or ``["loss"]``, as Hugging Face models give it); without either, only the
        gradient norm is watched."""
        if self._spikes is not None:
            self._spikes.observe_loss(loss)

    # writing -------------------------------------------------------------------------------------
    def flush(self, validation: bool = False) -> None:
        """Copy the step's statistics to the host (one transfer) and hand them to the sinks.

        Under ``torch.distributed`` every rank must call it on the same steps: the ranks' values
        are combined with one collective (mean of squares for RMS, max of maxima, ...), and
        only global rank zero writes. A pipeline stage combines its micro-batches itself, and
        one all-gather hands every stage the stages' records (`pipeline_records`).
        """
        plan = self._plan
        if plan is None:
            return
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        writes = is_writer()
        if self.stage is not None:  # the forwards published theirs: micro-batches
            values = read_micro_batches(self._forwards.measured, plan.layout, device, validation)
            held = pp.held(plan, self.stage)  # before the clear: what the forwards handed on
            self._forwards.clear()
            # armed for the step's every micro-batch (a hook added while the root's own hooks
            # run misses that call): `begin_step` arms the next logged one
            self._forwards.armed.disarm()
            mine = encoded(plan.record(values, self.step_count, writes), held)
            record = combined(self.step_count, self._exchange(mine))
        else:
            plan.run("flush", validation)
            if not self._ranks_checked and world_size() > 1 and pp.PIPELINING in sys.modules:
                pp.same_blocks_everywhere(plan.modules_in_order, device)
            self._ranks_checked = True
            read = read_back(self._forwards.measured, plan.layout, device, validation)
            self._forwards.clear()
            if read is None:
                return
            record = plan.record(read, self.step_count, writes)
        if not validation:
            self.latest = record
        if writes:
            for sink in self.sinks:
                sink.write(record)

    def tag(self, series: str, module: str) -> str:
        """The tag a per-module series (``norm_in_rms``, ``attn_logit_max``...) of the module at
        path ``module`` is written under (`normprobe.tags`); the model must be mapped."""
        if self._plan is None:
            raise RuntimeError("the model is not mapped yet: run a forward, or discover_now()")
        return tags.format(series, self._plan.module_tag(module))

    @property
    def stacks(self) -> list[str]:
        """The model's stacks of blocks as tags name them (``blocks``, ``model.layers``): the
        ``stack=`` of `Record.grad_ratio`; the model must be mapped."""
        if self._plan is None:
            raise RuntimeError("the model is not mapped yet: run a forward, or discover_now()")
        return [self._plan.stack_name(s.path) for s in self._plan.stacks()]

    # lifetime ------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove every hook, write what is pending and close what the probe opened. Idempotent."""
        if self._removed:
            return
        self._removed = True
        # removed while an exception propagates: that exception is the story, not the steps
        unwinding = sys.exc_info()[0] is not None
        if not unwinding and is_writer():
            mapped, stepping = self._plan is not None, self.optimizer is not None
            warn_unlogged(self.model, self._forward_count, self._steps_ended, mapped, stepping)
        self._forwards.stop()
        if self._backward is not None:
            self._backward.remove()
        if self._spikes is not None:
            self._spikes.remove(unwinding)  # the last steps' verdicts, still on their way
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for sink in self.sinks:
            sink.close()

    @property
    def attached(self) -> bool:
        return not self._removed

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _check_arguments(model: nn.Module, every: int, max_block_tags: int) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__qualname__}")
    check_every(every)
    if max_block_tags < 2:
        raise ValueError(f"`max_block_tags` must be at least 2, got {max_block_tags}")
    if attached_probe(model) is not None:
        raise RuntimeError(
            f"a normprobe probe is already attached to this {type(model).__name__}; call "
            "probe.remove() on it first (or keep using it: one probe logs every metric)"
        )


def attached_probe(model: nn.Module) -> Probe | None:
    """The probe attached to ``model`` and not removed yet, or None."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(getattr(hook, "fn", None), "__self__", None)
        if isinstance(hook, ProbeHook) and isinstance(owner, Probe) and owner.attached:
            return owner
    return None
