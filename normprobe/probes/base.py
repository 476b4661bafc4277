"""Helpers the statistics share: the float type they reduce in, stacking scalars, the feature axis,
and evenly spread samples."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch


def wide_dtype(x: torch.Tensor) -> torch.dtype:
    """The float type to reduce ``x`` in: its own if float32 or float64, else float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


# On a CPU, torch reduces a whole float32 tensor's squares in one running sum per vector lane: the
# relative error grows with the entries, 2e-5 at 2**20 and 1e-3 at 2**24 (1e-2 at 1e8, a large
# embedding's gradient). Reduced a row of `ROW` entries at a time, the rows' squares then summed
# by torch's pairwise sum, it stays under 1e-7.
ROW = 1 << 12


def large_on_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain CPU tensor large enough for `square_sum`'s rows to matter."""
    plain_type = type(x) in (torch.Tensor, torch.nn.Parameter)
    return plain_type and x.device.type == "cpu" and x.numel() > 16 * ROW


def square_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of ``x``'s squared entries, reduced in ``dtype``; exact to float32 rounding on
    large CPU tensors too (`ROW`)."""
    x = plain(x)
    if not large_on_cpu(x):
        return torch.linalg.vector_norm(x, dtype=dtype).square()
    return square_sums([x], dtype)[0]


def square_sums(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`square_sum` of each of several large CPU tensors, as one vector in ``dtype``: one call
    per tensor for the norms of its rows, the rows' squares of all of them summed at once, in
    float64 (a few thousand rows a tensor, where a float32 running sum would drift again)."""
    rows = [_row_norms(plain(x), dtype) for x in tensors]
    counts = torch.tensor([len(r) for r in rows])
    owners = torch.repeat_interleave(torch.arange(len(rows)), counts)
    return group_sums(torch.cat(rows).double().square_(), owners, len(rows)).to(dtype)


def _row_norms(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Norms of ``x``'s rows of `ROW` entries (a contiguous tensor; the rest of its entries as
    one more row), or of its last axis (a view, read without a copy)."""
    if not x.is_contiguous():
        return torch.linalg.vector_norm(x, dim=-1, dtype=dtype).reshape(-1)
    numel = x.numel()
    head = numel - numel % ROW
    if head == numel:
        return torch.linalg.vector_norm(x.view(-1, ROW), dim=1, dtype=dtype)
    flat = x.view(-1)
    rows = torch.linalg.vector_norm(flat[:head].view(-1, ROW), dim=1, dtype=dtype)
    tail = torch.linalg.vector_norm(flat[head:], dtype=dtype).reshape(1)
    return torch.cat([rows, tail])


def group_sums(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """``out[g]``: the sum of the ``values[i]`` with ``index[i] == g``, for ``g < groups``."""
    return values.new_zeros(groups).index_add_(0, index, values)


def stack_scalars(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Scalars (possibly on several devices) as one vector on the first one's device."""
    device = values[0].device
    return torch.stack([v if v.device == device else v.to(device) for v in values])


def feature_dim(x: torch.Tensor) -> int:
    """The feature axis: channels (dim 1) for images (N, C, H, W), else the last one."""
    return feature_axis(x.ndim)


def feature_axis(ndim: int) -> int:
    """`feature_dim` of a tensor of ``ndim`` dimensions, counted from 0."""
    return 1 if ndim >= 4 else ndim - 1


@functools.lru_cache(maxsize=256)  # a stream's shape comes back at every logged step
def sample_stride(shape: tuple[int, ...], budget: int) -> int:
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


def plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` outside autograd: detached where it requires a gradient, else itself (a detach is
    one more dispatch for each of the many small tensors a logged step reads)."""
    return x.detach() if x.requires_grad else x


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one of them detached from the other) are views of the same
    memory with the same layout; False for tensor subclasses (a DTensor's storage is its
    shards')."""
    return (
        type(a) is type(b) is torch.Tensor
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
