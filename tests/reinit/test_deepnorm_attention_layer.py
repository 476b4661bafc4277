"""DeepNorm on attention whose softmax runs in a child module while the projections are its
siblings (Informer's and iTransformer's ``AttentionLayer(FullAttention(...))``): queries and
keys get Xavier gain 1, values and outputs beta = (8N)^(-1/4). The query and key projections
lay outside the attention module discovery names, and were drawn with beta."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import normprobe


class FullAttention(nn.Module):
    """Weightless scaled dot-product attention, as in the Informer codebase."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(scores, dim=-1) @ v


class AttentionLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.inner_attention = FullAttention()
        self.query_projection = nn.Linear(width, width)
        self.key_projection = nn.Linear(width, width)
        self.value_projection = nn.Linear(width, width)
        self.out_projection = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, -1).transpose(1, 2)

        q = split(self.query_projection(x))
        k = split(self.key_projection(x))
        v = split(self.value_projection(x))
        out = self.inner_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return self.out_projection(out)


class EncoderLayer(nn.Module):
    """Post-LN: x = norm1(x + attn(x)); x = norm2(x + ff(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention = AttentionLayer(width, 4)
        self.conv1 = nn.Linear(width, 2 * width)
        self.conv2 = nn.Linear(2 * width, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.conv2(torch.relu(self.conv1(x))))


def test_sibling_query_and_key_projections_get_gain_one() -> None:
    torch.manual_seed(0)
    width, depth = 128, 2
    model = nn.Sequential(*[EncoderLayer(width) for _ in range(depth)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        normprobe.reinit(model, "deepnorm", example_inputs=(torch.randn(2, 8, width),))
    beta = (8 * depth) ** -0.25
    xavier = math.sqrt(2 / (width + width))
    for layer in model:
        attention = layer.attention
        for q_or_k in (attention.query_projection, attention.key_projection):
            assert float(q_or_k.weight.std()) == pytest.approx(xavier, rel=0.05)
        for v_or_o in (attention.value_projection, attention.out_projection):
            assert float(v_or_o.weight.std()) == pytest.approx(beta * xavier, rel=0.05)
        ff_in = math.sqrt(2 / (width + 2 * width))
        assert float(layer.conv1.weight.std()) == pytest.approx(beta * ff_in, rel=0.05)
