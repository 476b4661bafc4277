"""Attention whose logits pass through elementwise ops (nan_to_num, clamp, soft-capping, a mask,
a bias, a cast) between the q·k product and the softmax, whichever way the softmax is called:
the module is still attention, its q/k norms read ``qk``, DeepNorm gives queries and keys gain 1,
and its logits are read as the model forms them. A router's softmax is never attention."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe

WIDTH, HEADS, TOKENS, BLOCKS = 32, 2, 6, 2
HEAD_DIM = WIDTH // HEADS
SCALE = HEAD_DIM**-0.5
CAUSAL = torch.ones(TOKENS, TOKENS).triu(1).bool()

Logits = Callable[[torch.Tensor, "Attention"], torch.Tensor]

# how the logits s = q·kᵀ·scale reach the softmax, and what the model forms of them
CHAINS: dict[str, tuple[Logits, Logits]] = {
    "nan_to_num": (lambda s, m: torch.nan_to_num(s), lambda s, m: s),
    "clamp": (lambda s, m: s.clamp(-0.5, 0.5), lambda s, m: s.clamp(-0.5, 0.5)),
    "softcap": (lambda s, m: 0.5 * torch.tanh(s / 0.5), lambda s, m: 0.5 * torch.tanh(s / 0.5)),
    "masked_fill": (lambda s, m: s.masked_fill(CAUSAL, float("-inf")), lambda s, m: s),
    "bias": (lambda s, m: s + m.bias, lambda s, m: s),
    "cast": (lambda s, m: s.double().half().float(), lambda s, m: s.half().float()),
    # GPT-OSS: a learned sink logit per head joined to each row, the row's max subtracted
    "sink": (
        lambda s, m: (
            (c := torch.cat([s, m.sink.expand(*s.shape[:-1], 1)], -1)) - c.amax(-1, keepdim=True)
        ),
        lambda s, m: s,
    ),
    "all": (
        lambda s, m: (
            torch.nan_to_num(0.5 * torch.tanh(s.double() / 0.5)).float().clamp(-9, 9) + m.bias
        ).masked_fill(CAUSAL, -1e4),
        lambda s, m: (0.5 * torch.tanh(s / 0.5)).clamp(-9, 9),
    ),
}
SOFTMAXES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F.softmax": lambda s: F.softmax(s, dim=-1),
    "method": lambda s: s.softmax(-1),
    "torch.softmax": lambda s: torch.softmax(s, -1),
    "dtype": lambda s: F.softmax(s, dim=-1, dtype=torch.float64).float(),
    "special": lambda s: torch.special.softmax(s, -1),
}


class Attention(nn.Module):
    """Multi-head attention with q/k norms; ``chain`` takes the scaled q·k product to what the
    softmax reads; ``softmax`` is a function, or None for an ``nn.Softmax`` child."""

    def __init__(self, chain: str, softmax: str | None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(HEAD_DIM), nn.LayerNorm(HEAD_DIM)
        self.bias = nn.Parameter(torch.randn(HEADS, TOKENS, TOKENS))
        self.sink = nn.Parameter(torch.randn(HEADS, 1, 1))
        self.chain = CHAINS[chain][0]
        self.softmax = nn.Softmax(-1) if softmax is None else SOFTMAXES[softmax]

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q_norm(self.heads(self.q(x))), self.k_norm(self.heads(self.k(x)))
        attn = self.softmax(self.chain(q @ k.transpose(-1, -2) * SCALE, self))[..., :TOKENS]
        y = (attn @ self.heads(self.v(x))).transpose(1, 2).reshape(x.shape)
        out: torch.Tensor = self.o(y)
        return out


class Routed(nn.Module):
    """A feed-forward of two experts mixed by a router's softmax over a Linear's output, times
    one over ``x @ w.T``: neither softmax is attention."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, 2)
        self.w = nn.Parameter(torch.randn(2, WIDTH))
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.nan_to_num(self.router(x)).softmax(-1) * F.softmax(
            (x @ self.w.T).clamp(-50, 50), dim=-1
        )
        out: torch.Tensor = sum(  # type: ignore[assignment]
            weights[..., i : i + 1] * e(x) for i, e in enumerate(self.experts)
        )
        return out


class PostLNBlock(nn.Module):
    def __init__(self, chain: str, softmax: str | None) -> None:
        super().__init__()
        self.attn, self.ff = Attention(chain, softmax), Routed()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        out: torch.Tensor = self.ln2(x + self.ff(x))
        return out


class Net(nn.Module):
    def __init__(self, chain: str, softmax: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PostLNBlock(chain, softmax) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model(chain: str, softmax: str | None = None) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(chain, softmax), torch.randn(2, TOKENS, WIDTH)


def _attention_paths() -> list[str]:
    return [f"blocks.{i}.attn" for i in range(BLOCKS)]


@pytest.mark.parametrize("chain", list(CHAINS))
def test_elementwise_ops_before_the_softmax_leave_it_attention(chain: str) -> None:
    model, x = _model(chain)
    m = normprobe.discover(model, x)
    assert [(a.path, a.impl, a.heads) for a in m.attention] == [
        (p, "eager", HEADS) for p in _attention_paths()
    ]
    roles = {n.path: n.role for n in m.norms}
    for p in _attention_paths():
        assert roles[f"{p}.q_norm"] == roles[f"{p}.k_norm"] == "qk"
    assert m.stacks[0].qk_norm


@pytest.mark.parametrize("softmax", [*SOFTMAXES, None])
def test_every_way_of_calling_softmax_is_attention(softmax: str | None) -> None:
    model, x = _model("nan_to_num", softmax)
    m = normprobe.discover(model, x)
    assert [a.path for a in m.attention] == _attention_paths()


def test_log_softmax_over_a_product_is_not_attention() -> None:
    class Contrastive(nn.Module):
        """A similarity of two embeddings' log-softmax (a contrastive loss's log-probs)."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.log_softmax(self.a(x) @ self.b(x).transpose(-1, -2) * 0.1, dim=-1)

    torch.manual_seed(0)
    assert normprobe.discover(Contrastive(), torch.randn(2, TOKENS, WIDTH)).attention == []


@pytest.mark.parametrize("chain", ["nan_to_num", "all"])
def test_deepnorm_gives_queries_and_keys_gain_one(chain: str) -> None:
    model, x = _model(chain)
    normprobe.reinit(model, "deepnorm", example_inputs=(x,))
    beta = (8 * BLOCKS) ** -0.25  # 0.5
    xavier = math.sqrt(2 / (WIDTH + WIDTH))  # std of Xavier-normal at gain 1, square weights
    for block in model.blocks:
        a = block.attn
        stds = {name: float(getattr(a, name).weight.detach().std()) for name in "qkvo"}
        want = {"q": xavier, "k": xavier, "v": beta * xavier, "o": beta * xavier}
        assert stds == pytest.approx(want, rel=0.1), stds


@pytest.mark.parametrize("chain", list(CHAINS))
def test_attention_logits_are_read_as_the_model_forms_them(chain: str, tmp_path: Path) -> None:
    """The scaled q·k product with what the model computes from it alone (soft-capping,
    clamping, casts), before a mask or bias meets it."""
    model, x = _model(chain)
    want: dict[str, float] = {}

    def grab(path: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(a: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            assert isinstance(a, Attention)
            q, k = a.q_norm(a.heads(a.q(args[0]))), a.k_norm(a.heads(a.k(args[0])))
            formed = CHAINS[chain][1](q @ k.transpose(-1, -2) * SCALE, a)
            want[path] = float(formed.abs().max())

        return hook

    for p in _attention_paths():
        model.get_submodule(p).register_forward_pre_hook(grab(p))
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits"]) as probe:
        with torch.no_grad():
            model(x)
        probe.step()
        assert probe.latest is not None
        got = {p: probe.latest.scalars[probe.tag("attn_logit_max", p)] for p in want}
    assert got == pytest.approx(want, rel=1e-5)
    assert max(got.values()) > 0
