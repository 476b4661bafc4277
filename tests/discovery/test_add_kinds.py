"""Adds that are not what they look like: a position embedding added to the queries of a
detection decoder (no residual add), a LoRA or DoRA layer's own sum (one layer, no parallel
branches), and a Fourier branch with a complex weight (a residual add all the same)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe
from normprobe import ModelMap

D = 32


def _discover(model: nn.Module, *args: torch.Tensor) -> ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normprobe.discover(model, *args)


# --- a position embedding computed from the stream ------------------------------------------


class DecoderLayer(nn.Module):
    """ultralytics/nn/modules/transformer.py, DeformableTransformerDecoderLayer: Post-LN self-
    attention, cross-attention and FFN; ``query_pos`` is added to the queries (and keys) only,
    the stream carries on with ``embed`` (the deformable cross-attention as plain attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm1 = nn.LayerNorm(D)
        self.cross_attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(D)
        self.linear1, self.linear2 = nn.Linear(D, 64), nn.Linear(64, D)
        self.norm3 = nn.LayerNorm(D)

    def forward(self, embed: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q = k = embed + pos  # with_pos_embed
        embed = self.norm1(embed + self.self_attn(q, k, embed, need_weights=False)[0])
        q = embed + pos
        embed = self.norm2(embed + self.cross_attn(q, feats, feats, need_weights=False)[0])
        return self.norm3(embed + self.linear2(F.relu(self.linear1(embed))))


class Decoder(nn.Module):
    """DeformableTransformerDecoder: each layer's ``query_pos`` is ``pos_mlp`` of the boxes the
    previous layer's output refined (detached), so it descends from the stream."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(n))
        self.pos_mlp = nn.Sequential(nn.Linear(4, D), nn.ReLU(), nn.Linear(D, D))
        self.bbox_head = nn.ModuleList(nn.Linear(D, 4) for _ in range(n))

    def forward(
        self, embed: torch.Tensor, refer: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        boxes = []
        for layer, head in zip(self.layers, self.bbox_head, strict=True):
            embed = layer(embed, feats, self.pos_mlp(refer))
            refer = torch.sigmoid(head(embed) + torch.logit(refer, eps=1e-5)).detach()
            boxes.append(refer)
        return torch.stack(boxes)


def test_a_position_embedding_added_to_the_queries_is_no_residual_add() -> None:
    torch.manual_seed(0)
    m = _discover(Decoder(), torch.randn(2, 10, D), torch.rand(2, 10, 4), torch.randn(2, 20, D))
    # 3 layers x (self-attention, cross-attention, FFN); the old code took `embed + pos` for
    # adds too (14: layer 0's second, both of layers 1 and 2), pos_mlp.2 writing the stream
    assert len(m.residual_adds) == 9
    assert all(len(a.writers) == 1 for a in m.residual_adds)
    assert {a.writers[0].rpartition(".")[2] for a in m.residual_adds} == {"out_proj", "linear2"}
    assert (m.stacks[0].path, m.stacks[0].depth, m.stacks[0].placement) == ("layers", 3, "post-ln")
    assert {n.role for n in m.norms if n.path.endswith(("norm1", "norm2"))} == {"post"}


# --- LoRA and DoRA layers ---------------------------------------------------------------


class TorchtuneLoRALinear(nn.Module):
    """torchtune/modules/peft/lora.py, LoRALinear: its own weight applied by F.linear, plus
    ``(alpha / rank) * lora_b(lora_a(dropout(x)))``; lora_b starts at zero."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.dropout = nn.Dropout(0.1)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out + self.scale * self.lora_b(self.lora_a(self.dropout(x)))


class PeftLoRALinear(nn.Module):
    """peft/tuners/lora/layer.py, lora.Linear: a wrapped ``base_layer`` plus
    ``lora_B[name](lora_A[name](dropout[name](x))) * scaling[name]``, cast back to its dtype."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, d_out, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(0.1)})
        self.scaling = {"default": alpha / rank}
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        dtype = result.dtype
        a, b = self.lora_A["default"], self.lora_B["default"]
        x = x.to(a.weight.dtype)
        result = result + b(a(self.lora_dropout["default"](x))) * self.scaling["default"]
        return result.to(dtype)


class TorchtuneDoRALinear(TorchtuneLoRALinear):
    """torchtune/modules/peft/dora.py, DoRALinear: ``dora_out + base_out`` with
    ``dora_out = (m / |W + s B A| - 1) * base_out + m / |W + s B A| * s * lora_out``, the norm
    of the adapted weight computed from the parameters (``lora_b(lora_a(eye))``)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__(d_in, d_out, rank, alpha)
        self.magnitude = nn.Parameter(self.weight.detach().norm(p=2, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base_out = F.linear(x, self.weight)
        x = self.dropout(x)
        lora_out = self.lora_b(self.lora_a(x))
        eye = torch.eye(self.lora_a.weight.shape[1], dtype=x.dtype)
        lora_weight = self.lora_b(self.lora_a(eye)).T
        weight_norm = (self.weight + self.scale * lora_weight.detach()).norm(p=2, dim=1).detach()
        mag_norm_scale = (self.magnitude / weight_norm).view(1, -1)
        dora_out = (mag_norm_scale - 1) * base_out + mag_norm_scale * lora_out * self.scale
        return dora_out + base_out


ADAPTERS = {"torchtune LoRA": TorchtuneLoRALinear, "PEFT LoRA": PeftLoRALinear}
ADAPTERS["torchtune DoRA"] = TorchtuneDoRALinear


class LoRABlock(nn.Module):
    """torchtune/models/llama3/_component_builders.py, lora_llama3: a Pre-LN block whose q, v
    and output projections and w1, w2, w3 are adapted."""

    def __init__(self, lora: type[nn.Module]) -> None:
        super().__init__()
        self.sa_norm, self.mlp_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj = lora(D, D), nn.Linear(D, D), lora(D, D)
        self.output_proj = lora(D, D)
        self.w1, self.w2, self.w3 = lora(D, 64), lora(64, D), lora(D, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sa_norm(x)
        q, k, v = (p(h).unflatten(-1, (4, D // 4)).transpose(1, 2) for p in self._qkv())
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.output_proj(a.transpose(1, 2).flatten(2))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def _qkv(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.q_proj, self.k_proj, self.v_proj


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_lora_layer_is_one_writer_not_parallel_branches(adapter: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[LoRABlock(ADAPTERS[adapter]) for _ in range(3)])
    m = _discover(model, torch.randn(2, 8, D))
    # 3 blocks x 2 adds (attention, MLP): none inside an adapted layer (PEFT's and DoRA's old
    # count: 3 x 8; torchtune LoRA's blocks were parallel, lora_b a second writer)
    assert len(m.residual_adds) == 6
    assert [(s.depth, s.placement) for s in m.stacks] == [(3, "pre-ln")]
    assert not any(a.parallel for a in m.residual_adds)
    first, second = m.residual_adds[:2]
    assert first.writers == ("0.output_proj",) and second.writers == ("0.w2",)
    lora_b = "lora_B.default" if adapter == "PEFT LoRA" else "lora_b"
    assert f"0.w2.{lora_b}.weight" in second.writer_params  # the adapter scales with the layer
    assert not any(d.kind == "unattached-writer" for d in m.doubts)


# --- a Fourier branch ---------------------------------------------------------------------


class FourierBlock(nn.Module):
    """neuralforecast/models/fedformer.py, FourierBlock: the queries' rfft modes mixed by a
    complex weight (einsum 'bhix,hiox->bhox'), back by irfft; AutoCorrelationLayer's
    projections around it."""

    def __init__(self, heads: int = 4, modes: int = 3) -> None:
        super().__init__()
        e = D // heads
        self.heads, self.modes = heads, modes
        self.weights1 = nn.Parameter(torch.rand(heads, e, e, modes, dtype=torch.cfloat) / D)
        self.query_projection, self.out_projection = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.query_projection(x).view(b, n, self.heads, -1).permute(0, 2, 3, 1)
        modes = torch.fft.rfft(q, dim=-1)[..., : self.modes]
        out = torch.fft.irfft(torch.einsum("bhix,hiox->bhox", modes, self.weights1), n=n)
        return self.out_projection(out.permute(0, 3, 1, 2).reshape(b, n, D))


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = FourierBlock()
        self.conv1, self.conv2 = nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.conv2(F.relu(self.conv1(x)))


def test_a_fourier_branch_with_a_complex_weight_is_a_branch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, D), EncoderLayer(), EncoderLayer(), nn.Linear(D, 1))
    m = _discover(model, torch.randn(4, 16, 1))
    # the old code took the complex modes for an index picking the weight's matrices: the
    # einsum's output (and the whole branch) became a parameter, and both #0 adds were lost
    writers = [a.writers[0] for a in m.residual_adds]
    assert writers == [
        "1.attention.out_projection",
        "1.conv2",
        "2.attention.out_projection",
        "2.conv2",
    ]
    assert "1.attention" in m.residual_adds[0].branch_layers  # weights1, the einsum's
