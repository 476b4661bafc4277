"""muP's per-layer learning rates and weight decays, as ``torch.optim`` parameter groups."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from torch import nn

from .shapes import MupShape, shape_records

Optimizer = Literal["adam", "sgd"]


def mup_param_groups(
    model: nn.Module,
    lr: float,
    optimizer: Optimizer = "adam",
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Parameter groups with muP's per-layer learning rate and weight decay.

    With m a parameter's fan-in multiplier (its width over the base width):

    * ``adam`` (Adam, AdamW and other entrywise-normalized optimizers): hidden matrices and the
      readout get ``lr/m`` and ``weight_decay*m``; everything else ``lr``.
    * ``sgd``: hidden matrices ``lr*fanout_m/fanin_m``; the readout ``lr/m``; input weights,
      biases and gains ``lr*m`` (``weight_decay/m``); fixed parameters ``lr``.

    The readout's entries differ from microsoft/mup's by its folded output multiplier, which
    makes the training dynamics the same.

    Args:
        model: a model marked by `mup`.
        lr: the learning rate tuned at the base width.
        optimizer: ``adam`` or ``sgd``.
        weight_decay: the weight decay tuned at the base width.

    Returns:
        A list of ``{"params", "lr", "weight_decay"}`` dicts for ``torch.optim`` (parameters
        with ``requires_grad=False`` are left out).

    Raises:
        ValueError: the model was never marked, an unknown optimizer, or ``lr <= 0``.

    Example::

        >>> opt = torch.optim.AdamW(normprobe.mup_param_groups(model, lr=1e-2, weight_decay=0.1))
    """
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    records = shape_records(model)
    unmarked = [s.name for s, _ in records if not s.marked]
    if unmarked:
        warnings.warn(
            f"{len(unmarked)} parameters were added after mup() ({unmarked[:3]}) and are "
            "treated as width-independent; call mup() after surgery to mark them",
            UserWarning,
            stacklevel=2,
        )
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for s, p in records:
        if not p.requires_grad:
            continue
        lr_mult, wd_mult = _multipliers(s, optimizer)
        groups.setdefault((lr * lr_mult, weight_decay * wd_mult), []).append(p)
    return [{"params": ps, "lr": g_lr, "weight_decay": wd} for (g_lr, wd), ps in groups.items()]


def _multipliers(s: MupShape, optimizer: str) -> tuple[float, float]:
    """(lr factor, weight-decay factor) of one parameter."""
    if s.kind == "output":
        return 1 / s.fanin_mult, s.fanin_mult
    if optimizer == "adam":
        if s.kind == "hidden":
            return 1 / s.fanin_mult, s.fanin_mult
        return 1.0, 1.0
    if s.kind == "hidden":
        ratio = s.fanin_mult / s.fanout_mult
        return 1 / ratio, ratio
    if s.kind in ("input", "vector"):
        return s.fanout_mult, 1 / s.fanout_mult
    return 1.0, 1.0
