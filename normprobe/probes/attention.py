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
    return logit_stats_from_sums(logit_sums(logits))


def logit_sums(logits: torch.Tensor) -> torch.Tensor:
    """(max |logit|, sum of squares, count, sum of log-sum-exps, rows) of output logits, as
    float32: what `logit_stats_from_sums` combines over chunks of them (rows stacked along a
    first axis)."""
    x = logits.detach().float()
    rows = x.numel() // max(x.shape[-1], 1) if x.ndim else 1
    return torch.stack(
        [
            x.abs().amax(),
            rms(x).square() * x.numel(),  # row by row: no squared copy of a vocabulary's logits
            x.new_tensor(float(x.numel())),
            torch.logsumexp(x, dim=-1).sum(),
            x.new_tensor(float(rows)),
        ]
    )


def logit_stats_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """`logit_stats` from `logit_sums`, one row or several stacked (the chunks of one output)."""
    s = sums.reshape(-1, 5)
    total = s[:, 1:].sum(dim=0)
    return torch.stack([s[:, 0].amax(), (total[0] / total[1]).sqrt(), total[2] / total[3]])


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


def _sample_size(tokens: int) -> int:
    return max(SAMPLE_ROWS, -(-tokens // SAMPLE_SHARE))


def _sampled(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `logit_sample` forms fewer products than every query with every key."""
    t_q, t_k = query.shape[-2], key.shape[-2]
    return _sample_size(t_q) * t_k + t_q * _sample_size(t_k) < t_q * t_k


def logit_sample(query: torch.Tensor, key: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (queries, keys) whose products `sdpa_logit_max` forms: ``[(query, key)]`` when that
    costs no more than the sample, else the queries with every key and every query with the
    keys, a `SAMPLE_SHARE`-th of each per sequence and head (at least `SAMPLE_ROWS`).

    The keys taken are those farthest from the mean key m (an attention sink, an outlier); for
    the rest, |q . k| <= |q . m| + |q| r, r the largest distance |k - m| left, and the queries
    taken are those with the largest such bound. ``key`` may have fewer heads than ``query``
    (grouped-query attention).
    """
    if not _sampled(query, key):
        return [(query, key)]
    t_q, t_k = query.shape[-2], key.shape[-2]
    rows, cols = _sample_size(t_q), _sample_size(t_k)
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
    q, k = query.detach().float(), key.detach().float()
    if heads is None:
        heads = q.shape[-3] if q.ndim >= 3 else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return torch.zeros(heads, device=q.device)  # no products
    # sampled: q and k contiguous first, their gathers would copy a strided view (a fused
    # qkv); whole: a head at a time on views, no copy at all
    if not _sampled(q, k):
        return _products_max(q, k, heads, chunk_elements).mul_(abs(scale))
    pairs = logit_sample(q.contiguous(), k.contiguous())
    best = torch.stack([_products_max(qs, ks, heads, chunk_elements) for qs, ks in pairs])
    return best.amax(dim=0).mul_(abs(scale))


def _products_max(q: torch.Tensor, k: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """max |q . k| of each head, ``chunk`` products at a time: a head at a time where q holds
    them along its third axis from the end (or is one head), else over q's leading axes
    flattened, their index modulo ``heads`` being the head."""
    if q.ndim < 3:
        return _abs_max_products([(q, k)], chunk)
    if q.shape[-3] == heads and k.ndim == q.ndim and heads % k.shape[-3] == 0:
        group = heads // k.shape[-3]
        pairs = [(q.select(-3, h), k.select(-3, h // group)) for h in range(heads)]
        return _abs_max_products(pairs, chunk)
    if k.ndim == q.ndim and k.shape[-3] != q.shape[-3]:  # grouped: consecutive query slices
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    best = torch.zeros(heads, device=q.device)
    kt = k.transpose(-1, -2)
    for block in torch.split(q, _rows_per_chunk(q, k, chunk), dim=-2):
        best = torch.maximum(best, head_abs_max(block @ kt, heads))  # unscaled: |s c| = |c| |s|
    return best


def _abs_max_products(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> torch.Tensor:
    """max |q . k| over every query and key of each (q, k) pair (one head each, any leading
    axes alike): a vector of one value per pair."""
    lows, highs, counts = [], [], []
    for q, k in pairs:
        kt = k.transpose(-1, -2)
        blocks = torch.split(q, _rows_per_chunk(q, k, chunk), dim=-2)
        counts.append(len(blocks))
        for block in blocks:
            low, high = torch.aminmax(block @ kt)
            lows.append(low)
            highs.append(high)
    per_block = torch.maximum(torch.stack(highs), torch.stack(lows).neg_())
    if len(per_block) == len(pairs):
        return per_block
    return torch.stack([part.amax() for part in torch.split(per_block, counts)])


def _rows_per_chunk(q: torch.Tensor, k: torch.Tensor, chunk: int) -> int:
    """Query rows whose products with every key hold about ``chunk`` entries (at least one)."""
    return max(1, chunk // max(1, math.prod(q.shape[:-2]) * k.shape[-2]))


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
