"""A DeepSpeed engine without ZeRO (stage 0): where its gradients are complete.

The engine all-reduces the gradients after the autograd backward has returned (its backward's
epilogue, on the accumulation boundary), so the end of the backward sees each rank's own; it
then clips them and steps in ``_take_model_step``, and zeroes them. `Engine0.of` finds the
engine that trains a model; the probe reads the gradients in ``param.grad`` when that method
starts (reduced, not clipped yet), as it reads a ZeRO optimizer's when its step starts.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ..metrics.core.params import OwnTensors
from .zero import Zero, ZeroSteps, deepspeed_optimizer


def deepspeed_engine(model: nn.Module) -> Any:
    """``model`` if it is a DeepSpeed engine (as ``accelerator.prepare`` returns it), else the
    one whose ``module`` it is (it holds it among its submodules), or None; found once, through
    the objects that refer to ``model``."""
    engine = sys.modules.get("deepspeed.runtime.engine")  # not imported: none exists
    comm = sys.modules.get("deepspeed.comm")  # an engine initializes DeepSpeed's comm
    if engine is None or comm is None or not comm.is_initialized():
        return None
    if isinstance(model, engine.DeepSpeedEngine):
        return model
    for holder in gc.get_referrers(model):  # the engine's ``_modules``
        if not isinstance(holder, dict) or holder.get("module") is not model:
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, engine.DeepSpeedEngine) and owner.module is model:
                return owner
    return None


class Engine0(OwnTensors):
    """The `Holdings` (``param.grad``: whole, reduced) and the step of a DeepSpeed engine
    without ZeRO; ``scaler``: its ``torch.autocast`` GradScaler, if any."""

    stage = 0

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)

    @staticmethod
    def of(model: nn.Module) -> Engine0 | None:
        """The stage-0 DeepSpeed engine training ``model``, or None.

        Raises:
            TypeError: its optimizer is DeepSpeed's fp16 or bf16 one (`Zero.of`).
        """
        engine = deepspeed_engine(model)
        if engine is None or engine.zero_optimization_stage() > 0:
            return None  # none, or ZeRO: its optimizer is the one to hand over
        if deepspeed_optimizer(engine.optimizer) is not None:
            Zero.of(engine.optimizer)  # raises: not a ZeRO optimizer
        return Engine0(engine)

    def steps(self, before: Callable[[], None], after: Callable[[], None] | None) -> ZeroSteps:
        return ZeroSteps(self.engine, before, after, method="_take_model_step")
