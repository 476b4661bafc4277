"""`NormProbe`: the probe as a Lightning callback, on the Trainer's own loggers and steps."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from torch import nn
from torch.utils.hooks import RemovableHandle

from .common import MAX_BLOCK_TAGS, check_every, is_compiled
from .metrics import chosen
from .metrics.core.base import Reduce
from .runtime import Probe, ProbeHook
from .runtime.spikes import DEFAULT_SPIKES, Spikes
from .runtime.zero import PARAMETER_FAMILIES
from .sinks import Record, TensorBoardSink, check_log_dir

DEFAULT_DIR = "normprobe_logs"
CHECKPOINT_KEY = "normprobe"
# the way out when the folder NormProbe writes to cannot be created
_FIX = "set the Trainer's default_root_dir (or the logger's save_dir) to a writable directory"


class LoggerSink:
    """Scalars through a Lightning logger's ``log_metrics``; the TensorBoard-only panels
    (layout, depth histograms, texts) and the same scalars to a writer in its directory."""

    def __init__(self, logger: Logger, log_dir: str) -> None:
        self.logger = logger
        self.board = TensorBoardSink(log_dir=log_dir)

    @property
    def log_dir(self) -> str:
        return self.board.log_dir

    @property
    def layout_written(self) -> bool:
        return self.board.layout_written

    @layout_written.setter
    def layout_written(self, value: bool) -> None:
        self.board.layout_written = value

    def write(self, record: Record) -> None:
        self.logger.log_metrics(record.scalars, step=record.step)
        self.board.write(record)

    def flush(self) -> None:
        self.logger.save()
        self.board.flush()

    def close(self) -> None:
        self.board.close()


class NormProbe(Callback):
    """Log normalization, residual and gradient statistics of the model a Trainer fits.

    Add it to an existing Trainer; with no argument it logs every metric of
    `normprobe.METRICS` on the steps Lightning logs on (every ``trainer.log_every_n_steps``)
    and on step 0, to the Trainer's TensorBoardLogger run (same directory, same global
    steps). With other loggers, scalars go through each logger's ``log_metrics`` and
    TensorBoard's panels to a ``normprobe`` folder in that logger's directory; without a
    logger, to ``<default_root_dir>/normprobe_logs``.

    The model is the module your ``training_step`` runs: the LightningModule if its forward is
    called, else the first child module called (e.g. ``self.model``); tags use paths in the
    LightningModule either way (``model.blocks``). It is mapped on its first
    forward, or on ``example_inputs`` / the module's ``example_input_array`` before training
    starts (needed when the model is compiled, so that the hooks exist before compilation).

    Gradients are read in ``on_before_optimizer_step``: accumulated, unscaled by the precision
    plugin, not yet clipped; with gradient accumulation, once per optimizer step. BatchNorm
    drift and the train/eval gap are also logged on the first batch of each validation run
    (``normprobe/val_bn_*``). The spike detector watches the loss ``training_step`` returns
    (``on_before_backward``) and the gradient norm on every optimizer step.

    Args:
        every: log every this many optimizer steps (default: ``trainer.log_every_n_steps``).
        metrics: names from `normprobe.METRICS` (default: all but the opt-in ones).
        example_inputs: positional inputs to map the model before training starts.
        max_block_tags: per-block scalar tags for at most this many blocks of a stack, and
            norm and attention statistics for at most this many layers of each kind.
        spikes: the spike detector, as in `normprobe.attach` (None: off).

    Attributes:
        latest: the last training step's record (on every rank), also after training ends.

    Example::

        trainer = L.Trainer(callbacks=[normprobe.NormProbe()])
        trainer.fit(model)   # then: tensorboard --logdir lightning_logs
    """

    def __init__(
        self,
        every: int | None = None,
        metrics: Iterable[str] | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        max_block_tags: int = MAX_BLOCK_TAGS,
        spikes: Spikes | None = DEFAULT_SPIKES,
    ) -> None:
        if every is not None:
            check_every(every)
        self.every = every
        self.metrics = chosen(metrics)
        self.example_inputs = example_inputs
        self.max_block_tags = max_block_tags
        self.spikes = spikes
        self.probe: Probe | None = None
        self.latest: Record | None = None
        self._waiting: list[RemovableHandle] = []
        self._stepped = False
        self._layout_dirs: list[str] = []
        self._sinks: list[TensorBoardSink | LoggerSink] = []

    # set-up ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        mine = [c for c in trainer.callbacks if isinstance(c, NormProbe)]  # type: ignore[attr-defined]
        if len(mine) > 1:
            raise RuntimeError(
                f"NormProbe was added {len(mine)} times to this Trainer; one logs every metric: "
                "keep one in `callbacks=[...]`"
            )
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            self._without_deepspeed_reads()

    def _without_deepspeed_reads(self) -> None:
        """Lightning's DeepSpeedStrategy (CUDA only, not tested): drop what reads the
        parameters' gradients or weights, which DeepSpeed ZeRO keeps in its optimizer's
        partitions, saying so by name."""
        refused = [m for m in self.metrics if m in PARAMETER_FAMILIES]
        if self.spikes is not None:
            refused.append("spikes (the spike detector)")
        if not refused:
            return
        self.metrics = tuple(m for m in self.metrics if m not in PARAMETER_FAMILIES)
        self.spikes = None
        warnings.warn(
            f"NormProbe: under Lightning's DeepSpeedStrategy the gradients and fp32 weights live "
            f"in DeepSpeed ZeRO's partitions, which this callback does not read: "
            f"{', '.join(refused)} are not logged (the forward's statistics are). They are read "
            "with the DeepSpeed engine in a plain loop, normprobe.attach(engine.module, "
            "optimizer=engine.optimizer), or under the Hugging Face Trainer or Accelerate with a "
            "DeepSpeed config",
            RuntimeWarning,
            stacklevel=2,
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sinks = self._make_sinks(trainer) if trainer.is_global_zero else []
        inputs = self.example_inputs
        if inputs is None and getattr(pl_module, "example_input_array", None) is not None:
            example = pl_module.example_input_array
            inputs = example if isinstance(example, tuple) else (example,)
        if inputs is not None:
            device = pl_module.device
            inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
            self._start(trainer, pl_module, inputs, {})
            return
        if is_compiled(pl_module):
            raise RuntimeError(
                "NormProbe needs the model mapped before torch.compile traces it: set "
                "`example_input_array` on your LightningModule or pass "
                "NormProbe(example_inputs=(...,))"
            )
        # map whichever module training_step runs first: the LightningModule or a child that
        # holds weights (not a padding or loss module called before the model: neuralforecast)
        children = [c for c in pl_module.children() if any(True for _ in c.parameters())]
        for module in (pl_module, *children):
            self._waiting.append(
                module.register_forward_pre_hook(
                    ProbeHook(self._first_forward(trainer)), with_kwargs=True, prepend=True
                )
            )

    def _first_forward(self, trainer: Trainer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if module is trainer.lightning_module and "forward" in vars(module):
                # Lightning's DDP/FSDP strategies call the LightningModule with forward
                # redirected to training_step: not the model's own forward, wait for it
                return
            self._stop_waiting()
            self._start(trainer, module, args, kwargs)
            assert self.probe is not None
            self.probe.start_forward()

        return hook

    def _start(
        self, trainer: Trainer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        target = getattr(module, "_orig_mod", module)  # a compiled child: map the eager module
        sinks = self._sinks
        every = self.every or int(trainer.log_every_n_steps)  # type: ignore[attr-defined]
        compiled = is_compiled(module) or is_compiled(trainer.lightning_module)
        self.probe = Probe(
            target,
            sinks=sinks,
            every=every,
            metrics=self.metrics,
            max_block_tags=self.max_block_tags,
            start_step=trainer.global_step,
            persistent_hooks=compiled,
            spikes=self.spikes,
            _param_reduce=_param_reduce(trainer.strategy),
            _phase=every - 1,  # Lightning logs step s when (s + 1) % every == 0
            _name_prefix=_prefix(trainer.lightning_module, module),
            # on_before_optimizer_step sees the gradients unscaled and not yet clipped
            _gradients_at="step",
            _clip_norm=_clip_norm(trainer, target),
        )
        self.probe.paused = trainer.sanity_checking
        was_training = target.training
        self.probe.discover_now(*args, **kwargs)
        target.train(was_training)

    def _make_sinks(self, trainer: Trainer) -> list[TensorBoardSink | LoggerSink]:
        sinks: list[TensorBoardSink | LoggerSink] = []
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                sinks.append(TensorBoardSink(writer=logger.experiment, close_writer=False))
            else:
                root = logger.log_dir or logger.save_dir or trainer.default_root_dir
                log_dir = os.path.join(root, "normprobe")
                check_log_dir(log_dir, "NormProbe's folder in the logger's directory", _FIX)
                sinks.append(LoggerSink(logger, log_dir))
        if not sinks:
            log_dir = os.path.join(trainer.default_root_dir, DEFAULT_DIR)
            warnings.warn(
                f"NormProbe: the Trainer has no logger; writing TensorBoard files to {log_dir}",
                UserWarning,
                stacklevel=2,
            )
            check_log_dir(log_dir, "NormProbe's log directory", _FIX)
            sinks.append(TensorBoardSink(log_dir=log_dir))
        for sink in sinks:  # a resumed run writing into a directory that holds the layout
            sink.layout_written = sink.log_dir in self._layout_dirs
        return sinks

    # the training loop -----------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.probe is not None:
            self.probe.paused = False
            self.probe.begin_step(trainer.global_step)

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        if self.probe is not None:
            self.probe.observe_loss(loss)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.probe is not None and not self._stepped:  # the first optimizer of the step
            self.probe.before_optimizer_step()
            self._stepped = True

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.probe is not None and self._stepped:  # an optimizer step happened in this batch
            self.probe.end_step()
            self.latest = self.probe.latest
            self._stepped = False

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.probe is not None:
            self.probe.paused = True

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.probe is not None and batch_idx == 0 and "bn_stats" in self.metrics:
            self.probe.begin_step(trainer.global_step)
            self.probe.validate_next_forward()

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.probe is not None and batch_idx == 0 and "bn_stats" in self.metrics:
            self.probe.flush_validation()

    # lifetime ---------------------------------------------------------------------------------
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._finish()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def _finish(self) -> None:
        self._stop_waiting()
        if self.probe is not None:
            self._layout_dirs = self._dirs_with_layout()
            self.probe.remove()
            self.probe = None
        else:
            for sink in self._sinks:
                sink.close()
        self._sinks = []

    def _stop_waiting(self) -> None:
        for handle in self._waiting:
            handle.remove()
        self._waiting = []

    # The state rides in the checkpoint dict rather than in state_dict(), so that Lightning
    # does not refuse a second instance before `setup` can explain the problem.
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = {"layout_dirs": self._dirs_with_layout()}

    def _dirs_with_layout(self) -> list[str]:
        """Log directories that already hold normprobe's custom-scalars layout."""
        dirs = set(self._layout_dirs)
        dirs.update(s.log_dir for s in self._sinks if s.layout_written)
        return sorted(dirs)

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._layout_dirs = list(checkpoint.get(CHECKPOINT_KEY, {}).get("layout_dirs", []))


def _prefix(pl_module: nn.Module, module: nn.Module) -> str:
    """``"model."`` when the probed module is ``pl_module.model``: tags keep the full path."""
    for name, child in pl_module.named_children():
        if child is module:
            return name + "."
    return ""


def _clip_norm(trainer: Trainer, model: nn.Module) -> float | None:
    """The norm Lightning clips the gradients to (``gradient_clip_val``, by norm), when its
    optimizers hold exactly ``model``'s trainable parameters: then the total the probe reads is
    the total Lightning clips, and the clip factor follows from it."""
    value = trainer.gradient_clip_val
    if not value or trainer.gradient_clip_algorithm not in (None, "norm"):
        return None
    held = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return float(value) if held == trainable else None


def _param_reduce(strategy: Any) -> Reduce:
    """``"sum"`` (each rank holds a shard) under a sharding FSDPStrategy, whose FSDP1 shards are
    plain tensors; DTensor shards (ModelParallelStrategy) the probe finds by itself."""
    if isinstance(strategy, FSDPStrategy) and strategy.sharding_strategy.name != "NO_SHARD":
        return "sum"
    return "mean"
