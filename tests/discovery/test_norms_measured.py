"""Facts about a norm class of its own are measured, not guessed from its name: without example
inputs (the class run alone on a made-up input), in bfloat16, and where some heads of a
multi-head norm sit near eps on the traced input. What cannot be measured is unknown, and
surgery and re-initialization refuse to guess it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from x_transformers import Decoder, TransformerWrapper

import normprobe
from normprobe.models import TinyTransformer


def _x_transformer(rmsnorm: bool) -> TransformerWrapper:
    torch.manual_seed(0)
    model = TransformerWrapper(
        num_tokens=64,
        max_seq_len=16,
        attn_layers=Decoder(dim=32, depth=2, heads=2, use_rmsnorm=rmsnorm),
    )
    with torch.no_grad():  # the gains away from their init: 1 + g with g = 0 hides the offset
        for name, p in model.named_parameters():
            if name.endswith((".g", ".gamma")):
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
    return model.eval()


@pytest.mark.parametrize("rmsnorm", [False, True], ids=["layernorm", "rmsnorm"])
def test_a_unit_offset_gain_is_measured_without_example_inputs(rmsnorm: bool) -> None:
    # x-transformers' LayerNorm and RMSNorm scale by 1 + gain by default: named like any norm
    model = _x_transformer(rmsnorm)
    tokens = torch.randint(0, 64, (2, 16))
    # two per block and the final one (the wrapper's parameter-free nn.LayerNorm listed apart)
    norms = [n for n in normprobe.discover(model).norms if n.affine]
    assert len(norms) == 5
    assert all(n.gain_offset == 1.0 and "by behaviour" in n.recognized_by for n in norms)
    if rmsnorm:  # converted alone (the LayerNorm wrapper's fold needs a traced forward)
        gains = [p.detach().clone() for n, p in model.named_parameters() if n.endswith(".g")]
        converted = normprobe.convert_norms(model, "layernorm")
        new = [m for m in converted.modules() if type(m) is nn.LayerNorm]
        assert len(new) == 5
        for layer, gain in zip(new, gains, strict=True):  # 1 + g, carried in the same Parameter
            torch.testing.assert_close(layer.weight.detach(), 1 + gain)
        assert converted(tokens).isfinite().all()


def test_a_bfloat16_norm_is_measured_in_float32() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 8))
    norms = normprobe.discover(model, ids).norms
    assert len(norms) == 5
    # bf16's rounding (0.4%) once hid the scale invariance: "behaviour probe disagreed"
    assert all(n.recognized_by.endswith("kind by behaviour") for n in norms)
    assert {(n.kind, n.gain_offset) for n in norms} == {("rmsnorm", 0.0)}
    with torch.no_grad():
        before = model(ids).logits
        converted = normprobe.convert_norms(model, "rmsnorm", example_inputs=(ids,))
        assert sum(type(m) is nn.RMSNorm for m in converted.modules()) == 5
        torch.testing.assert_close(converted(ids).logits, before, rtol=0.02, atol=0.02)


class MultiHeadLayerNorm(nn.Module):
    """xLSTM's head norm: a LayerNorm over each head's features, its output scaled by 1 + weight
    (zero at init), heads merged into one axis."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.weight = nn.Parameter(torch.zeros(heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, sequence, heads, head_dim)
        normed = F.layer_norm(x, (self.head_dim,), eps=1e-5)
        return normed.flatten(-2) * (1 + self.weight)


class QuietHeads(nn.Module):
    """A block whose first head's features are nearly constant (variance 1e-8 against eps 1e-5,
    as an mLSTM's can be at init): on the traced input that head is not scale invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.norm = MultiHeadLayerNorm(2, 8)
        self.down = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).unflatten(-1, (2, 8))
        h = torch.cat([1e-4 * h[..., :1, :], h[..., 1:, :]], dim=-2)
        return x + self.down(self.norm(h))


def test_a_head_norm_with_heads_near_eps_is_measured_on_a_fresh_input() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(QuietHeads(), QuietHeads())
    x = torch.randn(2, 5, 16)
    norms = normprobe.discover(model, x).norms
    assert [(n.path, n.gain_offset, n.dims, n.layout) for n in norms] == [
        (f"{i}.norm", 1.0, (8,), "channels-last") for i in range(2)
    ]
    normprobe.reinit(model, "gpt2", example_inputs=(x,))
    for i in range(2):  # the gain set to 1 through its offset: weight 0, not 1
        assert torch.equal(model[i].norm.weight, torch.zeros(16))


class ScaledRMSNorm(nn.Module):
    """A norm scaled by a condition its block sets around each call: discovery cannot run it
    on variations of its input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.condition: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.condition is not None, "set by the block"
        return F.rms_norm(x, (x.shape[-1],)) * (1 + self.weight) * self.condition


class ScaledBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = ScaledRMSNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm.condition = torch.ones(())
        out = x + self.fc(self.norm(x))
        self.norm.condition = None
        return out


def test_an_unmeasured_gain_offset_is_unknown_and_refused() -> None:
    model = nn.Sequential(ScaledBlock(8), ScaledBlock(8))
    x = torch.randn(3, 8)
    for inputs in [(), (x,)]:
        norms = normprobe.discover(model, *inputs).norms
        assert [(n.path, n.gain_offset) for n in norms] == [("0.norm", None), ("1.norm", None)]
    refused = r"0\.norm \(ScaledRMSNorm\) .*; pass example_inputs"
    with pytest.raises(ValueError, match=refused):
        normprobe.convert_norms(model, "rmsnorm")
    unknown = r"0\.norm \(ScaledRMSNorm\) scales by its weight or by 1 \+ weight"
    with pytest.raises(ValueError, match=unknown):
        normprobe.reinit(model, "gpt2", example_inputs=(x,))
    assert all(torch.equal(b.norm.weight, torch.ones(8)) for b in model)  # nothing changed


def test_torch_norms_keep_their_known_offset_without_example_inputs() -> None:
    norms = normprobe.discover(TinyTransformer()).norms
    assert norms and all(n.gain_offset == 0.0 for n in norms)


class LinearAttention(nn.Module):
    """Kernel-free linear attention, (q (k^T v)) / (q . sum(k)): scale invariant in q, its first
    input, as a normalizer is in its only one (PyG's Performer kernel, forward(q, k, v))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("projection", torch.eye(width))  # the Performer's random features

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = q @ self.projection, k @ self.projection
        num = q @ (k.transpose(-1, -2) @ v)
        return num / (q @ k.sum(dim=-2, keepdim=True).transpose(-1, -2))


class LinearAttentionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.attn = LinearAttention(width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(self.attn(q, F.softplus(k), v))


def test_a_module_of_several_inputs_is_no_norm_by_behaviour() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LinearAttentionBlock(16), LinearAttentionBlock(16))
    assert normprobe.discover(model, torch.randn(2, 6, 16)).norms == []


def test_a_gain_over_several_heads_is_refused_with_what_was_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(QuietHeads(), QuietHeads())
    x = torch.randn(2, 5, 16)
    refused = r"0\.norm \(MultiHeadLayerNorm\) normalizes over \(8,\) \(channels-last\) .* \(16,\)"
    with pytest.raises(ValueError, match=refused):
        normprobe.convert_norms(model, "rmsnorm", example_inputs=(x,))
