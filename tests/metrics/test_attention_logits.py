"""Attention found however it is computed (an ``nn.Softmax`` child, fused,
``nn.MultiheadAttention``) and its logits read as the model forms them from q and k, additive
masks and biases left out."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import probes
from normprobe.diagnose import diagnose

WIDTH, HEADS, TOKENS = 16, 2, 8


class WindowAttention(nn.Module):
    """timm's window attention with ``fused_attn=False``: q scaled, q·k, a relative-position bias
    and a shifted-window mask of -100 added, the softmax run by an ``nn.Softmax`` child.
    ``fused=True`` passes bias and mask to ``scaled_dot_product_attention`` as a float mask.
    ``softcap`` soft-caps the logits with tanh as Gemma 2 does."""

    mask: torch.Tensor

    def __init__(self, fused: bool = False, softcap: float | None = None) -> None:
        super().__init__()
        self.fused, self.softcap = fused, softcap
        self.head_dim = WIDTH // HEADS
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.randn(HEADS, TOKENS, TOKENS))
        self.softmax = nn.Softmax(dim=-1)
        window = torch.arange(TOKENS) < TOKENS // 2  # two windows: tokens attend within theirs
        mask = torch.zeros(TOKENS, TOKENS).masked_fill(window[:, None] != window[None, :], -100.0)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, HEADS, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + self.mask)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if self.softcap is not None:
                attn = torch.tanh(attn / self.softcap) * self.softcap
            attn = attn + self.bias
            attn = attn.view(b, 1, HEADS, n, n) + self.mask
            y = self.softmax(attn.view(b, HEADS, n, n)) @ v
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, n, d))
        return out


class Router(nn.Module):
    """Two experts mixed by a router's softmax, over a Linear's logits or over ``x @ w.T``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 2)
        self.w = nn.Parameter(torch.randn(2, WIDTH))
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1) * (x @ self.w.T).softmax(-1)
        out: torch.Tensor = sum(  # type: ignore[assignment]
            weights[..., i : i + 1] * e(x) for i, e in enumerate(self.experts)
        )
        return out


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = attn
        self.mlp = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, **attn: object) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WindowAttention(**attn)) for _ in range(2))  # type: ignore[arg-type]
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def logged(model: nn.Module, x: torch.Tensor, tmp_path: Path) -> dict[str, float]:
    """attn_logit_max of one logged forward, by attention path."""
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits"]) as probe:
        with torch.no_grad():
            model(x)
        probe.step()
        assert probe.model_map is not None and probe.latest is not None
        scalars = probe.latest.scalars
        return {
            a.path: scalars[probe.tag("attn_logit_max", a.path)] for a in probe.model_map.attention
        }


def qk_max(
    model: nn.Module, x: torch.Tensor, layer: type[nn.Module], logits: object
) -> dict[str, float]:
    """``logits(module, input)`` (a tensor of logits) for every ``layer`` of ``model``: max |.|."""
    found: dict[str, float] = {}
    paths = {m: p for p, m in model.named_modules()}

    def grab(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        s = logits(m, args[0])  # type: ignore[operator]
        found[paths[m]] = float(s.abs().max())

    handles = [m.register_forward_pre_hook(grab) for m in model.modules() if isinstance(m, layer)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return found


def window_logits(m: WindowAttention, x: torch.Tensor) -> torch.Tensor:
    b, n, _ = x.shape
    q, k, _ = m.qkv(x).view(b, n, 3, HEADS, m.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    s = q @ k.transpose(-2, -1) * m.scale
    return s if m.softcap is None else torch.tanh(s / m.softcap) * m.softcap


@pytest.mark.parametrize(
    ("options", "impl"),
    [({}, "eager"), ({"softcap": 0.5}, "eager"), ({"fused": True}, "sdpa")],
    ids=["softmax-module", "softcap", "sdpa-float-mask"],
)
def test_window_attention_logits_leave_the_mask_out(
    tmp_path: Path, options: dict[str, object], impl: str
) -> None:
    torch.manual_seed(0)
    model, x = Net(**options), torch.randn(2, TOKENS, WIDTH)
    model_map = normprobe.discover(model, x)
    # found through its nn.Softmax child; the routers' softmaxes are not attention
    assert [(a.path, a.impl) for a in model_map.attention] == [
        ("blocks.0.attn", impl),
        ("blocks.1.attn", impl),
    ]
    got = logged(model, x, tmp_path)
    want = qk_max(model, x, WindowAttention, window_logits)
    assert got == pytest.approx(want, rel=1e-5)
    assert 0 < max(got.values()) < 5  # the mask's -100 is not a logit of 100
    if "softcap" in options:
        assert max(got.values()) < 0.5


def test_multihead_attention_logits_from_in_proj(tmp_path: Path) -> None:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    x = torch.randn(2, 3, 32, 32)

    def logits(m: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
        e, h = m.embed_dim, m.num_heads
        w, b = m.in_proj_weight, m.in_proj_bias
        assert b is not None
        q = (x @ w[:e].T + b[:e]).unflatten(-1, (h, e // h)).transpose(1, 2)
        k = (x @ w[e : 2 * e].T + b[e : 2 * e]).unflatten(-1, (h, e // h)).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(e // h)

    want = qk_max(model, x, nn.MultiheadAttention, logits)
    assert list(want) == [f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(2)]
    model_map = normprobe.discover(model, x)
    assert [(a.path, a.impl) for a in model_map.attention] == [(p, "mha") for p in want]
    got = logged(model, x, tmp_path)
    assert got == pytest.approx(want, rel=1e-5)


class FunctionalMultiheadAttention(nn.Module):
    """fairseq's MultiheadAttention (ESM-1): its own parameters handed to
    ``F.multi_head_attention_forward``, (tokens, batch, features) in and out."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * WIDTH, WIDTH) / math.sqrt(WIDTH))
        self.in_proj_bias = nn.Parameter(0.1 * torch.randn(3 * WIDTH))
        self.out_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            t, t, t, WIDTH, self.heads, self.in_proj_weight, self.in_proj_bias,
            None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias,
            need_weights=False,
        )  # fmt: skip
        return out.transpose(0, 1)


def test_a_module_of_its_own_calling_multi_head_attention_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(FunctionalMultiheadAttention()) for _ in range(2)])
    x = torch.randn(2, 6, WIDTH)

    def logits(m: FunctionalMultiheadAttention, x: torch.Tensor) -> torch.Tensor:
        w, b, d = m.in_proj_weight, m.in_proj_bias, WIDTH // m.heads
        q = (x @ w[:WIDTH].T + b[:WIDTH]).unflatten(-1, (m.heads, d)).transpose(1, 2)
        k = (x @ w[WIDTH : 2 * WIDTH].T + b[WIDTH : 2 * WIDTH]).unflatten(-1, (m.heads, d))
        return q @ k.permute(0, 2, 3, 1) / math.sqrt(d)

    want = qk_max(model, x, FunctionalMultiheadAttention, logits)
    found = normprobe.discover(model, x).attention
    assert [(a.path, a.impl, a.heads) for a in found] == [(p, "mha", 4) for p in want]
    assert logged(model, x, tmp_path) == pytest.approx(want, rel=1e-5)


def test_mha_logit_max_unbatched_separate_weights_and_bias_k() -> None:
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, kdim=6, vdim=6, add_bias_kv=True)
    query, key = torch.randn(5, 8), torch.randn(7, 6)
    b = m.in_proj_bias
    assert b is not None and m.bias_k is not None
    q = (m.q_proj_weight @ query.T).T + b[:8]
    k = torch.cat([(m.k_proj_weight @ key.T).T + b[8:16], m.bias_k[0]])
    s = torch.einsum("qhd,khd->hqk", q.view(5, 2, 4), k.view(8, 2, 4)) / 2.0
    got = probes.mha_logit_max(
        query, key, 2, m.q_proj_weight, b[:8], m.k_proj_weight, b[8:16], m.bias_k
    )
    torch.testing.assert_close(got, s.detach().abs().amax(dim=(1, 2)), rtol=1e-5, atol=0)


def test_swin_at_init_has_no_attention_logit_finding(tmp_path: Path) -> None:
    from timm.models.swin_transformer import SwinTransformer, WindowAttention

    torch.manual_seed(0)
    model = SwinTransformer(
        img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=10
    )
    attention = [p for p, m in model.named_modules() if isinstance(m, WindowAttention)]
    for p in attention:
        model.get_submodule(p).fused_attn = False  # type: ignore[assignment]
    # the second block of the first stage shifts its windows: a -100 mask on 8x8 tokens
    assert model.layers[0].blocks[1].attn_mask is not None  # type: ignore[index,union-attr]
    x = torch.randn(2, 3, 32, 32)
    model_map = normprobe.discover(model, x)
    assert [(a.path, a.impl) for a in model_map.attention] == [(p, "eager") for p in attention]
    got = logged(model, x, tmp_path)
    assert all(0 < v < 1 for v in got.values())
    found = diagnose(model, x)
    assert found.checks["attention-logits"] == "ok"
    assert "attention-logits" not in found.codes


def test_sampled_logit_max_is_below_the_exact_one_and_finds_a_sink_and_a_large_query() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 512, 16), torch.randn(2, 4, 512, 16)
    with torch.no_grad():
        k[0, 1, 5] = 50.0 * q[0, 1, 70] / q[0, 1, 70].norm()  # a sink key: the max of head 1
        q[1, 2, 100] *= 30.0  # a query 30x larger: the max of head 2
    exact = (q @ k.transpose(-1, -2)).abs().amax(dim=(0, 2, 3)) / 4
    assert len(probes.logit_sample(q, k)) == 2  # sampled: a quarter of the products
    got = probes.sdpa_logit_max(q, k)
    assert (got <= exact).all()
    torch.testing.assert_close(got[1:3], exact[1:3])
    assert exact[1] > 4 * exact[0] and exact[2] > 4 * exact[0]
    # grouped-query: 2 key heads serve 4 query heads; the sample reads the same heads' maxima
    k2 = k[:, ::2].clone()
    with torch.no_grad():
        k2[0, 0, 5] = 50.0 * q[0, 1, 70] / q[0, 1, 70].norm()  # serves query heads 0 and 1
    exact = (q @ k2.repeat_interleave(2, dim=1).transpose(-1, -2)).abs().amax(dim=(0, 2, 3)) / 4
    got = probes.sdpa_logit_max(q, k2)
    assert (got <= exact).all()
    torch.testing.assert_close(got[1:3], exact[1:3])


def test_sequences_up_to_128_tokens_are_formed_whole() -> None:
    q, k = torch.randn(1, 2, 128, 8), torch.randn(1, 2, 128, 8)
    [(query, key)] = probes.logit_sample(q, k)
    assert query is q and key is k
    assert len(probes.logit_sample(torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8))) == 2
