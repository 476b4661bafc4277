"""Norm layers that `convert_norms` builds when torch has no class for the job.

`DyT` is Dynamic Tanh (Zhu et al., 2025), a drop-in replacement for a norm layer that computes no
statistics. `LayerNorm2d`, `RMSNorm2d` and `BatchNormNd` hold the same parameters as their torch
counterparts (so state_dict keys match) and differ only in which axis they read. `PerHeadLayerNorm`
and `PerHeadRMSNorm` normalize each head's features with a gain per head and feature (Cohere's
q_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BatchNormNd", "DyT", "LayerNorm2d", "PerHeadLayerNorm", "PerHeadRMSNorm", "RMSNorm2d"]


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(1, -1)


def _channels_first(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(-1, 1)


class DyT(nn.Module):
    """Dynamic Tanh: ``weight * tanh(alpha * x) + bias``, with one learnable scalar ``alpha``.

    Args:
        normalized_shape: the trailing feature shape ``weight`` and ``bias`` cover, or with
            ``channels_first`` the number of channels at dim 1 of an ``(N, C, *)`` input.
        alpha_init: the starting value of ``alpha`` (0.5 in the DyT paper for vision models).
        channels_first: apply ``weight``/``bias`` along dim 1 (convolutional feature maps).
        elementwise_affine: whether to learn ``weight`` (initialized to 1).
        bias: whether to learn ``bias`` (initialized to 0).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Example::

        >>> DyT(768)(torch.randn(2, 16, 768)).shape
        torch.Size([2, 16, 768])
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        alpha_init: float = 0.5,
        *,
        channels_first: bool = False,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        if channels_first and len(shape) != 1:
            raise ValueError(
                f"a channels-first DyT takes one channel count, got normalized_shape={shape}"
            )
        self.normalized_shape = tuple(shape)
        self.channels_first = channels_first
        self.alpha_init = alpha_init
        # shape (1,) like the reference implementation, so its checkpoints load
        self.alpha = nn.Parameter(torch.full((1,), alpha_init, device=device, dtype=dtype))
        self.weight = (
            nn.Parameter(torch.ones(shape, device=device, dtype=dtype))
            if elementwise_affine
            else None
        )
        self.bias = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha * x)
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if self.channels_first:
            trailing = (1,) * (x.ndim - 2)
            weight = None if weight is None else weight.view(-1, *trailing)
            bias = None if bias is None else bias.view(-1, *trailing)
        if weight is not None and bias is not None:
            return torch.addcmul(bias, y, weight)
        if weight is not None:
            return y * weight
        if bias is not None:
            return y + bias
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, alpha_init={self.alpha_init}, "
            f"channels_first={self.channels_first}, elementwise_affine={self.weight is not None}, "
            f"bias={self.bias is not None}"
        )


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels (dim 1) of an ``(N, C, *)`` input, at every position.

    The statistics ConvNeXt's norm computes; ``normalized_shape`` is ``(C,)``.
    """

    data_format = "channels_first"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(_channels_last(x), self.normalized_shape, self.weight, self.bias, self.eps)
        return _channels_first(y)


class RMSNorm2d(nn.RMSNorm):
    """RMSNorm over the channels (dim 1) of an ``(N, C, *)`` input, at every position."""

    data_format = "channels_first"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(_channels_last(x), self.normalized_shape, self.weight, self.eps)
        return _channels_first(y)


def _affine_shape(
    normalized: tuple[int, ...], affine_shape: int | tuple[int, ...]
) -> tuple[int, ...]:
    shape = (affine_shape,) if isinstance(affine_shape, int) else tuple(affine_shape)
    if len(shape) < len(normalized) or shape[len(shape) - len(normalized) :] != normalized:
        raise ValueError(
            f"affine_shape={shape} must end with normalized_shape={normalized}, e.g. "
            f"(heads, *normalized_shape)"
        )
    return shape


class PerHeadLayerNorm(nn.LayerNorm):
    """LayerNorm over the last dims ``normalized_shape``, with a gain and bias of ``affine_shape``.

    ``affine_shape`` ends with ``normalized_shape``: for ``(heads, head_dim)`` and
    ``(head_dim,)``, each head's features are normalized on their own and scaled by that head's
    gain (Cohere's q_norm/k_norm). Inputs end with ``affine_shape``.
    """

    data_format = "channels_last"

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        affine_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, False, False, device=device, dtype=dtype)
        self.affine_shape = _affine_shape(tuple(self.normalized_shape), affine_shape)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            ones = torch.ones(self.affine_shape, device=device, dtype=dtype)
            self.weight = nn.Parameter(ones)
            if bias:
                self.bias = nn.Parameter(torch.zeros_like(ones))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if weight is not None and bias is not None:
            return torch.addcmul(bias, y, weight)
        return y if weight is None else y * weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, affine_shape={self.affine_shape}"


class PerHeadRMSNorm(nn.RMSNorm):
    """RMSNorm over the last dims ``normalized_shape``, with a gain of ``affine_shape``.

    The RMSNorm counterpart of `PerHeadLayerNorm` (a gain per head and feature, statistics over
    each head's features).
    """

    data_format = "channels_last"

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        affine_shape: int | tuple[int, ...],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, False, device=device, dtype=dtype)
        self.affine_shape = _affine_shape(tuple(self.normalized_shape), affine_shape)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.affine_shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, self.normalized_shape, None, self.eps)
        weight: torch.Tensor | None = self.weight
        return y if weight is None else y * weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, affine_shape={self.affine_shape}"


class BatchNormNd(_BatchNorm):
    """BatchNorm over dim 1 of an ``(N, C, *)`` input of any rank.

    What `convert_norms` builds when the source layer does not say whether its input is 2-D, 3-D
    or 4-D (GroupNorm, SyncBatchNorm); its state_dict matches ``nn.BatchNorm1d/2d/3d``.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an (N, C, *) input of 2 or more dims, got {input.dim()}D")
