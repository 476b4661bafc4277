"""Modules put on residual branches: `BranchScale` (ReZero, LayerScale, SkipInit, DeepNorm's
fixed 1/alpha) and `FixupScalars` (Fixup's scalar biases and multiplier).

Both wrap the module they scale (``.inner``) and answer for its attributes, so code reading
``layer.weight`` or ``layer.in_features`` keeps working. `normprobe.insert_branch_scale` and
`normprobe.reinit` put them in; `branch_scales` lists them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["BranchScale", "FixupScalars", "Wrapper", "branch_scales"]


class Wrapper(nn.Module):
    """Calls ``inner`` and reads unknown attributes (``weight``, ``in_features``) from it.

    A subclass registers its own parameters and buffers before it sets ``inner``: torch
    refuses a name the module already answers to, and an inner layer may have an attribute of
    that name (timm's ``ScaledStdConv2d`` has a float ``scale``).
    """

    inner: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None:
                raise
            return getattr(inner, name)


class BranchScale(Wrapper):
    """``inner(x) * scale``: a scalar or per-channel factor on the end of a residual branch.

    Inserted by `insert_branch_scale` (learnable ``scale`` parameter) and by
    ``reinit(model, "deepnorm")`` (a fixed ``1/alpha`` buffer). ``channel_dim`` is the dim a
    per-channel ``scale`` runs along (-1 for ``(..., C)`` outputs, 1 for ``(N, C, ...)``).
    """

    scale: torch.Tensor

    def __init__(
        self,
        inner: nn.Module,
        kind: str,
        value: torch.Tensor,
        channel_dim: int = -1,
        learnable: bool = True,
        gain_offset: float | None = None,
    ) -> None:
        super().__init__()
        if learnable:
            self.scale = nn.Parameter(value)
        else:
            self.register_buffer("scale", value)
        self.inner = inner
        self.kind = kind
        self.channel_dim = channel_dim
        self.gain_offset = gain_offset  # set when ``inner`` is a norm: how to fold into its gain

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        scale = self.scale
        if scale.ndim == 1 and self.channel_dim != -1:
            scale = scale.view(-1, *([1] * (out.ndim - 1 - self.channel_dim)))
        return out * scale

    def extra_repr(self) -> str:
        shape = "scalar" if self.scale.ndim == 0 else f"per-channel {self.scale.numel()}"
        return f"kind={self.kind}, {shape}, channel_dim={self.channel_dim}"


class FixupScalars(Wrapper):
    """``inner(x + bias_in) * scale + bias_out``: Fixup's scalar biases and multiplier.

    Every part is optional (None where absent). A branch layer has both biases and its
    branch's writers (``last=True``) the multiplier too; the stem has ``bias_out`` only (the bias
    before the activation after it), the classifier ``bias_in`` only. A projection shortcut is
    fed the same shifted input as its branch: its ``bias_in`` is the branch's first layer's
    (``shared_in``, the same Parameter under both names).
    """

    def __init__(
        self,
        inner: nn.Module,
        last: bool = False,
        *,
        bias_in: bool = True,
        bias_out: bool = True,
        shared_in: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        like = next(inner.parameters())

        def scalar(value: float) -> nn.Parameter:
            return nn.Parameter(torch.full((), value, dtype=like.dtype, device=like.device))

        self.bias_in = shared_in if shared_in is not None else scalar(0.0) if bias_in else None
        self.bias_out = scalar(0.0) if bias_out else None
        self.scale = scalar(1.0) if last else None
        self.inner = inner

    def reset(self) -> None:
        with torch.no_grad():
            for bias in (self.bias_in, self.bias_out):
                if bias is not None:
                    bias.zero_()
            if self.scale is not None:
                self.scale.fill_(1.0)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.bias_in is not None:
            x = x + self.bias_in
        out = self.inner(x, *args, **kwargs)
        if self.scale is not None:
            out = out * self.scale
        return out if self.bias_out is None else out + self.bias_out


def branch_scales(model: nn.Module) -> dict[str, BranchScale]:
    """Every `BranchScale` in ``model``, by path.

    Example::

        >>> {p: s.kind for p, s in normprobe.branch_scales(model).items()}
    """
    return {p: m for p, m in model.named_modules() if isinstance(m, BranchScale)}
