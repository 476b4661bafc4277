"""The Hugging Face Trainer (and TRL's trainers, which subclass it): one callback.

    from normprobe.hf import NormProbeCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NormProbeCallback()])

Imports transformers, an optional dependency (``pip install normprobe[hf]``).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations.integration_utils import (
    INTEGRATION_TO_CALLBACK,
    TensorBoardCallback,
)
from transformers.trainer_callback import CallbackHandler

from .common import MAX_BLOCK_TAGS, check_every, is_compiled
from .metrics import chosen
from .runtime import Probe
from .runtime.spikes import DEFAULT_SPIKES, Spikes
from .sinks import Record, Sink, TensorBoardSink, check_log_dir

DEFAULT_DIR = "normprobe"


class ReporterSink:
    """Scalars through one of the Trainer's reporting callbacks (W&B, MLflow, ...), as the
    Trainer logs its own: ``on_log`` with the step's values."""

    def __init__(
        self,
        reporter: TrainerCallback,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
    ) -> None:
        self.reporter, self.args, self.state, self.control = reporter, args, state, control

    def write(self, record: Record) -> None:
        self.reporter.on_log(self.args, self.state, self.control, logs=dict(record.scalars))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NormProbeCallback(TrainerCallback):
    """Log normalization, residual and gradient statistics of the model a Trainer trains.

    On the Trainer's logging steps (``logging_steps``, and step 1 with ``logging_first_step``),
    numbered by ``state.global_step`` as the Trainer numbers its own scalars, every metric of
    `normprobe.METRICS` (or ``metrics``) goes to the TensorBoard run of the Trainer's
    ``report_to="tensorboard"`` (the same event directory as ``train/loss``, panels included),
    and the scalars also to the Trainer's other reporters (W&B, MLflow, ... through their
    ``on_log``). Without a TensorBoard reporter the event files go to
    ``<output_dir>/normprobe``. Only the main process writes.

    Gradients are read at the end of each backward through the model (the step's last
    micro-batch counts: the accumulated gradients), before the Trainer clips them to
    ``max_grad_norm``; the fp16 loss scale they carry there is divided out with the GradScaler
    of the Trainer's optimizer. ``grad_norm_total`` is the Trainer's own logged ``grad_norm``;
    ``grad_clip_factor`` compares it with the total at ``on_pre_optimizer_step``, after
    clipping. Under a DeepSpeed config they are read when the engine's step (stage 0) or the
    ZeRO optimizer's (stages 1-3) starts, inside Accelerate's backward, before DeepSpeed clips.

    The spike detector watches the loss the model returns (``outputs.loss``, what the Trainer
    trains on when the batch has labels; the Trainer hands callbacks no loss) and the gradient
    norms before clipping.

    Args:
        every: log every this many steps instead of the Trainer's ``logging_steps``.
        metrics: names from ``normprobe.METRICS`` (default: all but the opt-in ones).
        example_inputs: positional inputs to map the model before training; by default the
            model is mapped on its first training forward.
        example_kwargs: keyword inputs to map the model with, as ``example_inputs``.
        max_block_tags: as in `normprobe.attach`.
        spikes: the spike detector, as in `normprobe.attach` (None: off).
    """

    def __init__(
        self,
        every: int | None = None,
        metrics: Iterable[str] | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        max_block_tags: int = MAX_BLOCK_TAGS,
        spikes: Spikes | None = DEFAULT_SPIKES,
    ) -> None:
        if every is not None:
            check_every(every)
        self.every = every
        self.metrics = chosen(metrics)
        self.example_inputs = example_inputs
        self.example_kwargs = example_kwargs
        self.max_block_tags = max_block_tags
        self.spikes = spikes
        self.probe: Probe | None = None
        self.latest: Record | None = None
        self._first = False

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise RuntimeError("NormProbeCallback: the Trainer passed no model to on_train_begin")
        if self.probe is not None:  # a second train() on the same Trainer
            self.probe.remove()
        self.every = self.every or int(state.logging_steps or args.logging_steps or 500)
        # Accelerate's optimizer holds the GradScaler of fp16 training
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)
        self._first = bool(args.logging_first_step)
        sinks = self._sinks(args, state, control) if state.is_world_process_zero else []
        self.probe = Probe(
            model,
            sinks=sinks,
            every=self.every,
            metrics=self.metrics,
            max_block_tags=self.max_block_tags,
            start_step=state.global_step,
            spikes=self.spikes,
            # compiled (TrainingArguments(torch_compile=True)): no hook added later
            persistent_hooks=bool(args.torch_compile) or is_compiled(model),
            _zero_optimizer=kwargs.get("optimizer"),  # a DeepSpeed config's ZeRO optimizer
            scaler=scaler,
        )
        if self.example_inputs is not None or self.example_kwargs is not None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            inputs = tuple(_to(x, device) for x in self.example_inputs or ())
            kwargs_in = {k: _to(v, device) for k, v in (self.example_kwargs or {}).items()}
            was_training = model.training
            self.probe.discover_now(*inputs, **kwargs_in)
            model.train(was_training)
        else:
            self.probe.discover_lazily()

    def _sinks(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> list[Sink]:
        sinks: list[Sink] = []
        handler = _handler_of(self)
        callbacks = handler.callbacks if handler is not None else []
        report_to = [args.report_to] if isinstance(args.report_to, str) else args.report_to or []
        reporters = tuple(
            INTEGRATION_TO_CALLBACK[n] for n in report_to if n in INTEGRATION_TO_CALLBACK
        )
        for cb in callbacks:
            if isinstance(cb, TensorBoardCallback):
                if getattr(cb, "tb_writer", None) is not None:
                    sinks.append(TensorBoardSink(writer=cb.tb_writer, close_writer=False))
            elif isinstance(cb, TrainerCallback) and reporters and isinstance(cb, reporters):
                sinks.append(ReporterSink(cb, args, state, control))
        if not any(isinstance(s, TensorBoardSink) for s in sinks):
            log_dir = os.path.join(args.output_dir or ".", DEFAULT_DIR)
            warnings.warn(
                f"NormProbeCallback: the Trainer reports to no TensorBoard run "
                f"(report_to={args.report_to}); writing TensorBoard files to {log_dir}",
                UserWarning,
                stacklevel=2,
            )
            check_log_dir(
                log_dir,
                "NormProbeCallback's log directory",
                "set TrainingArguments(output_dir=...) to a directory you can write to",
            )
            sinks.append(TensorBoardSink(log_dir=log_dir))
        return sinks

    def _logged(self, step: int) -> bool:
        assert self.every is not None
        return step % self.every == 0 or (self._first and step == 1)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.probe is not None:  # the step being taken gets number global_step + 1
            step = state.global_step + 1
            self.probe.begin_step(step, logged=self._logged(step))

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # under DeepSpeed ZeRO the gradients were read when its step started (in the backward
        # Accelerate runs): they are gone by now
        if self.probe is not None and not self.probe.reads_zero_step:
            self.probe.before_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.probe is not None:  # after the optimizer step; global_step is this step's
            self.probe.end_step()
            self.latest = self.probe.latest

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.probe is not None:
            self.probe.remove()
            self.probe = None


def _handler_of(callback: TrainerCallback) -> CallbackHandler | None:
    """The Trainer's callback handler holding ``callback`` (the Trainer hands callbacks no
    reference to itself or to the other callbacks): found through the list that holds it."""
    for holder in gc.get_referrers(callback):
        if not isinstance(holder, list):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, CallbackHandler) and owner.callbacks is holder:
                return owner
            if isinstance(owner, dict):
                for handler in gc.get_referrers(owner):
                    if isinstance(handler, CallbackHandler) and handler.callbacks is holder:
                        return handler
    return None


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x
