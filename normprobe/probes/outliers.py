"""Massive activations and outlier features of a residual stream."""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import feature_axis, feature_dim, plain, sample_stride, wide_dtype

# The median |x| of `outlier_parts` is taken over an evenly strided sample of at most this many
# entries (all of them in smaller tensors): a selection over a whole stream costs a block's
# forward, and the median of 512 entries of a Gaussian stream is within about 5% (one standard
# error, measured) of the whole stream's, where the ratio it divides is flagged at 100x; 2,048
# entries (2.5%) cost 5x the time (0.6 ms against 0.12 ms a logged step on 48 blocks).
MEDIAN_SAMPLE = 512
# The median leaves out the entries that are negligible: zero, or at most this share of the
# sample's 90th percentile of nonzero |x|. A ReLU's zeros are sparsity, not magnitude, and so are
# the near-zero half of a LeakyReLU(0.01)'s output, or a stream whose branches, zero at init,
# write 1e-3 into a ReLU's zeros (timm's CSPResNet-50): counted, they pull the median to the
# boundary of that mass and the ratio to thousands at init. A Gaussian stream loses 1.3% of its
# entries to it, its median moving by about 1%.
NEGLIGIBLE = 0.01


OutlierParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def outlier_parts(x: torch.Tensor, scratch: torch.Tensor | None = None) -> OutlierParts:
    """What `outlier_stats_many` needs of an activation with ``C`` channels along
    `feature_dim`: each channel's max |x| and sum of squares over all other positions (two
    ``C``-vectors), and a copy of an evenly strided sample of at most `MEDIAN_SAMPLE` entries
    of |x|, whose median nonzero value `outlier_stats_many` takes (for many activations in one
    call).

    Reduced in float32 or wider; the max is exact. ``scratch``: memory of ``x``'s shape in that
    type for |x| and its squares (else a temporary of that size is made).
    """
    x = plain(x)
    if x.ndim == 1:
        x = x.unsqueeze(0)  # one position
        scratch = None if scratch is None else scratch.unsqueeze(0)
    stride = sample_stride(x.shape, MEDIAN_SAMPLE)
    others = [d for d in range(x.ndim) if d != feature_dim(x) % x.ndim]
    return _parts(x, False, others, stride, scratch)


def outlier_parts_many(stacked: torch.Tensor, scratch: torch.Tensor | None = None) -> OutlierParts:
    """`outlier_parts` of each activation stacked along ``stacked``'s first axis, in one call
    per part: each part has a first axis of one row per activation."""
    x = plain(stacked)
    if x.ndim == 2:
        x = x.unsqueeze(1)  # one position each
        scratch = None if scratch is None else scratch.unsqueeze(1)
    one = x.shape[1:]
    channels = feature_axis(len(one)) + 1
    others = [d for d in range(1, x.ndim) if d != channels]
    return _parts(x, True, others, sample_stride(one, MEDIAN_SAMPLE), scratch)


def _parts(
    x: torch.Tensor, stacked: bool, others: list[int], stride: int, scratch: torch.Tensor | None
) -> OutlierParts:
    """`outlier_parts` of ``x`` (one activation, or several ``stacked`` along its first axis),
    reduced over the axes ``others``, sampled every ``stride``-th entry of each activation."""
    # |x| exact in the wide type, then squared in place: one temporary (or none), where max and
    # min, then the products vecdot forms, would read x three times and make a fresh one
    if scratch is None:
        magnitude = x.abs().to(wide_dtype(x))
    elif scratch.dtype == x.dtype:
        magnitude = torch.abs(x, out=scratch)
    else:
        magnitude = scratch.copy_(x).abs_()
    flat = magnitude.reshape(len(x), -1) if stacked else magnitude.reshape(-1)
    # a copy, taken from |x| while it is in the cache: x may change in place later
    sample = (flat if stride == 1 else flat[..., ::stride]).clone()
    top = magnitude.amax(dim=others)
    return top, magnitude.mul_(magnitude).sum(dim=others), sample


def outlier_stats_many(
    top: torch.Tensor, power: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """(max |x| / median non-negligible |x|, the channel holding that max, the kurtosis of the
    channels' RMS) from `outlier_parts`, as float32: three values, or ``(n, 3)`` for the parts
    of ``n`` activations stacked (channels and sampled entries along the last axis).

    The ratio's median is of the sample's |x| above `NEGLIGIBLE` times the 90th percentile of
    its nonzero |x| (the whole tensor up to `MEDIAN_SAMPLE` entries; torch's median and
    quantile, the lower middle value of an even count and the lower of two neighbours); the
    ratio is NaN when no sampled entry is nonzero.
    The channel is the first holding the largest |x|. With s_j the RMS of channel j over all
    other positions, the kurtosis mean(s^4) / mean(s^2)^2 is 1 when every channel has the same
    RMS and the number of channels when one holds everything.
    """
    top, channel = top.max(dim=-1)
    median = _typical_magnitude(sample)
    # the sums of squares scaled by the largest, so that their squares cannot overflow float32
    power = power / power.amax(dim=-1, keepdim=True)
    kurtosis = power.pow(2).mean(dim=-1) / power.mean(dim=-1).pow(2)
    stats = [top / median, channel.to(top.dtype), kurtosis]
    return torch.stack(stats, dim=-1).float()


def _typical_magnitude(magnitude: torch.Tensor) -> torch.Tensor:
    """The median of each row's non-negligible entries of ``magnitude`` (|x| above `NEGLIGIBLE`
    times the row's 90th percentile of nonzero |x|; NaNs left out; the lower middle of an even
    count; NaN where no entry is nonzero or that percentile is infinite)."""
    if magnitude.device.type != "cpu" or magnitude.dtype not in (torch.float32, torch.float64):
        wide = magnitude.to(torch.promote_types(magnitude.dtype, torch.float32))
        nonzero = wide.masked_fill(wide == 0, math.nan)
        high = nonzero.nanquantile(0.9, dim=-1, keepdim=True, interpolation="lower")
        kept = nonzero.masked_fill(nonzero <= NEGLIGIBLE * high, math.nan)
        return kept.nanmedian(dim=-1).values
    # on a CPU, numpy's vectorized sort then picks: about a tenth of torch's selection (0.3 ms
    # for 48 rows of 512 entries), whose comparisons branch on the data. The zeros and NaNs
    # become +inf, sorted after the values kept (a kept +inf among them).
    flat = magnitude.detach().numpy().reshape(-1, magnitude.shape[-1])
    nonzero_at = flat > 0
    counts = np.count_nonzero(nonzero_at, axis=-1)
    rows = np.where(nonzero_at, flat, np.inf)
    rows.sort(axis=-1)
    at = np.arange(len(rows))
    high = rows[at, (np.maximum(counts - 1, 0) * 9) // 10]  # numpy's "lower" 90th percentile
    negligible = np.count_nonzero(rows <= NEGLIGIBLE * high[:, None], axis=-1)
    negligible = np.minimum(negligible, np.maximum(counts - 1, 0))  # in bounds
    middle = rows[at, negligible + np.maximum(counts - negligible - 1, 0) // 2]
    median = np.where((counts > 0) & np.isfinite(high), middle, np.nan).astype(flat.dtype)
    return torch.from_numpy(median.reshape(magnitude.shape[:-1]))


def outlier_stats(x: torch.Tensor) -> torch.Tensor:
    """`outlier_stats_many` of one activation: (ratio, channel, kurtosis)."""
    return outlier_stats_many(*outlier_parts(x))
