"""Small reference models for the demo, the examples and the benchmarks.

`ResidualStack` is the deep stack of sanity check [d] (``examples/check_d_grad_ratio.py``):
identical residual blocks of one LayerNorm and one Linear, kept in two parallel ModuleLists, with
a final linear head. `MLPStack` is a Pre-LN stack of feed-forward blocks, the model the overhead
targets are set on. `TinyTransformer` is a GPT-style causal language model whose norm placement
(Pre-LN, Post-LN, sandwich) and QK-norm are options.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


class ResidualStack(nn.Module):
    """``depth`` blocks ``h + lin(ln(h))`` (Pre-LN) or ``ln(h + lin(h))`` (Post-LN), then a head.

    The head keeps a loss on the output from acting on a freshly normalized (Post-LN) tensor,
    which would flatten every gradient.
    """

    def __init__(self, depth: int = 48, width: int = 64, pre_ln: bool = True) -> None:
        super().__init__()
        self.pre_ln = pre_ln
        self.lns = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for ln, lin in zip(self.lns, self.lins, strict=True):
            h = h + lin(ln(h)) if self.pre_ln else ln(h + lin(h))
        return self.head(h)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through ``scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        head_dim = width // heads
        self.q_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int, hidden_mult: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden_mult * width)
        self.proj = nn.Linear(hidden_mult * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MLPBlock(nn.Module):
    """``x + mlp(ln(x))``: a Pre-LN feed-forward block."""

    def __init__(self, width: int, hidden_mult: int = 4) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mlp = MLP(width, hidden_mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class MLPStack(nn.Module):
    """``depth`` Pre-LN feed-forward blocks (`MLPBlock`), a final LayerNorm and a linear head."""

    def __init__(self, depth: int = 12, width: int = 256, hidden_mult: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width, hidden_mult) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


Placement = Literal["pre", "post", "sandwich"]


class Block(nn.Module):
    """One transformer block; ``alpha`` scales the skip (DeepNorm uses it with ``post``)."""

    def __init__(
        self,
        width: int,
        heads: int,
        placement: Placement = "pre",
        qk_norm: bool = False,
        alpha: float = 1.0,
    ) -> None:
        super().__init__()
        if placement not in ("pre", "post", "sandwich"):
            raise ValueError(f"placement must be 'pre', 'post' or 'sandwich', got {placement!r}")
        self.placement = placement
        self.alpha = alpha
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, qk_norm)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)
        if placement == "sandwich":
            self.ln_1_post = nn.LayerNorm(width)
            self.ln_2_post = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "post":
            x = self.ln_1(self.alpha * x + self.attn(x))
            return self.ln_2(self.alpha * x + self.mlp(x))
        if self.placement == "sandwich":
            x = x + self.ln_1_post(self.attn(self.ln_1(x)))
            return x + self.ln_2_post(self.mlp(self.ln_2(x)))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyTransformer(nn.Module):
    """A GPT-style causal language model: token and position embeddings, blocks, norm, head.

    Args:
        vocab_size: number of tokens.
        width: model width.
        depth: number of blocks.
        heads: attention heads per block.
        context: longest sequence.
        placement: ``pre`` (Pre-LN, with a final LayerNorm), ``post`` (Post-LN, no final norm)
            or ``sandwich``.
        qk_norm: LayerNorm on queries and keys.
        alpha: skip scale (DeepNorm's alpha for a Post-LN model).
    """

    def __init__(
        self,
        vocab_size: int = 96,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        context: int = 64,
        placement: Placement = "pre",
        qk_norm: bool = False,
        alpha: float = 1.0,
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            Block(width, heads, placement, qk_norm, alpha) for _ in range(depth)
        )
        self.ln_f = nn.LayerNorm(width) if placement != "post" else nn.Identity()
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context of {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
