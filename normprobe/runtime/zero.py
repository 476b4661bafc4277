"""DeepSpeed ZeRO, stages 1 to 3 (Rajbhandari et al. 2020).

A ZeRO optimizer reduces each parameter's gradient across ranks into partitions of its own
(``param.grad`` is None by its step) and keeps the fp32 weights that it updates split between
ranks alike; at stage 3 the module's parameters are empty outside their forward. `Zero.of`
finds such an optimizer given to ``attach`` (or behind a wrapper's ``.optimizer``);
its `Holdings` hand the families this rank's part of each gradient and weight, which the
probe's one collective of a logged step sums over ranks, and `ZeroSteps` reads them when the
optimizer's step starts: the gradients are complete there (reduced after the backward of the
accumulation boundary) and not yet unscaled or clipped (``gradient_clipping``), which that
step does first.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..common import is_writer, world_size
from .spikes import Spikes


def deepspeed_optimizer(optimizer: Any) -> Any:
    """The DeepSpeed optimizer at or behind ``optimizer`` (through the ``.optimizer`` of
    wrappers such as Accelerate's), or None."""
    base = sys.modules.get("deepspeed.runtime.base_optimizer")  # not imported: none exists
    inner, seen = optimizer, set()
    while base is not None and inner is not None and id(inner) not in seen:
        if isinstance(inner, base.DeepSpeedOptimizer):
            return inner
        seen.add(id(inner))
        inner = getattr(inner, "optimizer", None)
    return None


class Zero:
    """A ZeRO optimizer of stage 1 or 2 (`Zero3` for stage 3): its `Holdings`, where each
    parameter's gradient and fp32 weights are the fragment of this rank's partition that
    overlaps the parameter (a parameter outside it has none here), and its step."""

    partitioned = True

    def __init__(self, optimizer: Any, stage: int) -> None:
        self.optimizer = optimizer
        self.stage = stage
        self._empty: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def of(optimizer: Any) -> Zero | None:
        """The ZeRO optimizer behind ``optimizer``, or None when it is no DeepSpeed optimizer.

        Raises:
            TypeError: a DeepSpeed optimizer that is not ZeRO's (fp16 or bf16 without ZeRO).
        """
        found = deepspeed_optimizer(optimizer)
        if found is None:
            return None
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if isinstance(found, DeepSpeedZeroOptimizer_Stage3):
            return Zero3(found, 3)
        if isinstance(found, DeepSpeedZeroOptimizer):
            return Zero(found, 2 if found.partition_gradients else 1)
        raise TypeError(
            f"normprobe reads the gradients of DeepSpeed's ZeRO optimizers (stages 1 to 3); "
            f"{type(found).__name__} keeps them in buffers of its own, scaled, and clips them "
            "before its inner optimizer steps, so grad_norm, weight_rms, update_ratio and "
            'norm_gain cannot be read: set "zero_optimization": {"stage": 1} (or 2, 3) in the '
            "DeepSpeed config"
        )

    def steps(self, before: Callable[[], None], after: Callable[[], None] | None) -> ZeroSteps:
        return ZeroSteps(self.optimizer, before, after)

    # Holdings ------------------------------------------------------------------------------------
    def grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        found: list[torch.Tensor | None] = []
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                found.append(None)
                continue
            index = p._index_in_param_group  # type: ignore[attr-defined]
            grad = mapping.get_lp_grad_fragment(index).reshape(-1)
            address = mapping.lp_fragment_address
            if grad.numel() == p.numel():  # a whole gradient: this partition's part of it
                grad = grad.narrow(0, address.start, address.numel)
            found.append(grad)
        return self._unscaled(found)

    def weights(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        found = []
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            found.append(self._none(p) if mapping is None else mapping.hp_fragment)
        return found

    def shares(self, params: Sequence[torch.Tensor]) -> list[float]:
        return [1.0] * len(params)  # the partitions do not overlap

    def _unscaled(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The gradients without fp16's loss scale, which the step divides out first."""
        scale = float(self.optimizer.loss_scale)
        if scale == 1.0:
            return grads
        return [None if g is None else g.float() / scale for g in grads]

    def _none(self, p: torch.Tensor) -> torch.Tensor:
        """An empty fp32 tensor: the part of a parameter this rank does not hold."""
        if p.device not in self._empty:
            self._empty[p.device] = torch.zeros(0, device=p.device)
        return self._empty[p.device]


class Zero3(Zero):
    """A stage-3 ZeRO optimizer: each parameter's gradient and fp32 weights are this rank's
    partition of them (DeepSpeed's ``safe_get_local_grad`` and ``safe_get_local_fp32_param``),
    without the padding that evens out the last one."""

    def grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        from deepspeed.utils import safe_get_local_grad

        found: list[torch.Tensor | None] = []
        for p in params:
            grad = safe_get_local_grad(p) if p.requires_grad else None
            found.append(None if grad is None else _unpadded(p, grad))
        return self._unscaled(found)

    def weights(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_local_fp32_param

        found = []
        for p in params:  # a frozen parameter has no fp32 copy: its own partition
            held = safe_get_local_fp32_param(p) if p.requires_grad else p.ds_tensor  # type: ignore[attr-defined]
            found.append(_unpadded(p, held))
        return found


def _unpadded(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """This rank's partition ``part`` of stage-3 parameter ``p``, flat, without the padding
    past the parameter's last entry."""
    flat = part.reshape(-1)
    rank = torch.distributed.get_rank(group=p.ds_process_group)  # type: ignore[attr-defined]
    held = min(max(p.ds_numel - rank * flat.numel(), 0), flat.numel())  # type: ignore[attr-defined]
    return flat if held == flat.numel() else flat.narrow(0, 0, held)


# the families that read the parameters' gradients or weights around the optimizer step
PARAMETER_FAMILIES = ("grad_norm", "weight_rms", "update_ratio", "norm_gain")


def without_partitioned(model: nn.Module, metrics: tuple[str, ...]) -> tuple[str, ...]:
    """``metrics`` less `PARAMETER_FAMILIES` when ``model``'s parameters are in ZeRO's
    partitions but no ZeRO optimizer was given to read them from (a driver that reads
    ``param.grad`` around an optimizer step of its own), with a warning naming them."""
    params = list(model.parameters())
    stage = next((3 for p in params if hasattr(p, "ds_id")), None)
    if stage is None and not any(hasattr(p, "_hp_mapping") for p in params):
        return metrics
    refused = [m for m in metrics if m in PARAMETER_FAMILIES]
    if refused and is_writer():
        warnings.warn(
            f"normprobe: {type(model).__name__}'s parameters are partitioned by DeepSpeed"
            f"{' ZeRO stage 3' if stage else ''}: their gradients live in its optimizer's "
            f"partitions, and no ZeRO optimizer was given to read them from, so "
            f"{', '.join(refused)} are not logged. Pass it: "
            "normprobe.attach(engine.module, optimizer=engine.optimizer)",
            RuntimeWarning,
            stacklevel=5,  # attach's caller (through Probe.__init__, Probe._chosen)
        )
    return tuple(m for m in metrics if m not in PARAMETER_FAMILIES)


def warn_spikes(stage: int, spikes: Spikes | None) -> None:
    """The spike detector reads ``param.grad`` on every step: the probe turns it off under
    ZeRO, and says so where it would run (one process; under several it is off anyway)."""
    if spikes is not None and world_size() == 1:
        warnings.warn(
            f"normprobe: the spike detector (spikes) is off under DeepSpeed ZeRO stage {stage}: "
            "it reads each parameter's .grad on every step, and ZeRO keeps the gradients in its "
            "partitions; the logged steps' grad_norm is read from them. Pass spikes=None to "
            "attach() to silence this",
            RuntimeWarning,
            stacklevel=4,  # attach's caller (through Probe.__init__)
        )


class ZeroSteps:
    """Calls ``before`` when the ZeRO optimizer's step starts and ``after`` (if any) when it
    returns (``method``: another of ``optimizer``'s methods, a stage-0 engine's step).

    A ZeRO optimizer is no ``torch.optim.Optimizer`` and has no step hooks, and the torch
    optimizer inside it steps after the gradients are clipped: its ``step`` is wrapped on the
    instance instead, and `remove` restores it (or, if something wrapped it since, leaves the
    wrapper inert).
    """

    def __init__(
        self,
        optimizer: Any,
        before: Callable[[], None],
        after: Callable[[], None] | None,
        method: str = "step",
    ) -> None:
        self.optimizer = optimizer
        self.method = method
        self.active = True
        inner = getattr(optimizer, method)

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                before()
            out = inner(*args, **kwargs)
            if self.active and after is not None:
                after()
            return out

        self._step = step
        setattr(optimizer, method, step)
        self.handles = [self]

    def forward_started(self) -> None:
        """No step hooks nest here (`OptimizerSteps.forward_started`)."""

    def remove(self) -> None:
        self.active = False
        if vars(self.optimizer).get(self.method) is self._step:
            delattr(self.optimizer, self.method)
