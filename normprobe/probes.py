"""The statistics normprobe logs, as pure tensor functions.

Every function reduces in float32 and returns tensors on the input's device: nothing here
reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Attention-logit entries at or below this are taken as masked (HF uses finfo.min, older code
# -1e9 or -10000); no unmasked logit of a working model is that negative.
MASKED_LOGIT = -1e4


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of all elements: sqrt(mean(x^2)), reduced in float32 or wider."""
    wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.linalg.vector_norm(x.detach(), dtype=wide) / math.sqrt(max(x.numel(), 1))


def feature_dim(x: torch.Tensor) -> int:
    """The feature axis: channels (dim 1) for images (N, C, H, W), else the last one."""
    return 1 if x.ndim >= 4 else -1


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of ``a`` and ``b`` along the feature axis, averaged over positions.

    Between consecutive blocks' residual streams this approaches 1 when deep blocks stop
    changing the representation (Pre-LN representation collapse).
    """
    dim = feature_dim(a)
    return F.cosine_similarity(a.detach().float(), b.detach().float(), dim=dim).mean()


def grad_squares(groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Sum of squared gradient entries of each group of parameters (0 without gradients).

    The square root is each block's gradient L2 norm. Squares, unlike norms, add up across
    the shards of a sharded (FSDP) gradient.

    Args:
        groups: per block, its parameters.

    Returns:
        A float32 vector with one value per group, on the first gradient's device.
    """
    grads = [[p.grad.detach() for p in params if p.grad is not None] for params in groups]
    flat = [g for group in grads for g in group]
    if not flat:
        return torch.zeros(len(groups))
    device = flat[0].device
    squares = torch.stack([n.to(device) for n in torch._foreach_norm(flat)]).float().pow(2)
    sizes = [len(group) for group in grads]
    per_group = [part.sum() for part in squares.split(sizes)]  # type: ignore[no-untyped-call]
    return torch.stack(per_group)


def sample_stride(shape: Sequence[int], budget: int) -> int:
    """Stride for an evenly spread sample of at most ``budget`` entries of a tensor.

    1 (every entry) when the tensor fits; otherwise a prime that does not divide the last
    dimension, so that the sample walks through all columns instead of repeating a few.
    """
    numel = math.prod(shape)
    if numel <= budget:
        return 1
    stride = max(2, math.ceil(numel / budget))
    last = shape[-1] if shape else 1
    while not _is_prime(stride) or last % stride == 0:
        stride += 1
    return stride


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def strided_sample(t: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th entry of ``t`` (flattened), as a new tensor."""
    return t.detach().reshape(-1)[::stride].clone()


def update_squares(
    before: Sequence[Sequence[tuple[torch.Tensor, int, torch.Tensor]]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared size of each group's change across an optimizer step, and of its old value.

    ``sqrt(change / old)`` is the update-to-weight ratio ||new - old|| / ||old||.

    Args:
        before: per group, ``(parameter, stride, sample taken before the step)`` for each of its
            parameters; squared sums of a strided sample are scaled by the stride, so a sample
            estimates the whole tensor (exact with stride 1).

    Returns:
        Two float32 vectors, one value per group.
    """
    changes: list[torch.Tensor] = []
    olds: list[torch.Tensor] = []
    for group in before:
        delta = torch._foreach_norm([strided_sample(p, s) - old for p, s, old in group])
        size = torch._foreach_norm([old for _, _, old in group])
        device = group[0][2].device
        weights = [float(s) for _, s, _ in group]
        for norms, out in ((delta, changes), (size, olds)):
            squares = torch._foreach_mul(torch._foreach_pow(norms, 2), weights)
            out.append(torch.stack([v.to(device).float() for v in squares]).sum())
    return torch.stack(changes), torch.stack(olds)


def logit_stats(logits: torch.Tensor) -> torch.Tensor:
    """(max |logit|, RMS, mean log-sum-exp over the last axis) of output logits.

    The mean log-sum-exp is the "z" that z-loss keeps near 0.
    """
    x = logits.detach().float()
    return torch.stack([x.abs().amax(), rms(x), torch.logsumexp(x, dim=-1).mean()])


def masked_abs_max(scores: torch.Tensor) -> torch.Tensor:
    """max |s| over attention logits, skipping masked entries (-inf or <= MASKED_LOGIT)."""
    s = scores.detach().float()
    valid = s > MASKED_LOGIT
    return torch.where(valid, s.abs(), torch.zeros((), device=s.device)).amax()


def sdpa_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """max |q . k| * scale over the logits ``scaled_dot_product_attention`` would compute.

    The logits are materialized in float32 a block of query rows at a time, so memory stays
    near ``chunk_elements`` floats whatever the sequence length. Masked positions are skipped.
    Grouped-query attention (fewer key heads) is expanded.
    """
    q, k = query.detach().float(), key.detach().float()
    if k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    t_q, t_k = q.shape[-2], k.shape[-2]
    rows_per_chunk = max(1, chunk_elements // max(1, q[..., :1, :1].numel() * t_k))
    best = torch.zeros((), device=q.device)
    kt = k.transpose(-1, -2)
    for start in range(0, t_q, rows_per_chunk):
        stop = min(t_q, start + rows_per_chunk)
        s = q[..., start:stop, :] @ kt  # unscaled: max |s * c| = |c| * max |s|
        m = None
        if attn_mask is not None:
            m = attn_mask[..., start:stop, :] if attn_mask.shape[-2] == t_q else attn_mask
        if m is not None and m.dtype != torch.bool:  # an additive mask: add it, then skip
            best = torch.maximum(best, masked_abs_max(s * scale + m.float()))
            continue
        if m is not None:
            s = s.masked_fill(~m, 0.0)  # 0 never wins a max of |.|
        if is_causal:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            cols = torch.arange(t_k, device=q.device)[None, :]
            s.masked_fill_(cols > rows + (t_k - t_q), 0.0)
        best = torch.maximum(best, torch.maximum(s.amax(), -s.amin()) * abs(scale))
    return best


def batchnorm_stats(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """How far a batch is from a BatchNorm's running statistics, and what that does.

    Returns float32 (mean_drift, var_drift, train_eval_gap):

    * mean_drift: mean over channels of |mu_batch - mu_run| / sqrt(var_run + eps);
    * var_drift: mean over channels of |log((var_batch + eps) / (var_run + eps))|;
    * train_eval_gap: RMS(y_train - y_eval) / RMS(y_train), where y_train normalizes the batch
      with its own statistics (train mode) and y_eval with the running ones (eval mode).
    """
    xf = x.detach().float()
    dims = [d for d in range(xf.ndim) if d != 1]
    mean_b = xf.mean(dim=dims)
    var_b = xf.var(dim=dims, unbiased=False)
    mean_r, var_r = running_mean.detach().float(), running_var.detach().float()
    mean_drift = ((mean_b - mean_r).abs() / (var_r + eps).sqrt()).mean()
    var_drift = ((var_b + eps) / (var_r + eps)).log().abs().mean()
    w = None if weight is None else weight.detach().float()
    b = None if bias is None else bias.detach().float()
    y_train = F.batch_norm(xf, None, None, w, b, training=True, eps=eps)
    y_eval = F.batch_norm(xf, mean_r, var_r, w, b, training=False, eps=eps)
    gap = rms(y_train - y_eval) / rms(y_train).clamp_min(1e-30)
    return torch.stack([mean_drift, var_drift, gap])


def gain_stats(weight: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """(mean, std) of a norm's effective gain ``offset + weight`` (Gemma: offset 1)."""
    g = weight.detach().float() + offset
    return torch.stack([g.mean(), g.std(unbiased=False)])


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN or Inf in ``x``.

    One pass: a float32 sum carries any NaN or Inf (it would overflow only for entries near
    1e38 / numel, far past any trained network's activations).
    """
    return torch.isfinite(x.detach().sum(dtype=torch.float32))


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
