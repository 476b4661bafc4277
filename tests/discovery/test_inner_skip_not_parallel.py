"""A branch whose last op sums a tensor and a layer applied to it (a short convolution's
``conv(y) + y``, transformers' Inkling, whose skip operand is not the tensor the convolution
reads) holds a skip of its own, not two branches side by side:
its stack is Pre-LN, not parallel. A real parallel block (GPT-J's ``x + attn(ln x) + mlp(ln x)``)
stays parallel."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import normprobe


class ShortConvMixer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.conv = nn.Conv1d(width, width, 3, padding=1, groups=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        residual = y.clone()  # Inkling keeps the skip apart from what the convolution reads
        return self.conv(y.transpose(1, 2)).transpose(1, 2) + residual


class Block(nn.Module):
    def __init__(self, width: int, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.mixer = ShortConvMixer(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = self.norm1(x)
            return x + self.mixer(h) + self.mlp(h)
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _map(parallel: bool) -> normprobe.ModelMap:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16, parallel) for _ in range(3)], nn.LayerNorm(16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        return normprobe.discover(model, torch.randn(2, 8, 16))


def test_a_skip_inside_a_branch_is_not_parallel() -> None:
    m = _map(parallel=False)
    assert [(s.depth, s.placement) for s in m.stacks] == [(3, "pre-ln")]
    assert len(m.residual_adds) == 6


def test_inkling_short_convolutions_are_not_parallel_branches() -> None:
    """transformers' Inkling: each sublayer's output passes an ``InklingShortConvolution``
    (``conv(y) + y`` on ``y.float()``) before the residual add; it read ``parallel``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "inkling_text",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=128,
        layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "dense", "dense"],
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        m = normprobe.discover(model, input_ids=torch.randint(3, 128, (2, 16)))
    assert [(s.path, s.depth) for s in m.stacks] == [("model.layers", 3)]
    assert m.stacks[0].placement.startswith("pre-ln")
    assert len(m.residual_adds) == 6


def test_a_parallel_block_stays_parallel() -> None:
    m = _map(parallel=True)
    assert [(s.depth, s.placement) for s in m.stacks] == [(3, "parallel")]
