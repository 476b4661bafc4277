"""Ops on attention logits between the q·k product and the softmax that are no elementwise op:
talking heads (a map over the head axis: an einsum with a (heads, heads) parameter as in
vit-pytorch's CaiT, a 1x1 convolution over heads added to the logits as in x-transformers),
residual attention (the previous layer's logits added to this layer's, x-transformers'
``residual_attn``) and soft-capping inside a TorchScript function (x-transformers'
``softclamp``). Each block is still attention at its own module, and no add on the logits is a
residual add of the stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normprobe
from normprobe.runtime.modes import AttentionLogits

WIDTH, HEADS, TOKENS, BLOCKS = 16, 2, 5, 2
HEAD_DIM = WIDTH // HEADS


@torch.jit.script
def softclamp(t: torch.Tensor, value: float) -> torch.Tensor:
    return (t / value).tanh() * value


class Attention(nn.Module):
    """Multi-head attention whose logits go through ``mix`` before the softmax; returns its
    output and its pre-softmax logits (for the next layer, under ``residual``)."""

    def __init__(self, mix: str) -> None:
        super().__init__()
        self.mix = mix
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.mix_heads = nn.Parameter(torch.eye(HEADS) + 0.1 * torch.randn(HEADS, HEADS))
        self.talk = nn.Conv2d(HEADS, HEADS, 1, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], HEADS, HEAD_DIM).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sim = self.heads(self.q(x)) @ self.heads(self.k(x)).transpose(-1, -2) * HEAD_DIM**-0.5
        if self.mix == "einsum":
            sim = torch.einsum("bhij,hg->bgij", sim, self.mix_heads)
        elif self.mix == "conv":
            sim = sim + self.talk(sim)
        elif self.mix == "residual" and prev is not None:
            sim = sim + prev
        elif self.mix == "softclamp":
            sim = softclamp(sim, 5.0)
        y = (sim.softmax(-1) @ self.heads(self.v(x))).transpose(1, 2).reshape(x.shape)
        out: torch.Tensor = self.o(y)
        return out, sim


class Block(nn.Module):
    def __init__(self, mix: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = Attention(mix)

    def forward(
        self, x: torch.Tensor, prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, sim = self.attn(self.norm(x), prev)
        return x + out, sim


class Model(nn.Module):
    def __init__(self, mix: str) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(mix) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, prev = self.embed(x), None
        for block in self.blocks:
            x, prev = block(x, prev)
        out: torch.Tensor = self.norm(x)
        return out


MIXES = ("einsum", "conv", "residual", "softclamp")


def _discover(mix: str) -> tuple[Model, normprobe.ModelMap]:
    torch.manual_seed(0)
    model = Model(mix).eval()
    return model, normprobe.discover(model, torch.randn(2, TOKENS, WIDTH))


@pytest.mark.parametrize("mix", MIXES)
def test_each_block_is_attention_at_its_own_module(mix: str) -> None:
    _, m = _discover(mix)
    assert [(a.path, a.impl, a.heads) for a in m.attention] == [
        (f"blocks.{i}.attn", "eager", HEADS) for i in range(BLOCKS)
    ]


@pytest.mark.parametrize("mix", MIXES)
def test_adds_on_logits_are_no_residual_adds(mix: str) -> None:
    """One residual add per block, written by the output projection alone: neither the
    talking heads' weights nor q and k (through the previous layer's logits) write."""
    _, m = _discover(mix)
    assert [(a.module, a.stack, a.block) for a in m.residual_adds] == [
        (f"blocks.{i}", "blocks", i) for i in range(BLOCKS)
    ]
    assert [a.writers for a in m.residual_adds] == [(f"blocks.{i}.attn.o",) for i in range(BLOCKS)]
    assert [(s.path, len(s.blocks)) for s in m.stacks] == [("blocks", BLOCKS)]


@pytest.mark.parametrize("mix", ("einsum", "conv"))
def test_gpt2_scales_only_the_output_projection(mix: str) -> None:
    """gpt2 treats the talking heads' weights as any other weight layer (std 0.02) and scales
    only the writers, 0.02/sqrt(2N), N = 2."""
    model, _ = _discover(mix)
    torch.manual_seed(1)
    normprobe.reinit(model, "gpt2", example_inputs=(torch.randn(2, TOKENS, WIDTH),))
    attn = model.blocks[0].attn
    mixer = attn.mix_heads if mix == "einsum" else attn.talk.weight
    assert attn.o.weight.std().item() == pytest.approx(0.02 / 2, rel=0.15)
    assert attn.q.weight.std().item() == pytest.approx(0.02, rel=0.15)
    # 4 values: only a loose bound, but far from 0.01 either way is wrong
    assert mixer.detach().abs().max().item() < 0.1


@pytest.mark.parametrize("mix", MIXES)
def test_logits_are_read_as_each_block_forms_them(mix: str) -> None:
    """Max |q·kᵀ·scale| per head, read where the head mix, the previous logits or nothing
    (soft-capping is part of forming them: 5·tanh(s/5)) first meets them."""
    model, m = _discover(mix)
    x = torch.randn(2, TOKENS, WIDTH)
    read: dict[str, torch.Tensor] = {}
    formed: dict[str, torch.Tensor] = {}

    def hooks(path: str, heads: int) -> None:
        module = model.get_submodule(path)
        mode = AttentionLogits([lambda v: read.setdefault(path, v.logit_max)], heads, True)

        def pre(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            q, k = mod.heads(mod.q(args[0])), mod.heads(mod.k(args[0]))
            s = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
            s = softclamp(s, 5.0) if mix == "softclamp" else s
            formed[path] = s.abs().amax(dim=(0, 2, 3))
            mode.__enter__()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(lambda *_: mode.__exit__(None, None, None))

    for a in m.attention:
        hooks(a.path, a.heads)
    with torch.no_grad():
        model(x)
    assert list(read) == [a.path for a in m.attention]
    for path, value in read.items():
        torch.testing.assert_close(value, formed[path])
