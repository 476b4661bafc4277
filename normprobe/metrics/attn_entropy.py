"""``attn_entropy``: how spread out each head's attention is.

The entropy of a query's attention distribution, H = -sum_j p_j log p_j (nats), is log(n) when
it attends its n keys evenly and 0 when it attends one. Entropy collapse, heads whose entropy
falls toward 0 early in training, goes with unstable training and loss spikes (Zhai et al.
2023, "Stabilizing Transformer Training by Preventing Attention Entropy Collapse"); it is what
large attention logits (``attn_logits``) lead to.
"""

from __future__ import annotations

from functools import partial

import torch

from .core.attention import AttentionInputs
from .core.base import Family, Out, Plan, Series, Slot, Values

# The query rows whose distributions are formed: every row of sequences up to this many queries,
# else this many evenly spread over the sequence, per sequence and head. A module's product
# then costs at most ROWS x keys x head_dim multiply-adds per sequence and head, and its
# probabilities ROWS x keys floats, materialized a block of rows at a time (CHUNK floats).
ROWS = 64
CHUNK = 1 << 22


def _sampled_rows(queries: int, device: torch.device) -> torch.Tensor:
    """`ROWS` query indices evenly spread over ``queries`` (all of them when there are fewer)."""
    if queries <= ROWS:
        return torch.arange(queries, device=device)
    return torch.linspace(0, queries - 1, ROWS, device=device).round().long()


def _masked(
    s: torch.Tensor, rows: torch.Tensor, inputs: AttentionInputs, queries: int
) -> torch.Tensor:
    """The scores ``s`` of query ``rows`` (..., rows, keys) with the inputs' mask applied."""
    mask = inputs.mask
    if mask is not None:
        if mask.ndim >= 2 and mask.shape[-2] == queries and queries > 1:
            mask = mask.index_select(-2, rows)
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if inputs.is_causal:
        later = rows[:, None] < torch.arange(s.shape[-1], device=s.device)
        s = s.masked_fill(later, float("-inf"))
    return s


def _entropy(s: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(s) over the last axis (NaN for a row with no key attended)."""
    return torch.special.entr(torch.softmax(s, dim=-1)).sum(dim=-1)


def _fused_entropy(inputs: AttentionInputs, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Entropy of the sampled rows (..., rows), from q and k."""
    q, k = q.detach().float(), k.detach().float()
    if min(q.ndim, k.ndim) >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if inputs.scale is None else inputs.scale
    rows = _sampled_rows(q.shape[-2], q.device)
    kt = k.transpose(-1, -2) * scale
    step = max(1, CHUNK // max(1, q[..., :1, :1].numel() * k.shape[-2]))
    parts = []
    for start in range(0, len(rows), step):
        block = rows[start : start + step]
        s = q.index_select(-2, block) @ kt
        parts.append(_entropy(_masked(s, block, inputs, q.shape[-2])))
    return torch.cat(parts, dim=-1)


def _eager_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy of the sampled rows (..., rows), from what the softmax takes."""
    rows = _sampled_rows(scores.shape[-2], scores.device)
    step = max(1, CHUNK // max(1, scores[..., :1, :].numel()))
    parts = [
        _entropy(scores.index_select(-2, rows[start : start + step]).float())
        for start in range(0, len(rows), step)
    ]
    return torch.cat(parts, dim=-1)


def head_entropy(inputs: AttentionInputs) -> torch.Tensor:
    """Mean entropy (nats) over the sampled queries of each of the ``inputs.heads`` heads, a
    float32 vector; rows that attend no key are left out. Leading dims flatten with the head
    as their index modulo ``heads`` (else every head gets the mean over all)."""
    if inputs.scores is not None:
        h = _eager_entropy(inputs.scores)
    else:
        assert inputs.query is not None and inputs.key is not None
        h = _fused_entropy(inputs, inputs.query, inputs.key)
    per_slice = h.reshape(-1, h.shape[-1]).nanmean(dim=-1)
    if per_slice.numel() % inputs.heads:
        return per_slice.nanmean().expand(inputs.heads)
    return per_slice.view(-1, inputs.heads).nanmean(dim=0)


def _put(plan: Plan, slot: Slot, inputs: AttentionInputs) -> None:
    plan.measured.put(slot, head_entropy(inputs))  # a module called twice: the last call's


class AttnEntropy(Family):
    name = "attn_entropy"
    requires = "no attention modules"
    optional = True
    # a logged step of a GPT-2-style TinyTransformer (width 64, 6 blocks of 4 heads, 64 tokens,
    # batch 32, AdamW; one CPU thread) takes 35-55 ms (23-35%) longer with it: asked for by name
    opt_in = True
    description = (
        "per attention module, the entropy (nats) of each head's attention distribution "
        "softmax(q.k * scale + mask), averaged over queries: log(n) attending n keys evenly, "
        f"0 attending one; from {ROWS} query rows evenly spread over longer sequences; tags: "
        "the mean over heads and the per-head vector. Entropy collapse (heads falling toward 0) "
        "goes with unstable training (Zhai et al. 2023)"
    )
    series = (
        Series("attn_entropy", "module", "mean", scale="linear"),
        Series("attn_entropy_head", "module", "none", scale="linear", heads=True),
    )

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, Slot]] = []
        for a in plan.attention:
            slot, here = plan.head_slots(a.path, "mean")
            plan.read_attention(a.path, partial(_put, plan, here))
            slots.append((plan.module_tag(a.path), slot))

        def record(values: Values, out: Out) -> None:
            for subject, slot in slots:
                heads = values.get(slot)
                if heads is not None:
                    out.scalar("attn_entropy", subject, sum(heads) / len(heads))
                    out.vector("attn_entropy_head", subject, heads)

        plan.on_record(record)
