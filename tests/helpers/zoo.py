"""A zoo of small, randomly initialized models with hand-derived ground truth for discovery tests.

Every model is built from a config (no downloads), seeded with ``torch.manual_seed(0)``, returned in
``eval()`` mode together with example inputs, and runs one CPU forward in well under a second.

The expected numbers were derived by reading each model's source (transformers 5.24.0,
timm 1.0.31; line numbers refer to those files under ``site-packages``) and are explained in the
comment above each builder. A few were then cross-checked by counting modules by class. The
Hugging Face models are rows of a table (`HFCase`: config, options, inputs, expectations) that one
builder, `build_hf`, makes; ``zoo_hf.py`` uses the same table form.

Conventions used in ``Expected``:

* ``norms``/``roles`` count every normalization layer in ``model.named_modules()``.
* ``stacks`` lists every stack discovery finds, as ``path -> (blocks, placement)``.
* ``adds_per_stack`` gives the residual adds assigned to each listed stack (the innermost stack
  containing the add's ``branch_out`` layer); a listed stack holding no add's ``branch_out``
  (ConvNeXt's outer ``stages``, ResidualStack's ``lns``) has 0.
* ``branch_out`` keys are ``"<module path>#<ordinal>"``; the root module's path is ``""`` so its
  adds read ``"#0"``, ``"#1"``, ...
* ``attention`` counts modules that compute softmax(QK^T) in their own forward (directly or via a
  plain function such as HF's ``eager_attention_forward``) or call
  ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from normprobe.models import ResidualStack

__all__ = [
    "NAMES",
    "UNTRACEABLE",
    "Built",
    "Expected",
    "HFCase",
    "Inputs",
    "ZooModel",
    "build",
    "build_hf",
    "deepnet_alpha",
    "lm_inputs",
]


@dataclass(frozen=True, kw_only=True)
class Expected:
    """Ground truth for one zoo model (see the module docstring for the conventions).

    ``branch_out`` left out is the single writer of each add in ``writers`` (None where an add
    has several), what `normprobe.ResidualAdd.branch_out` documents.
    """

    norms: dict[str, int]
    roles: dict[str, int]
    stacks: dict[str, tuple[int, str]]
    adds_per_stack: dict[str, int]
    residual_adds: int
    attention: int
    head: str | None
    projection_adds: int = 0
    # "<module path>#<ordinal>" -> every layer writing into the stream through that add
    writers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    branch_out: dict[str, str | None] | None = None
    # "<module path>#<ordinal>" -> every layer whose output multiplies what that add writes
    gates: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.branch_out is None:
            single = {k: v[0] if len(v) == 1 else None for k, v in self.writers.items()}
            object.__setattr__(self, "branch_out", single)


@dataclass
class ZooModel:
    """A model, the inputs for one forward (``model(*args, **kwargs)``) and its ground truth."""

    name: str
    model: nn.Module
    args: tuple[object, ...]
    kwargs: dict[str, object]
    expected: Expected


# --------------------------------------------------------------------------------------------
# Hand-written building blocks
# --------------------------------------------------------------------------------------------

VOCAB = 128
SEQ = 16
BATCH = 2


def _token_ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ))


Inputs = tuple[tuple[object, ...], dict[str, object]]
Built = tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]


def lm_inputs() -> Inputs:
    """Token ids for a language model, without its key/value cache."""
    return (_token_ids(),), {"use_cache": False}


@dataclass(frozen=True)
class HFCase:
    """A Hugging Face architecture as a row of a table: ``model(config(**options))`` (class
    names in ``transformers``), run on ``inputs()`` (drawn after the model is built), mapped as
    ``expected``."""

    config: str
    model: str
    options: dict[str, Any]
    expected: Expected
    inputs: Callable[[], Inputs] = lm_inputs


def build_hf(case: HFCase) -> Built:
    """The model, inputs and expectations of ``case``."""
    import transformers

    model = getattr(transformers, case.model)(getattr(transformers, case.config)(**case.options))
    args, kwargs = case.inputs()
    return model, args, kwargs, case.expected


class FeatureScaler(nn.Module):
    """A user's RMSNorm under a name that does not say so: ``gain * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class TinyMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: a transformer feed-forward branch (no residual add inside)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class TinyAttention(nn.Module):
    """Causal multi-head self-attention.

    ``eager=True`` computes ``softmax(q k^T * scale + mask) v`` itself (the mask add is NOT a
    residual add); otherwise it calls ``F.scaled_dot_product_attention``. ``qk_norm=True`` puts an
    ``nn.LayerNorm(head_dim)`` on queries and keys.
    """

    mask: torch.Tensor

    def __init__(
        self, d: int, n_heads: int, *, eager: bool = False, qk_norm: bool = False, t_max: int = 64
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d // n_heads
        self.eager = eager
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        mask = torch.full((t_max, t_max), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.eager:
            scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5 + self.mask[:t, :t]
            y = scores.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class PreNormBlock(nn.Module):
    """``x = x + attn(n1(x)); x = x + mlp(n2(x))`` with norms built by ``make_norm``.

    ``norm_names`` sets the two norms' attribute names, so a model can avoid names that give them
    away (the custom-RMSNorm model uses ``scaler1``/``scaler2``).
    """

    def __init__(
        self,
        d: int,
        n_heads: int,
        make_norm: Callable[[int], nn.Module],
        *,
        qk_norm: bool = False,
        norm_names: tuple[str, str] = ("norm1", "norm2"),
    ) -> None:
        super().__init__()
        self._n1, self._n2 = norm_names
        setattr(self, self._n1, make_norm(d))
        self.attn = TinyAttention(d, n_heads, qk_norm=qk_norm)
        setattr(self, self._n2, make_norm(d))
        self.mlp = TinyMLP(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(getattr(self, self._n1)(x))
        x = x + self.mlp(getattr(self, self._n2)(x))
        return x


class DeepNormBlock(nn.Module):
    """DeepNet (Wang et al. 2022) Post-LN block: ``x = LN(alpha * x + F(x))`` for attn and mlp."""

    def __init__(self, d: int, n_heads: int, alpha: float, beta: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.attn = TinyAttention(d, n_heads, eager=True)
        self.ln1 = nn.LayerNorm(d)
        self.mlp = TinyMLP(d, 4 * d)
        self.ln2 = nn.LayerNorm(d)
        # DeepNet init: xavier with gain beta on v/out projections and the FFN (q/k gain 1).
        with torch.no_grad():
            d_ = self.attn.qkv.weight.shape[1]
            nn.init.xavier_normal_(self.attn.qkv.weight[: 2 * d_], gain=1.0)
            nn.init.xavier_normal_(self.attn.qkv.weight[2 * d_ :], gain=beta)
            for lin in (self.attn.out, self.mlp.fc1, self.mlp.fc2):
                nn.init.xavier_normal_(lin.weight, gain=beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x * self.alpha + self.attn(x))
        x = self.ln2(self.alpha * x + self.mlp(x))
        return x


class TinyLM(nn.Module):
    """Token + learned position embeddings (their add is NOT residual), blocks, optional final
    norm (attribute ``final``), and a ``head`` producing logits."""

    def __init__(
        self, blocks: list[nn.Module], d: int, final: nn.Module | None, vocab: int = VOCAB
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(blocks)
        self.final = final
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        if self.final is not None:
            h = self.final(h)
        out: torch.Tensor = self.head(h)
        return out


class ResidualMLP(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``; ``norm`` may be absent (``with_norm=False``)."""

    def __init__(self, d: int, hidden: int, with_norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d) if with_norm else None
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.norm is None else self.norm(x)
        branch: torch.Tensor = self.fc2(F.gelu(self.fc1(h)))
        return x + branch


class NoNormNet(nn.Module):
    """``inp`` -> 4 residual MLP blocks without any norm -> ``head``."""

    def __init__(self, d_in: int = 16, d: int = 64, depth: int = 4, n_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(ResidualMLP(d, 2 * d) for _ in range(depth))
        self.head = nn.Linear(d, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


class ControlFlowNet(nn.Module):
    """A forward with data-dependent Python control flow (``torch.fx.symbolic_trace`` fails).

    ``inp`` -> 3 Pre-LN residual MLPs (``blocks``) -> ``refine`` applied ``steps`` times, where
    ``steps = 1 + int((x > 0).all())`` is read from the input -> ``if_pos`` if ``x.mean() > 0``
    else ``if_neg`` -> final LayerNorm ``final`` -> ``head``.
    """

    def __init__(self, d_in: int = 16, d: int = 32, n_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(ResidualMLP(d, 2 * d, with_norm=True) for _ in range(3))
        self.refine = ResidualMLP(d, 2 * d)
        self.if_pos = ResidualMLP(d, 2 * d)
        self.if_neg = ResidualMLP(d, 2 * d)
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        steps = 1 + int((x > 0).all())
        for _ in range(steps):
            h = self.refine(h)
        h = self.if_pos(h) if x.mean() > 0 else self.if_neg(h)
        out: torch.Tensor = self.head(self.final(h))
        return out


# --------------------------------------------------------------------------------------------
# Builders. Each comment gives the reasoning behind every expected number.
# --------------------------------------------------------------------------------------------


def _bert_inputs() -> Inputs:
    ids = _token_ids()
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return (ids,), {"attention_mask": mask, "use_cache": False}


def _t5_inputs() -> Inputs:
    ids = _token_ids()
    dec = _token_ids()
    return (ids,), {"decoder_input_ids": dec, "use_cache": False}


_GPT2: dict[str, Any] = {
    "vocab_size": VOCAB,
    "n_positions": 64,
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

# GPT-2 (transformers/models/gpt2/modeling_gpt2.py), 4 layers:
# - Norms: GPT2Block.__init__ L254 `self.ln_1 = nn.LayerNorm(...)`, L256 `self.ln_2 = ...`
#   (add_cross_attention is False, so no ln_cross_attn) -> 2 per block = 8; GPT2Model L496
#   `self.ln_f = nn.LayerNorm(...)` -> 1. Total 9 layernorm.
# - Roles: GPT2Block.forward L275-276 `residual = hidden_states; hidden_states = self.ln_1(...)`
#   feeds self.attn, and L306-307 `residual = hidden_states; hidden_states = self.ln_2(...)`
#   feeds self.mlp -> ln_1/ln_2 are `pre` (8). L619 `hidden_states = self.ln_f(hidden_states)`
#   runs after the loop over self.h (L607) -> `final` (1).
# - Residual adds: L285 `hidden_states = attn_output + residual` and L310
#   `hidden_states = residual + feed_forward_hidden_states` -> 2 per block, performed by
#   `transformer.h.N` with ordinals 0, 1 -> 8. (L577 `inputs_embeds + position_embeds` is a
#   position add; L62 `attn_weights + attention_mask` in eager is a mask add: neither counts.)
# - branch_out: the attention branch ends in GPT2Attention.forward L225
#   `attn_output = self.c_proj(attn_output)` (a Conv1D) then resid_dropout; the MLP branch ends in
#   GPT2MLP.forward L243 `hidden_states = self.c_proj(hidden_states)`.
# - Stack: GPT2Model L495 `self.h = nn.ModuleList([GPT2Block ...])` -> 4 blocks, all norms on the
#   branches are `pre` -> pre-ln. All 8 adds' branch_out layers are inside transformer.h.N.
# - Attention: GPT2Attention (L76) calls `attention_interface` (L213) = sdpa_attention_forward
#   (transformers/integrations/sdpa_attention.py L182 `scaled_dot_product_attention`) for "sdpa",
#   or eager_attention_forward (L55-64, `softmax`) for "eager" -> 1 per block = 4.
# - Head: GPT2LMHeadModel L642 `self.lm_head = nn.Linear(...)`, L698 `logits = self.lm_head(...)`.
_GPT2_EXPECTED = Expected(
    norms={"layernorm": 9},
    roles={"pre": 8, "final": 1},
    stacks={"transformer.h": (4, "pre-ln")},
    adds_per_stack={"transformer.h": 8},
    residual_adds=8,
    branch_out={
        "transformer.h.0#0": "transformer.h.0.attn.c_proj",
        "transformer.h.0#1": "transformer.h.0.mlp.c_proj",
        "transformer.h.3#1": "transformer.h.3.mlp.c_proj",
    },
    attention=4,
    head="lm_head",
)

_GEMMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "sliding_window": 8,
    "query_pre_attn_scalar": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_HF_CASES: dict[str, HFCase] = {
    # GPT-2: see the comment above _GPT2_EXPECTED; the same model with sdpa and eager attention
    "gpt2": HFCase(
        "GPT2Config",
        "GPT2LMHeadModel",
        {**_GPT2, "attn_implementation": "sdpa"},
        _GPT2_EXPECTED,
    ),
    "gpt2_eager": HFCase(
        "GPT2Config",
        "GPT2LMHeadModel",
        {**_GPT2, "attn_implementation": "eager"},
        _GPT2_EXPECTED,
    ),
    # Llama (transformers/models/llama/modeling_llama.py), 4 layers:
    # - Norms: LlamaRMSNorm (L53) computes `variance = hidden_states.pow(2).mean(-1, keepdim=True)`
    #   (L65, no mean subtraction) -> rmsnorm. LlamaDecoderLayer.__init__ L282 `input_layernorm`,
    #   L283 `post_attention_layernorm` -> 2 per layer = 8; LlamaModel L347 `self.norm` -> 1. Total
    #   9.
    # - Roles: LlamaDecoderLayer.forward: `residual = hidden_states; hidden_states =
    #   self.input_layernorm(hidden_states)` feeds self_attn; `residual = hidden_states;
    #   hidden_states = self.post_attention_layernorm(hidden_states)` feeds mlp. Despite its name
    #   post_attention_layernorm is a `pre` norm of the MLP branch -> 8 pre. L404
    #   `hidden_states = self.norm(hidden_states)` after the layer loop -> final (1).
    # - Residual adds: L308 and L314 `hidden_states = residual + hidden_states` -> 2 per layer = 8,
    #   performed by `model.layers.N`, ordinals 0 and 1. Rotary arithmetic in apply_rotary_pos_emb
    #   (`(q * cos) + (rotate_half(q) * sin)`) is not residual.
    # - branch_out: LlamaAttention.forward L270 `attn_output = self.o_proj(attn_output)`;
    #   LlamaMLP.forward L164 `down_proj = self.down_proj(...)`.
    # - Stack: LlamaModel L344 `self.layers = nn.ModuleList([LlamaDecoderLayer ...])` -> 4, pre-ln.
    # - Attention: LlamaAttention (L206) calls attention_interface (L258) -> 4.
    # - Head: LlamaForCausalLM L422 `self.lm_head = nn.Linear(...)`.
    "llama": HFCase(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        Expected(
            norms={"rmsnorm": 9},
            roles={"pre": 8, "final": 1},
            stacks={"model.layers": (4, "pre-ln")},
            adds_per_stack={"model.layers": 8},
            residual_adds=8,
            branch_out={
                "model.layers.0#0": "model.layers.0.self_attn.o_proj",
                "model.layers.0#1": "model.layers.0.mlp.down_proj",
                "model.layers.2#0": "model.layers.2.self_attn.o_proj",
            },
            attention=4,
            head="lm_head",
        ),
    ),
    # BERT (transformers/models/bert/modeling_bert.py), BertModel with 4 layers:
    # - Norms: BertEmbeddings L63 `self.LayerNorm`; BertSelfOutput L287 `self.LayerNorm`; BertOutput
    #   L346 `self.LayerNorm` -> 1 + 2 per layer = 9 layernorm. (BertPredictionHeadTransform's
    #   LayerNorm, L478, belongs to the MLM heads, which BertModel does not build.)
    # - Roles: BertEmbeddings.forward L102-107 sums word + token-type + position embeddings and
    #   normalizes them -> `other` (1). BertSelfOutput.forward L293
    #   `hidden_states = self.LayerNorm(hidden_states + input_tensor)` and BertOutput.forward L352
    #   (same line) normalize the residual sum, and that output is the stream -> `post` (8).
    # - Residual adds: the `hidden_states + input_tensor` at L293 (input_tensor is the attention
    #   block's input, passed at L323 `self.output(attention_output, hidden_states)`) and at L352
    #   (input_tensor = attention_output, passed at L418) -> 2 per layer = 8, performed by
    #   `encoder.layer.N.attention.output` and `encoder.layer.N.output`, ordinal 0 each. The
    #   embedding adds (L102, L105) are position/type embedding adds, not residual.
    # - branch_out: BertSelfOutput.dense (L291) and BertOutput.dense (L350), both the last Linear
    #   before the add.
    # - Stack: BertEncoder L426 `self.layer = nn.ModuleList([BertLayer ...])` -> 4, post-ln.
    # - Attention: BertSelfAttention (L140) calls attention_interface (L194) -> 4.
    # - Head: BertModel has no logits layer; BertPooler.dense (L458) produces `pooler_output`
    #   (tanh of the first token), not logits -> None.
    "bert": HFCase(
        "BertConfig",
        "BertModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
        Expected(
            norms={"layernorm": 9},
            roles={"post": 8, "other": 1},
            stacks={"encoder.layer": (4, "post-ln")},
            adds_per_stack={"encoder.layer": 8},
            residual_adds=8,
            branch_out={
                "encoder.layer.0.attention.output#0": "encoder.layer.0.attention.output.dense",
                "encoder.layer.0.output#0": "encoder.layer.0.output.dense",
                "encoder.layer.3.output#0": "encoder.layer.3.output.dense",
            },
            attention=4,
            head=None,
        ),
        inputs=_bert_inputs,
    ),
    # T5 (transformers/models/t5/modeling_t5.py), T5Model with 2 encoder + 2 decoder blocks:
    # - Norms: T5LayerNorm (L51) computes `variance = hidden_states.to(float32).pow(2).mean(-1)`
    #   (L66, no mean subtraction, no bias) -> rmsnorm. One `layer_norm` in each
    #   T5LayerSelfAttention (L383), T5LayerCrossAttention (L413) and T5LayerFF (L135); T5Block
    #   (L443-450) holds [SelfAttention, FF] in the encoder and [SelfAttention, CrossAttention, FF]
    #   in the decoder -> 2*2 + 2*3 = 10; each T5Stack has `final_layer_norm` (L654) -> 2.
    #   Total 12 rmsnorm.
    # - Roles: each sub-layer does `normed = self.layer_norm(hidden_states)` -> sublayer ->
    #   `hidden_states + self.dropout(...)` (L395-403, L426-435, L139-141) -> 10 pre. L745
    #   `hidden_states = self.final_layer_norm(hidden_states)` after the block loop (L728) -> final
    #   (2).
    # - Residual adds: L403 `attention_output = hidden_states + self.dropout(attention_output)`,
    #   L435 `layer_output = hidden_states + self.dropout(attention_output)`, L141
    #   `hidden_states = hidden_states + self.dropout(forwarded_states)` -> encoder 2 per block,
    #   decoder 3 per block -> 4 + 6 = 10, performed by `{encoder,decoder}.block.N.layer.M`, ordinal
    #   0 each. The position-bias and mask adds (L163, L166, or inside sdpa's mask) don't count.
    # - branch_out: T5Attention.forward L369 `attn_output = self.o(attn_output)` (SelfAttention.o,
    #   EncDecAttention.o); T5DenseActDense.forward L94 `hidden_states = self.wo(hidden_states)`.
    # - Stacks: T5Stack L651 `self.block = nn.ModuleList([T5Block ...])` -> encoder.block (2) and
    #   decoder.block (2), both pre-ln. `block.N.layer` is a ModuleList of DIFFERENT classes
    #   (T5LayerSelfAttention, [T5LayerCrossAttention,] T5LayerFF) -> not a stack. So adds belong to
    #   encoder.block (4) and decoder.block (6).
    # - Attention: T5Attention (L177) calls attention_interface (L356): encoder 2 self, decoder 2
    #   self + 2 cross -> 6.
    # - Head: T5Model has no lm_head (only T5ForConditionalGeneration does, L926) -> None.
    "t5": HFCase(
        "T5Config",
        "T5Model",
        {
            "vocab_size": VOCAB,
            "d_model": 64,
            "d_kv": 16,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 16,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
            "eos_token_id": 1,
        },
        Expected(
            norms={"rmsnorm": 12},
            roles={"pre": 10, "final": 2},
            stacks={"encoder.block": (2, "pre-ln"), "decoder.block": (2, "pre-ln")},
            adds_per_stack={"encoder.block": 4, "decoder.block": 6},
            residual_adds=10,
            branch_out={
                "encoder.block.0.layer.0#0": "encoder.block.0.layer.0.SelfAttention.o",
                "encoder.block.0.layer.1#0": "encoder.block.0.layer.1.DenseReluDense.wo",
                "decoder.block.0.layer.0#0": "decoder.block.0.layer.0.SelfAttention.o",
                "decoder.block.0.layer.1#0": "decoder.block.0.layer.1.EncDecAttention.o",
                "decoder.block.1.layer.2#0": "decoder.block.1.layer.2.DenseReluDense.wo",
            },
            attention=6,
            head=None,
        ),
        inputs=_t5_inputs,
    ),
    # Gemma 2 (transformers/models/gemma2/modeling_gemma2.py), 4 layers:
    # - Norms: Gemma2RMSNorm (L49) `x * rsqrt(x.pow(2).mean(-1) + eps)` then L62
    #   `output * (1.0 + self.weight.float())` -> rmsnorm with a 1+w gain. Gemma2DecoderLayer L291,
    #   L292, L294, L295: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    #   post_feedforward_layernorm -> 4 per layer = 16; Gemma2Model L385 `self.norm` -> 1. Total 17.
    # - Roles: forward: `residual = x; x = input_layernorm(x); x = self_attn(x); x =
    #   post_attention_layernorm(x)` (L320) `; x = residual + x` (L321), then `residual = x; x =
    #   pre_feedforward_layernorm(x); x = mlp(x); x = post_feedforward_layernorm(x)` (L326) `; x =
    #   residual + x` (L327). input/pre_feedforward -> pre (8); post_attention/post_feedforward
    #   normalize the branch output right before the add on a branch that also has a pre norm ->
    #   sandwich-post (8); L450 `self.norm` after the loop -> final (1).
    # - Residual adds: L321, L327 -> 2 per layer = 8, by `model.layers.N`, ordinals 0 and 1.
    #   Gemma2TextScaledWordEmbedding multiplies by sqrt(hidden) (not an add); logit soft-capping in
    #   Gemma2ForCausalLM divides/tanh/multiplies (no add).
    # - branch_out: Gemma2Attention.forward L280 `self.o_proj`, Gemma2MLP.forward L81
    #   `self.down_proj` (the sandwich-post norm sits between branch_out and the add).
    # - Stack: Gemma2Model L382 `self.layers = nn.ModuleList(...)` -> 4, sandwich.
    # - Attention: Gemma2Attention (L211) calls attention_interface (L266); L353 `_supports_sdpa =
    #   False`, so it resolves to eager_attention_forward (softmax L203) -> 4.
    # - Head: Gemma2ForCausalLM L469 `self.lm_head`.
    "gemma2": HFCase(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        _GEMMA,
        Expected(
            norms={"rmsnorm": 17},
            roles={"pre": 8, "sandwich-post": 8, "final": 1},
            stacks={"model.layers": (4, "sandwich")},
            adds_per_stack={"model.layers": 8},
            residual_adds=8,
            branch_out={
                "model.layers.0#0": "model.layers.0.self_attn.o_proj",
                "model.layers.0#1": "model.layers.0.mlp.down_proj",
                "model.layers.3#1": "model.layers.3.mlp.down_proj",
            },
            attention=4,
            head="lm_head",
        ),
    ),
    # Gemma 3 text (transformers/models/gemma3/modeling_gemma3.py), Gemma3ForCausalLM, 4 layers:
    # - Norms: Gemma3RMSNorm (L119), gain `output * (1.0 + self.weight.float())` (L132) -> rmsnorm.
    #   Gemma3DecoderLayer L367-370: input_layernorm, post_attention_layernorm,
    #   pre_feedforward_layernorm, post_feedforward_layernorm (4 per layer = 16); Gemma3Attention
    #   L310-311 `self.q_norm`, `self.k_norm` = Gemma3RMSNorm(head_dim) (2 per layer = 8);
    #   Gemma3TextModel L473 `self.norm` (1). Total 25 rmsnorm.
    # - Roles: the decoder layer is Gemma 2's sandwich (L384-401) -> pre 8, sandwich-post 8;
    #   L329-330 `query_states = self.q_norm(query_states); key_states = self.k_norm(key_states)`
    #   inside the attention module -> qk 8; L546 `self.norm` after the loop -> final 1.
    # - Residual adds: L395 and L401 `hidden_states = residual + hidden_states` -> 8.
    # - branch_out: Gemma3Attention L355 `self.o_proj`; Gemma3MLP L115 `self.down_proj`.
    # - Stack: Gemma3TextModel L470 `self.layers` (Gemma3ForCausalLM L564 `self.model =
    #   Gemma3TextModel(config)`) -> model.layers, 4, sandwich (with qk-norm).
    # - Attention: Gemma3Attention (L280) calls attention_interface (L342) -> 4.
    # - Head: Gemma3ForCausalLM L566 `self.lm_head`.
    "gemma3": HFCase(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _GEMMA,
        Expected(
            norms={"rmsnorm": 25},
            roles={"pre": 8, "sandwich-post": 8, "qk": 8, "final": 1},
            stacks={"model.layers": (4, "sandwich")},
            adds_per_stack={"model.layers": 8},
            residual_adds=8,
            branch_out={
                "model.layers.0#0": "model.layers.0.self_attn.o_proj",
                "model.layers.0#1": "model.layers.0.mlp.down_proj",
                "model.layers.1#0": "model.layers.1.self_attn.o_proj",
            },
            attention=4,
            head="lm_head",
        ),
    ),
}


# timm resnet18 (timm/models/resnet.py), num_classes=10, input 2x3x32x32:
# - resnet18 (L1530-1534): `block=BasicBlock, layers=(2, 2, 2, 2)`.
# - Norms (BatchNorm2d): stem L571 `self.bn1` (1); BasicBlock L114 `self.bn1`, L128 `self.bn2`
#   (2 per block x 8 = 16); downsample_conv (L289-318) = Sequential(Conv2d, BatchNorm2d), built
#   in make_blocks when `stride != 1 or inplanes != planes * expansion` (L413) and only for
#   block 0 (L429): layer1 keeps 64 channels at stride 1 -> none; layer2/3/4 -> 3. Total 20.
# - Roles: BasicBlock.forward L144-163: `shortcut = x; x = conv1(x); x = bn1(x); ... x = conv2(x);
#   x = bn2(x); ... x += shortcut` -> bn1/bn2 sit inside the branch, neither on the stream's input
#   nor after the add -> branch (16). Stem bn1 and the 3 downsample BNs (on the skip) -> other (4).
# - Residual adds: L163 `x += shortcut` once per block -> 8, performed by `layerK.N` ordinal 0;
#   the 3 in layer2.0/layer3.0/layer4.0 have `shortcut = self.downsample(shortcut)` (L162), a
#   single child module on the skip -> projection_adds 3.
# - branch_out: `x = self.conv2(x)` (L152) is the last weight layer before bn2 and the add.
# - Stacks: make_blocks L446 `nn.Sequential(*blocks)` added as layer1..layer4 (L616) -> 4 stacks
#   of 2 BasicBlocks, norms only inside branches -> in-branch; 2 adds each. layer1..4 are plain
#   attributes of ResNet, not children of one container, so there is no outer stack.
# - Attention: none. Head: `self.fc` (L621, create_classifier -> nn.Linear(512, 10)).
def build_resnet18() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    import timm

    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    exp = Expected(
        norms={"batchnorm": 20},
        roles={"branch": 16, "other": 4},
        stacks={f"layer{i}": (2, "in-branch") for i in range(1, 5)},
        adds_per_stack={f"layer{i}": 2 for i in range(1, 5)},
        residual_adds=8,
        branch_out={
            "layer1.0#0": "layer1.0.conv2",
            "layer2.0#0": "layer2.0.conv2",
            "layer4.1#0": "layer4.1.conv2",
        },
        attention=0,
        head="fc",
        projection_adds=3,
    )
    return model, (torch.randn(2, 3, 32, 32),), {}, exp


# timm VisionTransformer (timm/models/vision_transformer.py), img 32, patch 8, dim 64, depth 4,
# 4 heads, init_values=1e-5 (LayerScale), num_classes=10, default global_pool='token':
# - Norms: norm_layer defaults to timm LayerNorm (L840; an nn.LayerNorm subclass). Block L213
#   `self.norm1`, L231 `self.norm2` -> 8; qk_norm False so Attention.q_norm/k_norm are Identity
#   (timm/layers/attention.py L103); `use_fc_norm` is False for 'token' (L839), so L918
#   `self.norm = norm_layer(...)` exists and L941 fc_norm is Identity; pre_norm False -> norm_pre
#   Identity (L891). Total 9 layernorm.
# - Roles: Block.forward L250 `x = x + drop_path1(ls1(attn(norm1(x))))`, L251
#   `x = x + drop_path2(ls2(mlp(norm2(x))))` -> norm1/norm2 pre (8); forward_features L1302
#   `x = self.norm(x)` after `self.blocks(x)` -> final (1).
# - Residual adds: L250, L251 -> 2 per block = 8, by `blocks.N`, ordinals 0 and 1. `_pos_embed`'s
#   `x = x + pos_embed` (L1115/L1123) is a position add, not residual.
# - branch_out: Attention.forward attention.py L143 `x = self.proj(x)`; Mlp.fc2 (timm/layers/
#   mlp.py L52). LayerScale (ls1/ls2, `x * self.gamma`) follows them but is not a
#   Linear/Conv weight layer, so branch_out is attn.proj / mlp.fc2.
# - Stack: L894 `self.blocks = nn.Sequential(*[Block ...])` -> 4, pre-ln.
# - Attention: timm Attention with fused_attn calls F.scaled_dot_product_attention (attention.py
#   L124; otherwise softmax itself) -> 4.
# - Head: L943 `self.head = nn.Linear(embed_dim, num_classes)`.
def build_vit() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=4,
        num_heads=4,
        mlp_ratio=2.0,
        init_values=1e-5,
        num_classes=10,
    )
    exp = Expected(
        norms={"layernorm": 9},
        roles={"pre": 8, "final": 1},
        stacks={"blocks": (4, "pre-ln")},
        adds_per_stack={"blocks": 8},
        residual_adds=8,
        branch_out={
            "blocks.0#0": "blocks.0.attn.proj",
            "blocks.0#1": "blocks.0.mlp.fc2",
            "blocks.3#0": "blocks.3.attn.proj",
        },
        attention=4,
        head="head",
    )
    return model, (torch.randn(2, 3, 32, 32),), {}, exp


# timm convnext_atto (timm/models/convnext.py), num_classes=10, input 2x3x64x64:
# - convnext_atto (L1212-1216): depths (2, 2, 6, 2), dims (40, 80, 160, 320), conv_mlp=True, so
#   both norm_layer and norm_layer_cl resolve to LayerNorm2d (L329; timm/layers/norm.py L113,
#   an nn.LayerNorm over channels of NCHW) -> kind layernorm.
# - Norms: stem `Sequential(Conv2d(3, 40, 4, stride 4), LayerNorm2d)` (L414) -> 1. Stage 0 has
#   stride 1 (L437, `stride = 2 if curr_stride == 2 or i > 0 else 1`) and 40 == 40 channels ->
#   downsample Identity; stages 1-3 downsample = Sequential(LayerNorm2d, Conv2d) (L269) -> 3.
#   ConvNeXtBlock L189 `self.norm` -> 2+2+6+2 = 12. NormMlpClassifierHead (L481) `self.norm`
#   (timm/layers/classifier.py) -> 1. Total 17.
# - Roles: ConvNeXtBlock.forward L205-218: `shortcut = x; x = conv_dw(x); x = self.norm(x);
#   x = self.mlp(x); x = x.mul(gamma); x = drop_path(x) + shortcut(shortcut)` -> the block norm
#   follows conv_dw inside the branch -> branch (12). The head norm runs after stages.3 (pooled
#   features, NormMlpClassifierHead.forward: global_pool -> norm -> flatten -> fc) -> final (1).
#   The stem norm and the 3 stage-downsample norms (norm -> strided conv between stages, not on
#   any residual branch) -> other (4).
# - Residual adds: L218 `x = self.drop_path(x) + self.shortcut(shortcut)`, once per block -> 12,
#   by `stages.S.blocks.N` ordinal 0. `self.shortcut` is nn.Identity here (L200; in == out chs and
#   stride 1 in every block), which has no weights -> identity, not projection.
# - branch_out: Mlp(use_conv=True).fc2, a 1x1 Conv2d (timm/layers/mlp.py L44/L52); the gamma
#   LayerScale (L216) is a bare parameter multiply, not a weight layer.
# - Stacks: `stages` = Sequential(4 x ConvNeXtStage) (L464) and each `stages.S.blocks` =
#   Sequential(ConvNeXtBlock ...) (L304) with 2, 2, 6, 2 blocks. Every add's branch_out lies in
#   stages.S.blocks.N, so adds belong to the inner stacks; `stages` gets 0. All norms on the
#   residual paths are branch norms -> in-branch for all five stacks. (stem and
#   stages.S.downsample are Sequentials of different classes: not stacks.)
# - Attention: none. Head: `head.fc` = nn.Linear(320, 10) in NormMlpClassifierHead.
def build_convnext_atto() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    import timm

    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    depths = (2, 2, 6, 2)
    stacks: dict[str, tuple[int, str]] = {"stages": (4, "in-branch")}
    adds: dict[str, int] = {"stages": 0}
    for s, n in enumerate(depths):
        stacks[f"stages.{s}.blocks"] = (n, "in-branch")
        adds[f"stages.{s}.blocks"] = n
    exp = Expected(
        norms={"layernorm": 17},
        roles={"branch": 12, "other": 4, "final": 1},
        stacks=stacks,
        adds_per_stack=adds,
        residual_adds=12,
        branch_out={
            "stages.0.blocks.0#0": "stages.0.blocks.0.mlp.fc2",
            "stages.2.blocks.5#0": "stages.2.blocks.5.mlp.fc2",
            "stages.3.blocks.1#0": "stages.3.blocks.1.mlp.fc2",
        },
        attention=0,
        head="head.fc",
    )
    return model, (torch.randn(2, 3, 64, 64),), {}, exp


# ResidualStack(depth=48, width=64, pre_ln=True), input randn(16, 64):
# - Norms: `self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(48))` -> 48 layernorm.
# - Roles: `h = h + lin(ln(h))`: ln's input is the stream h, its output feeds the branch lin ->
#   pre (48). No norm after the loop (forward returns self.head(h)).
# - Residual adds: one per loop iteration, performed by the root module "" -> 48, ordinals 0..47,
#   branch_out `lins.i` (the only weight layer of the branch).
# - Stacks: `lns` (48 LayerNorms, ln_{i+1} reads h_{i+1}, which derives from ln_i's output) and
#   `lins` (48 Linears) are both stacks of 48. The adds belong to `lins`, the innermost stack
#   containing their branch_out; `lns` gets 0. Both pre-ln (lns from its norms' roles).
# - Attention: none. Head: `self.head` (the final Linear producing the output).
def build_stack_preln() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    model = ResidualStack(48, 64, pre_ln=True)
    exp = Expected(
        norms={"layernorm": 48},
        roles={"pre": 48},
        stacks={"lns": (48, "pre-ln"), "lins": (48, "pre-ln")},
        adds_per_stack={"lins": 48, "lns": 0},
        residual_adds=48,
        branch_out={"#0": "lins.0", "#1": "lins.1", "#47": "lins.47"},
        attention=0,
        head="head",
    )
    return model, (torch.randn(16, 64),), {}, exp


# ResidualStack(depth=48, width=64, pre_ln=False), input randn(16, 64):
# - `h = ln(h + lin(h))`: 48 adds by "" (ordinals 0..47, branch_out lins.i) and each ln's input
#   is the add's output while its output is the new stream -> post (48). lns.47 is still a block
#   of the `lns` stack (not outside it), so it is post, not final.
# - Stacks `lns` and `lins` of 48, both post-ln; adds belong to `lins`.
def build_stack_postln() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    model = ResidualStack(48, 64, pre_ln=False)
    exp = Expected(
        norms={"layernorm": 48},
        roles={"post": 48},
        stacks={"lns": (48, "post-ln"), "lins": (48, "post-ln")},
        adds_per_stack={"lins": 48, "lns": 0},
        residual_adds=48,
        branch_out={"#0": "lins.0", "#1": "lins.1", "#47": "lins.47"},
        attention=0,
        head="head",
    )
    return model, (torch.randn(16, 64),), {}, exp


# DeepNet: TinyLM with 4 DeepNormBlocks, d=64, 4 heads, no final norm, tokens (2, 16):
# - alpha = (2N)**0.25 with N = 4 layers = 8**0.25 ~= 1.682 (> 1); beta = (8N)**-0.25 for init.
# - Norms: DeepNormBlock.ln1/ln2 -> 8 layernorm. TinyLM.final is None.
# - Roles: `x = ln1(x * alpha + attn(x))`, `x = ln2(alpha * x + mlp(x))`: each LN normalizes an
#   add's output that becomes the stream -> post (8).
# - Residual adds: 2 per block, by `blocks.N`, ordinals 0, 1 (skip operand scaled by the python
#   float alpha) -> 8; the `tok(idx) + pos(...)` position add and TinyAttention's
#   `+ self.mask[:t, :t]` mask add don't count.
# - branch_out: TinyAttention.out and TinyMLP.fc2.
# - Stack: `blocks` (ModuleList of 4), post-LN with skip scale alpha > 1 -> deepnorm.
# - Attention: TinyAttention(eager=True) computes `scores.softmax(-1)` itself -> 4.
# - Head: TinyLM.head.
def build_deepnet() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    n = 4
    alpha, beta = deepnet_alpha(n), (8 * n) ** -0.25
    model = TinyLM([DeepNormBlock(64, 4, alpha, beta) for _ in range(n)], 64, final=None)
    exp = Expected(
        norms={"layernorm": 8},
        roles={"post": 8},
        stacks={"blocks": (4, "deepnorm")},
        adds_per_stack={"blocks": 8},
        residual_adds=8,
        branch_out={
            "blocks.0#0": "blocks.0.attn.out",
            "blocks.0#1": "blocks.0.mlp.fc2",
            "blocks.3#1": "blocks.3.mlp.fc2",
        },
        attention=4,
        head="head",
    )
    return model, (_token_ids(),), {}, exp


# no_norm: NoNormNet, input randn(8, 16):
# - No normalization modules anywhere -> norms {}, roles {}.
# - ResidualMLP(with_norm=False).forward `x + fc2(gelu(fc1(x)))` -> 1 add per block by
#   `blocks.N` ordinal 0 -> 4; branch_out blocks.N.fc2.
# - Stack: `blocks` (ModuleList of 4) -> no-norm. `inp` and `head` are single Linears.
# - Attention: none. Head: `head`.
def build_no_norm() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    model = NoNormNet()
    exp = Expected(
        norms={},
        roles={},
        stacks={"blocks": (4, "no-norm")},
        adds_per_stack={"blocks": 4},
        residual_adds=4,
        branch_out={"blocks.0#0": "blocks.0.fc2", "blocks.3#0": "blocks.3.fc2"},
        attention=0,
        head="head",
    )
    return model, (torch.randn(8, 16),), {}, exp


# control_flow: ControlFlowNet, input `torch.randn(8, 16).abs() + 0.1` (every entry > 0):
# - `steps = 1 + int((x > 0).all())` = 2, and `x.mean() > 0` is True -> this forward runs
#   inp, blocks.0-2, refine (twice: calls 0 and 1), if_pos, final, head. if_neg never runs.
#   torch.fx.symbolic_trace fails: `int(<Proxy>)` raises TypeError (and `if <Proxy>:` would
#   raise torch.fx.proxy.TraceError).
# - Norms: blocks.N.norm (ResidualMLP(with_norm=True)) x 3 + `final` -> 4 layernorm. refine,
#   if_pos, if_neg have no norm (so the unexecuted branch holds no norm whose role is undefined).
# - Roles: blocks.N.norm: `x + fc2(gelu(fc1(norm(x))))` -> pre (3). `final` runs outside any
#   stack block, after the last block of `blocks` (with refine/if_pos in between) and feeds head
#   -> final (1).
# - Residual adds: blocks 3 + refine 2 (module "refine", call 0 and call 1, ordinal 0 each) +
#   if_pos 1 = 6. Only the 3 in `blocks` belong to a stack; refine/if_pos belong to no stack.
# - Stacks: `blocks` (3, pre-ln). refine/if_pos/if_neg are attributes of one class, not a
#   container: refine runs twice in a chain (a repeated block: `refine`, 2) and hands its
#   stream to if_pos (a run of attributes of one class that ran in a chain, with adds:
#   `[refine..if_neg]`, 2, since if_neg never ran). Neither holds a norm -> no-norm.
# - Attention: none. Head: `head`.
def build_control_flow() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    model = ControlFlowNet()
    x = torch.randn(8, 16).abs() + 0.1
    exp = Expected(
        norms={"layernorm": 4},
        roles={"pre": 3, "final": 1},
        stacks={
            "blocks": (3, "pre-ln"),
            "refine": (2, "no-norm"),
            "[refine..if_neg]": (2, "no-norm"),
        },
        adds_per_stack={"blocks": 3},
        residual_adds=6,
        branch_out={
            "blocks.0#0": "blocks.0.fc2",
            "refine#0": "refine.fc2",
            "if_pos#0": "if_pos.fc2",
        },
        attention=0,
        head="head",
    )
    return model, (x,), {}, exp


# custom_rmsnorm: TinyLM with 4 PreNormBlocks using FeatureScaler (norm attributes `scaler1`,
# `scaler2`) and a FeatureScaler `final`, d=64, 4 heads, tokens (2, 16):
# - Norms: FeatureScaler computes `x * rsqrt(mean(x^2) + eps) * gain` (no mean subtraction, no
#   bias) -> rmsnorm, recognizable only by behaviour (neither class nor attribute says "norm").
#   2 per block x 4 + final = 9.
# - Roles: `x = x + attn(scaler1(x)); x = x + mlp(scaler2(x))` -> pre (8); `final` after the
#   block loop -> final (1).
# - Residual adds: 2 per block by `blocks.N` (ordinals 0, 1) -> 8; the embedding add is a position
#   add. branch_out: blocks.N.attn.out, blocks.N.mlp.fc2.
# - Stack: `blocks` (4, pre-ln). Attention: TinyAttention calls F.scaled_dot_product_attention
#   -> 4. Head: `head`.
def build_custom_rmsnorm() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    blocks: list[nn.Module] = [
        PreNormBlock(64, 4, FeatureScaler, norm_names=("scaler1", "scaler2")) for _ in range(4)
    ]
    model = TinyLM(blocks, 64, final=FeatureScaler(64))
    exp = Expected(
        norms={"rmsnorm": 9},
        roles={"pre": 8, "final": 1},
        stacks={"blocks": (4, "pre-ln")},
        adds_per_stack={"blocks": 8},
        residual_adds=8,
        branch_out={
            "blocks.0#0": "blocks.0.attn.out",
            "blocks.0#1": "blocks.0.mlp.fc2",
            "blocks.3#0": "blocks.3.attn.out",
        },
        attention=4,
        head="head",
    )
    return model, (_token_ids(),), {}, exp


# qknorm: TinyLM with 2 PreNormBlocks(nn.LayerNorm, qk_norm=True) and a LayerNorm `final`,
# d=64, 4 heads (head_dim 16), tokens (2, 16):
# - Norms: per block norm1, norm2 and attn.q_norm, attn.k_norm (nn.LayerNorm(16)) -> 4 x 2 = 8,
#   plus `final` -> 9 layernorm.
# - Roles: norm1/norm2 pre (4); TinyAttention.forward `q, k = self.q_norm(q), self.k_norm(k)`
#   before F.scaled_dot_product_attention -> qk (4); final (1).
# - Residual adds: 2 per block by `blocks.N` -> 4. branch_out blocks.N.attn.out / mlp.fc2.
# - Stack: `blocks` (2, pre-ln, with qk-norm). Attention: 2 (sdpa). Head: `head`.
def build_qknorm() -> tuple[nn.Module, tuple[object, ...], dict[str, object], Expected]:
    blocks: list[nn.Module] = [PreNormBlock(64, 4, nn.LayerNorm, qk_norm=True) for _ in range(2)]
    model = TinyLM(blocks, 64, final=nn.LayerNorm(64))
    exp = Expected(
        norms={"layernorm": 9},
        roles={"pre": 4, "qk": 4, "final": 1},
        stacks={"blocks": (2, "pre-ln")},
        adds_per_stack={"blocks": 4},
        residual_adds=4,
        branch_out={
            "blocks.0#0": "blocks.0.attn.out",
            "blocks.0#1": "blocks.0.mlp.fc2",
            "blocks.1#1": "blocks.1.mlp.fc2",
        },
        attention=2,
        head="head",
    )
    return model, (_token_ids(),), {}, exp


def deepnet_alpha(n_layers: int = 4) -> float:
    """DeepNet's skip scale for an encoder-only stack of ``n_layers``: ``(2N)**0.25``."""
    return math.pow(2 * n_layers, 0.25)


_Builder = Callable[[], Built]

_BUILDERS: dict[str, _Builder] = {
    **{name: functools.partial(build_hf, case) for name, case in _HF_CASES.items()},
    "resnet18": build_resnet18,
    "vit": build_vit,
    "convnext_atto": build_convnext_atto,
    "stack_preln": build_stack_preln,
    "stack_postln": build_stack_postln,
    "deepnet": build_deepnet,
    "no_norm": build_no_norm,
    "control_flow": build_control_flow,
    "custom_rmsnorm": build_custom_rmsnorm,
    "qknorm": build_qknorm,
}

NAMES: list[str] = list(_BUILDERS)

# Models whose forward cannot be captured by torch.fx.symbolic_trace by design.
UNTRACEABLE: frozenset[str] = frozenset({"control_flow"})


def build(name: str) -> ZooModel:
    """Build the zoo model ``name`` (seeded, in eval mode) with its inputs and expectations."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown zoo model {name!r}; known: {NAMES}")
    torch.manual_seed(0)
    model, args, kwargs, expected = _BUILDERS[name]()
    model.eval()
    return ZooModel(name=name, model=model, args=args, kwargs=kwargs, expected=expected)
