"""The loss scale of ``torch.amp.GradScaler`` (Micikevicius et al. 2018) in the gradients read.

``scaler.scale(loss).backward()`` leaves gradients multiplied by the scaler's scale at the end
of the backward; ``scaler.unscale_(opt)`` (called by the user before clipping, or by
``scaler.step(opt)``) divides it out in place, before the optimizer steps. A scaler handed to
``attach`` is known from the start; one that was not is found when it steps the optimizer:
``scaler.step(opt)`` calls ``opt.step()`` from its own frames, where the step hook looks for it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState

# how far up from the step hook the scaler's frame is looked for (the hook, the optimizer's
# step wrappers, GradScaler._maybe_opt_step and GradScaler.step: about 8)
DEPTH = 16
_STEPPING = {"step", "_maybe_opt_step"}  # GradScaler's methods that call optimizer.step()


def stepping_scaler() -> GradScaler | None:
    """The enabled GradScaler whose ``step`` calls the optimizer step now in progress, or None
    (called from inside that step's hooks)."""
    frame = sys._getframe(1)
    for _ in range(DEPTH):
        if frame.f_code.co_name in _STEPPING:
            owner = frame.f_locals.get("self")
            if isinstance(owner, GradScaler) and owner.is_enabled():
                return owner
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def loss_scale(scaler: Any, optimizer: Any, at_step: bool) -> torch.Tensor | None:
    """The scale ``scaler`` multiplied the loss by, on the device (no host sync), that the
    gradients carry now; None without one, and at the step (``at_step``) once the scaler has
    unscaled ``optimizer``'s gradients."""
    if scaler is None or not scaler.is_enabled():
        return None
    if at_step and optimizer is not None:
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
        if state is not None and state["stage"] is not OptState.READY:
            return None
    scale: torch.Tensor | None = getattr(scaler, "_scale", None)  # None before its first scale()
    return scale
