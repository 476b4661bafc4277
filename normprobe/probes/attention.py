"""Attention logits: the largest |q·k| per head, formed from q and k (over a sample of the products
for long sequences) or read off formed scores."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .activations import rms


def logit_stats(logits: torch.Tensor) -> torch.Tensor:
    """(max |logit|, RMS, mean log-sum-exp over the last axis) of output logits.

    The mean log-sum-exp is the "z" that z-loss keeps near 0.
    """
    x = logits.detach().float()
    return torch.stack([x.abs().amax(), rms(x), torch.logsumexp(x, dim=-1).mean()])


def abs_max(scores: torch.Tensor) -> torch.Tensor:
    """max |s| over attention logits, as float32 (a max is exact in the logits' own dtype, so
    no float32 copy of them is made)."""
    low, high = torch.aminmax(scores.detach())
    return torch.maximum(high, -low).float()


def head_abs_max(scores: torch.Tensor, heads: int) -> torch.Tensor:
    """max |s| of each of ``heads`` heads over attention logits (..., queries, keys), as float32.

    The dims before the last two are flattened; their index modulo ``heads`` is the head, which
    holds for (batch, heads, ...) and for (batch * heads, ...) alike. When they do not split
    into ``heads`` (a layout discovery could not read), every head gets the overall max.
    """
    s = scores.detach()
    if s.ndim < 2:
        return abs_max(s).expand(heads)
    dims = (-2, -1)
    per_slice = torch.maximum(s.amax(dim=dims), -s.amin(dim=dims)).float().reshape(-1)
    if per_slice.numel() % heads:
        return per_slice.amax().expand(heads)
    return per_slice.view(-1, heads).amax(dim=0)


SAMPLE_SHARE = 8  # the logit max forms the logits of 1 query row in 8 with every key, and of


SAMPLE_ROWS = 64  # 1 key in 8 with every query; at least 64 of each per sequence and head


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(-2, index.expand(*index.shape[:-1], x.shape[-1]))


def logit_sample(query: torch.Tensor, key: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (queries, keys) whose products `sdpa_logit_max` forms: ``[(query, key)]`` when that
    costs no more than the sample, else the queries with every key and every query with the
    keys, a `SAMPLE_SHARE`-th of each per sequence and head (at least `SAMPLE_ROWS`).

    The keys taken are those farthest from the mean key m (an attention sink, an outlier); for
    the rest, |q . k| <= |q . m| + |q| r, r the largest distance |k - m| left, and the queries
    taken are those with the largest such bound. ``key`` may have fewer heads than ``query``
    (grouped-query attention).
    """
    t_q, t_k = query.shape[-2], key.shape[-2]
    rows = max(SAMPLE_ROWS, -(-t_q // SAMPLE_SHARE))
    cols = max(SAMPLE_ROWS, -(-t_k // SAMPLE_SHARE))
    if rows * t_k + t_q * cols >= t_q * t_k:
        return [(query, key)]
    mean = key.mean(dim=-2, keepdim=True)
    far = torch.linalg.vector_norm(key - mean, dim=-1, keepdim=True).topk(cols + 1, dim=-2)
    radius = far.values[..., cols:, :]  # the largest distance among the keys not taken
    if min(query.ndim, key.ndim) >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        mean, radius = (t.repeat_interleave(group, dim=-3) for t in (mean, radius))
    bound = (query @ mean.transpose(-1, -2)).abs()  # (..., queries, 1)
    bound += torch.linalg.vector_norm(query, dim=-1, keepdim=True) * radius
    index = bound.topk(rows, dim=-2, sorted=False).indices
    return [(_rows(query, index), key), (query, _rows(key, far.indices[..., :cols, :]))]


def sdpa_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float | None = None,
    heads: int | None = None,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """max |q . k| * scale of each query head over the logits ``scaled_dot_product_attention``
    forms, over the products `logit_sample` picks: a vector of ``heads`` values (default:
    ``query.shape[-3]``, 1 for 2-D queries). A lower bound of the max over every product,
    exact for short sequences (up to 2 * `SAMPLE_ROWS` queries and keys).

    Every q . k product counts, masks (``attn_mask``, ``is_causal``) left out as they are in
    eager attention, where the max is taken before a mask meets the logits. The logits are
    materialized in float32 a block of query rows at a time, so memory stays near
    ``chunk_elements`` floats whatever the sequence length. Grouped-query attention (fewer key
    heads) serves each key head's queries together.
    """
    # contiguous: the matmuls and gathers of strided q and k (views of a fused qkv) copy them
    q, k = query.detach().float().contiguous(), key.detach().float().contiguous()
    if heads is None:
        heads = q.shape[-3] if q.ndim >= 3 else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    best = torch.zeros(heads, device=q.device)
    for qs, ks in logit_sample(q, k):
        best = torch.maximum(best, _products_max(qs, ks, heads, chunk_elements))
    return best * abs(scale)


def _products_max(q: torch.Tensor, k: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """max |q . k| of each head, ``chunk`` products at a time."""
    group = q.shape[-3] // k.shape[-3] if min(q.ndim, k.ndim) >= 3 else 1
    t_q, t_k = q.shape[-2], k.shape[-2]
    rows_per_chunk = max(1, chunk // max(1, q[..., :1, :1].numel() * t_k))
    best = torch.zeros(heads, device=q.device)
    kt = k.transpose(-1, -2)
    for start in range(0, t_q, rows_per_chunk):
        block = q[..., start : start + rows_per_chunk, :]
        if group > 1:  # (..., k_heads * group, rows, d) as (..., k_heads, group * rows, d)
            shape = block.shape
            block = block.reshape(*shape[:-3], k.shape[-3], -1, shape[-1])
            s = (block @ kt).view(*shape[:-1], t_k)
        else:
            s = block @ kt  # unscaled: max |s c| = |c| max |s|
        best = torch.maximum(best, head_abs_max(s, heads))
    return best


def mha_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    num_heads: int,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    bias_k: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and keys ``F.multi_head_attention_forward`` forms, float32, each (batch,
    heads, sequence, head_dim).

    ``query`` and ``key`` are (sequence, batch, features) or unbatched (sequence, features);
    q = query w_q^T + b_q and k = key w_k^T + b_k are split into ``num_heads`` heads, with
    ``bias_k`` appended as one more key, or ``static_k`` (batch * heads, keys, head_dim) taken
    as the keys.
    """

    def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x = x.detach().float()
        x = x.unsqueeze(1) if x.ndim == 2 else x
        return F.linear(x, w.detach().float(), None if b is None else b.detach().float())

    q = project(query, w_q, b_q)
    head_dim = q.shape[-1] // num_heads
    q = q.reshape(q.shape[0], q.shape[1], num_heads, head_dim).permute(1, 2, 0, 3)
    if static_k is not None:
        k = static_k.detach().float().reshape(q.shape[0], num_heads, -1, head_dim)
    else:
        k = project(key, w_k, b_k)
        if bias_k is not None:
            k = torch.cat([k, bias_k.detach().float().expand(1, k.shape[1], -1)])
        k = k.reshape(k.shape[0], k.shape[1], num_heads, head_dim).permute(1, 2, 0, 3)
    return q, k


def mha_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    num_heads: int,
    w_q: torch.Tensor,
    b_q: torch.Tensor | None,
    w_k: torch.Tensor,
    b_k: torch.Tensor | None,
    bias_k: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """max |q . k| / sqrt(head_dim) of each of the ``num_heads`` heads over the logits
    ``F.multi_head_attention_forward`` forms, q and k as `mha_qk` makes them. Masks are
    additive or exclude positions the model still forms logits for: they are ignored. Over the
    products of `logit_sample`, materialized a block at a time, as in `sdpa_logit_max`.
    """
    q, k = mha_qk(query, key, num_heads, w_q, b_q, w_k, b_k, bias_k, static_k)
    return sdpa_logit_max(q, k, heads=num_heads, chunk_elements=chunk_elements)
