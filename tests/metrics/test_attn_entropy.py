"""``attn_entropy``: each head's attention entropy, against hand computations: uniform attention
(q = 0) gives log(number of keys attended), one-hot attention 0; fused, eager and
``nn.MultiheadAttention`` attention, masks and grouped-query heads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import normprobe
from normprobe.metrics import chosen
from normprobe.metrics.attn_entropy import ROWS, head_entropy
from normprobe.metrics.core.attention import AttentionInputs
from normprobe.models import TinyTransformer

T = 10


def causal_uniform(tokens: int) -> float:
    """Mean over queries i of log(i + 1): uniform attention over the keys a causal mask leaves."""
    return sum(math.log(i + 1) for i in range(tokens)) / tokens


def test_uniform_causal_attention_reads_the_mean_log_of_the_keys_attended() -> None:
    q, k = torch.zeros(3, 2, T, 4), torch.randn(3, 2, T, 4)
    got = head_entropy(AttentionInputs(2, query=q, key=k, is_causal=True))
    torch.testing.assert_close(got, torch.full((2,), causal_uniform(T)))


def test_uniform_attention_under_a_mask_reads_log_of_the_keys_it_leaves() -> None:
    q, k = torch.zeros(1, 2, T, 4), torch.randn(1, 2, T, 4)
    assert head_entropy(AttentionInputs(2, query=q, key=k)).tolist() == pytest.approx(
        [math.log(T)] * 2
    )
    attends = torch.arange(T) < 3  # boolean: True attends
    got = head_entropy(AttentionInputs(2, query=q, key=k, mask=attends))
    assert got.tolist() == pytest.approx([math.log(3)] * 2)
    additive = torch.zeros(T, T).masked_fill(~attends, float("-inf"))
    got = head_entropy(AttentionInputs(2, query=q, key=k, mask=additive))
    assert got.tolist() == pytest.approx([math.log(3)] * 2)


def test_one_hot_attention_reads_zero() -> None:
    k = torch.eye(T).expand(1, 2, T, T)
    q = 100.0 * k  # query i meets key i alone
    got = head_entropy(AttentionInputs(2, query=q, key=k, scale=1.0))
    assert got.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)


def test_heads_are_told_apart_and_grouped_query_heads_share_their_keys() -> None:
    q = torch.zeros(2, 4, T, T)
    q[:, 1] = 100.0 * torch.eye(T)  # query heads 0, 1 share key head 0; head 1 one-hot
    k = torch.eye(T).expand(2, 2, T, T)
    got = head_entropy(AttentionInputs(4, query=q, key=k, scale=1.0))
    assert got.tolist() == pytest.approx([math.log(T), 0.0, math.log(T), math.log(T)], abs=1e-6)


def test_eager_scores_as_the_softmax_takes_them() -> None:
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.zeros(2 * 3, T, T).masked_fill(~causal, float("-inf"))  # (batch * heads, ...)
    got = head_entropy(AttentionInputs(3, scores=scores))
    torch.testing.assert_close(got, torch.full((3,), causal_uniform(T)))
    one_hot = torch.full((2, 3, T, T), -1e4) + 2e4 * torch.eye(T)
    assert head_entropy(AttentionInputs(3, scores=one_hot)).tolist() == pytest.approx([0.0] * 3)


def test_long_sequences_form_rows_evenly_spread_over_them() -> None:
    tokens = 20 * ROWS
    q, k = torch.zeros(1, 1, tokens, 4), torch.randn(1, 1, tokens, 4)
    got = head_entropy(AttentionInputs(1, query=q, key=k, is_causal=True)).item()
    rows = torch.linspace(0, tokens - 1, ROWS).round()
    assert got == pytest.approx(torch.log(rows + 1).mean().item(), rel=1e-5)
    assert got == pytest.approx(causal_uniform(tokens), rel=0.02)  # the mean over every query


class Entropies(TorchFunctionMode):
    """The entropy of each head of every fused attention call, from its full softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[list[float]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0].detach().double(), args[1].detach().double()
            s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            p = s.softmax(-1)
            self.heads.append(torch.special.entr(p).sum(-1).mean(dim=(0, 2)).tolist())
        return func(*args, **kwargs)


def zero_queries(model: nn.Module) -> None:
    """q = 0 in every attention module's ``qkv`` projection (the first third of its rows)."""
    with torch.no_grad():
        for m in model.modules():
            qkv = getattr(m, "qkv", None)
            if isinstance(qkv, nn.Linear):
                qkv.weight[: qkv.out_features // 3].zero_()
                qkv.bias[: qkv.out_features // 3].zero_()


def logged(
    model: nn.Module, run: Any, tmp_path: Path, metrics: tuple[str, ...] = ("attn_entropy",)
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """After one logged step, each attention module's mean entropy, and its per-head vectors:
    the entropies by path, and (logging ``attn_logits_head``) the max logits by ``max <path>``."""
    vectors = {"attn_entropy": ("", "attn_entropy_head"), "attn_logits_head": ("max ", None)}
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=list(metrics)) as probe:
        run()
        probe.step()
        assert probe.model_map is not None and probe.latest is not None
        paths = [a.path for a in probe.model_map.attention]
        scalars, profiles = probe.latest.scalars, probe.latest.profiles
        heads = {
            prefix + p: profiles[probe.tag(series or name, p)]
            for name, (prefix, series) in vectors.items()
            if name in metrics
            for p in paths
        }
        if "attn_entropy" not in metrics:
            return {}, heads
        return {p: scalars[probe.tag("attn_entropy", p)] for p in paths}, heads


def test_fused_attention_of_a_gpt_matches_the_full_softmax(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(32, 32, 2, 4, 16)
    idx = torch.randint(0, 32, (2, 16))
    with torch.no_grad(), Entropies() as want:
        model(idx)
    means, heads = logged(model, lambda: model(idx).sum().backward(), tmp_path)
    assert list(heads.values()) == [pytest.approx(h, rel=1e-4) for h in want.heads]
    assert list(means.values()) == [pytest.approx(sum(h) / 4, rel=1e-4) for h in want.heads]

    zero_queries(model)  # uniform over the keys the causal mask leaves
    means, _ = logged(model, lambda: model(idx).sum().backward(), tmp_path / "uniform")
    assert list(means.values()) == [pytest.approx(causal_uniform(16), rel=1e-5)] * 2


class EagerAttention(nn.Module):
    """Causal attention as eager code writes it: q·k scaled, a -inf mask, a softmax."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = s.softmax(dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_eager_attention_reads_what_its_softmax_takes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(EagerAttention(), EagerAttention())
    zero_queries(model)
    x = torch.randn(2, T, 8)
    _, heads = logged(model, lambda: model(x).sum().backward(), tmp_path)
    assert len(heads) == 2
    for h in heads.values():
        assert h == pytest.approx([causal_uniform(T)] * 2, rel=1e-5)


def test_eager_logit_max_reads_the_same_beside_the_entropy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(EagerAttention(), EagerAttention())
    x = torch.randn(2, T, 8)
    _, alone = logged(model, lambda: model(x), tmp_path / "max", ("attn_logits_head",))
    _, entropy = logged(model, lambda: model(x), tmp_path / "entropy")
    _, both = logged(
        model, lambda: model(x), tmp_path / "both", ("attn_logits_head", "attn_entropy")
    )
    assert len(alone) == len(entropy) == 2 and both == alone | entropy


def test_opt_in_left_out_by_default(tmp_path: Path) -> None:
    assert "attn_entropy" in normprobe.METRICS
    assert "attn_entropy" not in chosen(None) and "attn_entropy" in chosen(["attn_entropy"])
    model = TinyTransformer(32, 32, 2, 4, 16)
    with normprobe.attach(model, log_dir=str(tmp_path)) as probe:
        model(torch.randint(0, 32, (2, 16)))
        probe.step()
        assert probe.latest is not None
        assert not [t for t in probe.latest.scalars if "attn_entropy" in t]
        assert [t for t in probe.latest.scalars if "attn_logit_max" in t]


def test_multihead_attention_counts_the_keys_its_padding_mask_leaves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    with torch.no_grad():
        model.self_attn.in_proj_weight[:8].zero_()
        model.self_attn.in_proj_bias[:8].zero_()
    x = torch.randn(2, T, 8)
    padding = torch.arange(T) >= torch.tensor([[4], [7]])  # True: padding; 4 and 7 keys left
    _, heads = logged(
        model, lambda: model(x, src_key_padding_mask=padding).sum().backward(), tmp_path
    )
    mean = (math.log(4) + math.log(7)) / 2
    assert list(heads.values()) == [pytest.approx([mean, mean], rel=1e-5)]
