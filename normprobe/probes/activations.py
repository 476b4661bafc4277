"""Statistics of activations and norm gains: RMS, per-position norms and cosines, finite sums,
BatchNorm running statistics and norm gains."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .base import (
    feature_axis,
    feature_dim,
    large_on_cpu,
    plain,
    square_sum,
    stack_scalars,
    wide_dtype,
)
from .shards import any_dtensor, local, local_part
from .squares import squared_norms


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of all elements: sqrt(mean(x^2)), reduced in float32 or wider."""
    return square_sum(x, wide_dtype(x)).sqrt() / math.sqrt(max(x.numel(), 1))


def rms_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`rms` of each tensor, as one float32 vector, in one batched reduction."""
    large = any(large_on_cpu(t) for t in tensors)  # row by row, as `square_sum` reads them
    mixed = large and any(t.device.type != "cpu" for t in tensors)
    if any_dtensor(tensors) or any(t.dtype == torch.float64 for t in tensors) or mixed:
        return torch.stack([rms(t).float() for t in tensors])
    if large:
        sizes = torch.tensor([max(t.numel(), 1) for t in tensors], dtype=torch.float32)
        return squared_norms(tensors).float().div_(sizes).sqrt_()
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    scales = [1 / math.sqrt(max(t.numel(), 1)) for t in tensors]
    return stack_scalars(torch._foreach_mul(norms, scales))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of the feature vector (along `feature_dim`) at each position, flattened into one
    vector, in float32 or wider. Its own L2 norm is ``x``'s."""
    return torch.linalg.vector_norm(plain(x), dim=feature_dim(x), dtype=wide_dtype(x)).reshape(-1)


def row_norms_many(stacked: torch.Tensor) -> torch.Tensor:
    """`row_norms` of each tensor stacked along ``stacked``'s first axis: (tensors, positions)."""
    dim = _stacked_feature_dim(stacked)
    norms = torch.linalg.vector_norm(plain(stacked), dim=dim, dtype=wide_dtype(stacked))
    return norms.reshape(len(stacked), -1)


def rms_from_row_norms(norms: torch.Tensor, numel: int) -> torch.Tensor:
    """The RMS of a tensor of ``numel`` elements from its `row_norms` (last axis); rows of
    several tensors of that size stacked give one RMS each."""
    return torch.linalg.vector_norm(norms, dim=-1) / math.sqrt(max(numel, 1))


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product of ``a`` and ``b`` along `feature_dim` at each position, flattened like
    `row_norms`, in float32 or wider."""
    wide, dim = wide_dtype(a), feature_dim(a)
    a, b = (plain(t) if t.dtype == wide else plain(t).to(wide) for t in (a, b))
    if a.device.type == "cpu" and dim == a.ndim - 1:
        # a dot product per position, without the product tensor vecdot makes: on a CPU, a
        # stream's worth of fresh memory each call
        features = a.shape[-1]
        return torch.bmm(a.reshape(-1, 1, features), b.reshape(-1, features, 1)).reshape(-1)
    return torch.linalg.vecdot(a, b, dim=dim).reshape(-1)


def row_dots_many(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`row_dots` of each pair of tensors stacked along ``a``'s and ``b``'s first axis."""
    wide, dim = wide_dtype(a), _stacked_feature_dim(a)
    a, b = (plain(t) if t.dtype == wide else plain(t).to(wide) for t in (a, b))
    return torch.linalg.vecdot(a, b, dim=dim).reshape(len(a), -1)


def _stacked_feature_dim(stacked: torch.Tensor) -> int:
    """`feature_dim` of the tensors stacked along ``stacked``'s first axis, in ``stacked``."""
    return feature_axis(stacked.ndim - 1) + 1


def cosines_from_rows(
    dots: torch.Tensor, norms_a: torch.Tensor, norms_b: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """Mean over positions (the last axis) of ``dots / (norms_a * norms_b)``, each norm at
    least ``eps``; rows stacked along a first axis give one mean cosine per pair of tensors."""
    return (dots / (norms_a.clamp_min(eps) * norms_b.clamp_min(eps))).mean(dim=-1)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of ``a`` and ``b`` along the feature axis, averaged over positions.

    Between consecutive blocks' residual streams this approaches 1 when deep blocks stop
    changing the representation (Pre-LN representation collapse).
    """
    return cosines_from_rows(row_dots(a, b), row_norms(a), row_norms(b))


def gain_moments(weight: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """(sum, sum of squares, count) of ``offset + weight - 1`` over this rank's shard.

    Summed over ranks, `gain_from_moments` turns them into the whole gain's (mean, std).
    """
    g = local(weight).detach().float() + (offset - 1.0)
    return torch.stack([g.sum(), g.pow(2).sum(), g.new_full((), g.numel())])


def gain_from_moments(total: float, squares: float, count: float) -> tuple[float, float]:
    """(mean, std) of a gain from its summed `gain_moments` (host floats)."""
    if count <= 0:
        return math.nan, math.nan
    mean = total / count
    return 1.0 + mean, math.sqrt(max(squares / count - mean * mean, 0.0))


def batchnorm_stats(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    init_share: torch.Tensor | None = None,
) -> torch.Tensor:
    """How far a batch is from a BatchNorm's running statistics, and what that does.

    Returns float32 (mean_drift, var_drift, train_eval_gap, settled_mean_drift,
    settled_var_drift):

    * mean_drift: mean over channels of |mu_batch - mu_run| / sqrt(var_run + eps);
    * var_drift: mean over channels of |log((var_batch + eps) / (var_run + eps))|;
    * train_eval_gap: RMS(y_train - y_eval) / RMS(y_train), where y_train normalizes the batch
      with its own statistics (train mode) and y_eval with the running ones (eval mode);
    * the two drifts again against the running statistics with their initial values (mean 0,
      variance 1) discounted, as Adam corrects its moments' bias: ``init_share`` is the weight
      those values still hold, ``(1 - momentum) ** num_batches_tracked`` (None or 1: none).
    """
    xf = x.detach().float()
    dims = [d for d in range(xf.ndim) if d != 1]
    mean_b = xf.mean(dim=dims)
    var_b = xf.var(dim=dims, unbiased=False)
    mean_r, var_r = running_mean.detach().float(), running_var.detach().float()
    drifts = _drifts(mean_b, var_b, mean_r, var_r, eps)
    settled = drifts
    if init_share is not None:
        kept = 1 - init_share.float()
        known = kept > 1e-3  # the running statistics hold some batch
        denom = torch.where(known, kept, torch.ones_like(kept))
        mean_s = torch.where(known, mean_r / denom, mean_r)
        var_s = torch.where(known, (var_r - init_share.float()) / denom, var_r).clamp_min(0.0)
        settled = _drifts(mean_b, var_b, mean_s, var_s, eps)
    w = None if weight is None else weight.detach().float()
    b = None if bias is None else bias.detach().float()
    y_train = F.batch_norm(xf, None, None, w, b, training=True, eps=eps)
    y_eval = F.batch_norm(xf, mean_r, var_r, w, b, training=False, eps=eps)
    gap = rms(y_train - y_eval) / rms(y_train).clamp_min(1e-30)
    return torch.stack([*drifts, gap, *settled])


def _drifts(
    mean_b: torch.Tensor, var_b: torch.Tensor, mean_r: torch.Tensor, var_r: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean drift, var drift) of batch statistics against running ones (`batchnorm_stats`)."""
    mean_drift = ((mean_b - mean_r).abs() / (var_r + eps).sqrt()).mean()
    var_drift = ((var_b + eps) / (var_r + eps)).log().abs().mean()
    return mean_drift, var_drift


def gain_stats(weight: torch.Tensor, offset: float | torch.Tensor = 0.0) -> torch.Tensor:
    """(mean, std) along the last axis of a norm's effective gain ``offset + weight`` (Gemma:
    offset 1); for stacked ``(n, C)`` weights and ``(n,)`` offsets, one row per norm."""
    g = weight.detach().float()
    return torch.stack([g.mean(dim=-1) + offset, g.std(dim=-1, unbiased=False)], dim=-1)


def finite_sum(x: torch.Tensor) -> torch.Tensor:
    """The float32 sum of ``x``: NaN or Inf exactly when ``x`` holds one.

    One pass, read back with the step's other statistics (a sum overflows only for entries
    near 1e38 / numel, far past any trained network's activations).
    """
    return plain(local_part(x)).sum(dtype=torch.float32)


def finite_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`finite_sum` of each tensor, as one vector: NaN or Inf exactly where a tensor holds one."""
    return stack_scalars([finite_sum(t) for t in tensors])


def loglog_slope(values: Sequence[float]) -> float:
    """Least-squares slope of log(value) against log(depth) for depths 1..L (host floats).

    Pre-LN's sqrt(l) residual growth gives 0.5; a flat profile gives 0.
    """
    points = [(math.log(i + 1), math.log(v)) for i, v in enumerate(values) if v > 0]
    if len(points) < 2:
        return float("nan")
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
