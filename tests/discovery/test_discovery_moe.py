"""Mixture-of-experts layers of transformers 5.24 in the configurations a model zoo varies: shared
expert on or off (gated by a sigmoid or not), ``norm_topk_prob``, sparse steps and dense first
layers, top-1 and top-2, interleaved MoE, attention/Mamba/MoE hybrids, and every experts
implementation transformers offers (``grouped_mm``, the default, ``batched_mm``, ``eager``).

Each model is tiny, with random weights (``torch.manual_seed(0)``). Expected per layer: two
residual adds; writers = the attention's (or Mamba mixer's) output projection, then the MLP's down
projection, or every routed expert's down projection (a fused experts module's 3-D ``down_proj``
parameter, named by ``writer_params``) plus the shared expert's; routers and shared-expert gates
are gates, never writers. ``reinit(model, "gpt2")`` then gives every writer parameter std
0.02/sqrt(2N) and leaves routers at 0.02.

Line numbers refer to ``site-packages/transformers/models/<model>/modeling_<model>.py`` of
transformers 5.24.0.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import normprobe

VOCAB, WIDTH, TOKENS = 128, 64, 16
GPT2_STD = 0.02


@dataclass(frozen=True)
class Case:
    """A model and what its map must say: by layer, the parameters each of its two adds writes
    through (``writes[i] = (attention or mixer, mlp)``), the gates of its MoE add and the
    routers' weights (std 0.02 after ``reinit``)."""

    config: str
    model: str
    options: dict[str, Any]
    writes: list[tuple[tuple[str, ...], tuple[str, ...]]]
    gates: dict[int, tuple[str, ...]] = field(default_factory=dict)
    routers: tuple[str, ...] = ()
    layers: str = "model.layers"

    def build(self) -> nn.Module:
        common = {
            "vocab_size": VOCAB,
            "hidden_size": WIDTH,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = getattr(transformers, self.config)(**{**common, **self.options})
            return getattr(transformers, self.model)(config).eval()  # type: ignore[no-any-return]


def _dense(i: int, attn: str = "self_attn.o_proj.weight", mlp: str = "mlp") -> tuple[Any, ...]:
    """Writes of a layer with a dense MLP: its attention's output projection, its down_proj."""
    return ((f"model.layers.{i}.{attn}",), (f"model.layers.{i}.{mlp}.down_proj.weight",))


def _routed(i: int, *shared: str, mlp: str = "mlp", attn: str = "self_attn.o_proj") -> Any:
    """Writes of a layer whose MLP is fused routed experts (their 3-D ``down_proj``) plus the
    given shared-expert parameters."""
    p = f"model.layers.{i}"
    return (
        (f"{p}.{attn}.weight",),
        (f"{p}.{mlp}.experts.down_proj", *(f"{p}.{s}" for s in shared)),
    )


CASES: dict[str, Case] = {
    # Qwen2-MoE: L358-359 a layer is sparse when not in mlp_only_layers and (i + 1) %
    # decoder_sparse_step == 0: with step 2 and mlp_only_layers [3], layer 1 only. L343 shared
    # expert, L345 routed experts (L304 `linear(x, self.down_proj[expert_idx])`), L347 the shared
    # expert gated by `sigmoid(self.shared_expert_gate(x))`, L349 summed; adds L391, L397.
    "qwen2_moe_sparse_step": Case(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            num_hidden_layers=4,
        ),
        [_dense(0), _routed(1, "mlp.shared_expert.down_proj.weight"), _dense(2), _dense(3)],
        gates={1: ("model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate")},
        routers=("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"),
    ),
    # Qwen3-MoE: L264 norm_topk_prob renormalizes the top-k weights; L281 experts (L243); adds
    # L343, L349. Top-2, normalized, the default grouped_mm experts.
    "qwen3_moe_top2_norm": Case(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=2,
            head_dim=16,
        ),
        [_routed(0), _routed(1)],
        gates={0: ("model.layers.0.mlp.gate",)},
        routers=("model.layers.0.mlp.gate.weight",),
    ),
    # the same, top-1, weights not renormalized, batched_mm experts (an expert weight picked per
    # token by a computed index: `self.down_proj[expert_ids]`, integrations/moe.py L162)
    "qwen3_moe_top1_batched": Case(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=1,
            norm_topk_prob=False,
            num_hidden_layers=2,
            head_dim=16,
            experts_implementation="batched_mm",
        ),
        [_routed(0), _routed(1)],
        gates={1: ("model.layers.1.mlp.gate",)},
        routers=("model.layers.1.mlp.gate.weight",),
    ),
    # OLMoE: L349 experts (L311), adds L387, L393.
    "olmoe": Case(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
        [_routed(0), _routed(1)],
        gates={0: ("model.layers.0.mlp.gate",)},
        routers=("model.layers.0.mlp.gate.weight",),
    ),
    # Mixtral top-1, the per-expert loop: L128 experts (L89), adds L362, L366.
    "mixtral_top1_eager": Case(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            num_hidden_layers=2,
            experts_implementation="eager",
        ),
        [_routed(0), _routed(1)],
        gates={0: ("model.layers.0.mlp.gate",)},
        routers=("model.layers.0.mlp.gate.weight",),
    ),
    # PhiMoE: L515 experts (L333) routed by `mlp.router`; adds L554, L558.
    "phimoe": Case(
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
        [_routed(0, mlp="mlp"), _routed(1)],
        gates={0: ("model.layers.0.mlp.router",)},
        routers=("model.layers.0.mlp.router.weight",),
    ),
    # GraniteMoeShared: L382 `moe_hidden_states + self.shared_mlp(hidden_states)`, an ungated
    # shared MLP (its last layer `output_linear`) beside the routed experts (L192, L172); adds
    # L373, L383 (times residual_multiplier).
    "granitemoeshared": Case(
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(
            intermediate_size=32,
            shared_intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
        ),
        [_routed(i, "shared_mlp.output_linear.weight", mlp="block_sparse_moe") for i in range(2)],
        gates={0: ("model.layers.0.block_sparse_moe.router",)},
        routers=("model.layers.0.block_sparse_moe.router.weight",),
    ),
    # DeepSeek-V2: L428 a dense MLP below first_k_dense_replace, MoE above; L135 routed experts
    # (L79), L136 `+ self.shared_experts(residuals)` (2 shared experts as one MLP, ungated);
    # group-limited greedy top-k; eager attention whose keys are written into a `new_empty`
    # tensor through slices; adds L456, L462.
    "deepseek_v2_dense_first": Case(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_shared_experts=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
            attn_implementation="eager",
        ),
        [_dense(0)] + [_routed(i, "mlp.shared_experts.down_proj.weight") for i in (1, 2)],
        gates={1: ("model.layers.1.mlp.gate",)},
        routers=("model.layers.1.mlp.gate.weight",),
    ),
    # Jamba: layer i is attention when i % attn_layer_period == attn_layer_offset (else a Mamba
    # mixer, whose last layer is L497 `out_proj`), MoE when i % expert_layer_period ==
    # expert_layer_offset (L727 experts, L676), else a dense MLP; adds L763, L767 (attention
    # layers) and L797, L801 (Mamba layers).
    "jamba_hybrid": Case(
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
        [
            _dense(i, "mamba.out_proj.weight", "feed_forward")
            if i % 2 == 0
            else _routed(i, mlp="feed_forward")
            for i in range(4)
        ],
        gates={1: ("model.layers.1.feed_forward.router",)},
        routers=("model.layers.1.feed_forward.router.weight",),
    ),
    # GPT-OSS: eager attention only, with a learned sink logit joined to the logits (L244) before
    # the softmax; experts with biases (L110), routed by `mlp.router`; adds L363, L369.
    "gpt_oss": Case(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=8,
            attn_implementation="eager",
        ),
        [_routed(0), _routed(1)],
        gates={0: ("model.layers.0.mlp.router",)},
        routers=("model.layers.0.mlp.router.weight",),
    ),
    # HunYuan-MoE: L295 a shared MLP, L298 routed experts (L278), summed ungated; adds L337, L343.
    "hunyuan_moe": Case(
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(intermediate_size=32, num_experts=4, moe_topk=2, num_hidden_layers=2, head_dim=16),
        [_routed(i, "mlp.shared_mlp.down_proj.weight") for i in range(2)],
        gates={0: ("model.layers.0.mlp.gate.wg",)},
        routers=("model.layers.0.mlp.gate.wg.weight",),
    ),
    # Llama 4 text: L400-404 MoE on the layers of `moe_layers` (every second one with
    # interleave_moe_layer_step=2: 1 and 3), dense MLPs elsewhere; L170 the router's sigmoid
    # scores (L151) scale the experts' input: a gate; L171 experts, L172-173 the shared expert's
    # output plus theirs; adds L433, L441.
    "llama4_interleaved": Case(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            intermediate_size=32,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            num_hidden_layers=4,
            interleave_moe_layer_step=2,
            head_dim=16,
        ),
        [
            _dense(i, mlp="feed_forward")
            if i % 2 == 0
            else _routed(i, "feed_forward.shared_expert.down_proj.weight", mlp="feed_forward")
            for i in range(4)
        ],
        gates={3: ("model.layers.3.feed_forward.router",)},
        routers=("model.layers.1.feed_forward.router.weight",),
    ),
}


def _dbrx() -> Case:
    """DBRX: L388 the attention's add inside `norm_attn_norm`, the FFN's add in the block; the
    experts' L256 `w2` is one 2-D parameter (experts x ffn, width), viewed per expert (L302)."""
    b = "transformer.blocks"
    return Case(
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            d_model=WIDTH,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        ),
        [
            ((f"{b}.{i}.norm_attn_norm.attn.out_proj.weight",), (f"{b}.{i}.ffn.experts.mlp.w2",))
            for i in range(2)
        ],
        gates={0: (f"{b}.0.ffn.router.layer",)},
        routers=(f"{b}.0.ffn.router.layer.weight",),
        layers=b,
    )


CASES["dbrx"] = _dbrx()


def _discover(name: str) -> tuple[nn.Module, normprobe.ModelMap, torch.Tensor]:
    model = CASES[name].build()
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, TOKENS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, normprobe.discover(model, ids, use_cache=False), ids


def _parents(params: tuple[str, ...]) -> set[str]:
    return {p.rpartition(".")[0] for p in params}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_map_writers_gates_and_adds(name: str) -> None:
    case = CASES[name]
    _, m, _ = _discover(name)
    depth = len(case.writes)
    # a shared expert beside routed ones is no parallel block: every stack is Pre-LN
    assert [(s.path, s.depth, s.placement) for s in m.stacks] == [(case.layers, depth, "pre-ln")]
    assert len(m.residual_adds) == 2 * depth, [f"{a.module}#{a.ordinal}" for a in m.residual_adds]
    assert [a.kind for a in m.residual_adds] == ["identity"] * 2 * depth
    for i, writes in enumerate(case.writes):
        adds = [a for a in m.residual_adds if a.block == i]
        assert [set(a.writer_params) for a in adds] == [set(w) for w in writes], f"layer {i}"
        assert [set(a.writers) for a in adds] == [_parents(w) for w in writes], f"layer {i}"
        want_gates = set(case.gates.get(i, ()))
        assert want_gates <= set(adds[1].gates), f"layer {i}: gates {adds[1].gates}"
        for a in adds:  # a router or gate never writes
            assert not {r.rpartition(".")[0] for r in case.routers} & set(a.writers)
    assert len(m.attention) == sum(1 for w in case.writes if "attn" in w[0][0])


def _tolerance(numel: int) -> float:
    """Relative error allowed on the std of ``numel`` normal samples."""
    return max(0.05, 4 / math.sqrt(2 * numel))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_gpt2_reinit_scales_every_expert_and_leaves_routers(name: str) -> None:
    case = CASES[name]
    model, _, ids = _discover(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        normprobe.reinit(model, "gpt2", example_inputs=(ids,), example_kwargs={"use_cache": False})
    n = len(case.writes)
    want = {p: GPT2_STD / math.sqrt(2 * n) for w in case.writes for side in w for p in side}
    want |= dict.fromkeys(case.routers, GPT2_STD)
    params = dict(model.named_parameters())
    wrong = []
    for param, std in want.items():
        p = params[param].detach().float()
        got = float(p.std())
        if abs(got - std) > _tolerance(p.numel()) * std:
            wrong.append(f"{param}: std {got:.5f}, want {std:.5f}")
    assert not wrong, "; ".join(wrong)


def test_experts_no_token_reached_are_writers_too() -> None:
    """Switch Transformers (switch_transformers/modeling_switch_transformers.py): L161-166 a
    ModuleDict of 8 experts, L175-178 only the experts some token was routed to run (top-1).
    Three tokens reach at most three: the others' ``wo`` write into the stream all the same."""
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=8,
        expert_capacity=64,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
    ids = torch.randint(3, VOCAB, (1, 3))
    kwargs = {"input_ids": ids, "decoder_input_ids": ids[:, :2]}
    m = normprobe.discover(model, **kwargs)
    for layer in ("encoder.block.1.layer.1", "decoder.block.1.layer.2"):
        experts = [f"{layer}.mlp.experts.expert_{e}.wo" for e in range(8)]
        [add] = [a for a in m.residual_adds if a.module == layer]
        assert set(add.writers) == set(experts)
        assert set(add.writer_params) == {f"{e}.weight" for e in experts}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        normprobe.reinit(model, "gpt2", example_kwargs=kwargs)
    for e in range(8):
        w = model.get_parameter(f"encoder.block.1.layer.1.mlp.experts.expert_{e}.wo.weight")
        assert float(w.detach().std()) == pytest.approx(GPT2_STD / math.sqrt(2 * 2), rel=0.08)


def test_gpt_oss_attention_logits_are_read_before_the_sink_joins_them(tmp_path: Path) -> None:
    """GPT-OSS's eager attention (gpt_oss/modeling_gpt_oss.py L239-250): q·kᵀ·scaling, the mask
    added, a learned sink logit per head joined (L244), the row's max subtracted, a softmax. It
    is attention, and ``attn_logit_max`` is max |q·kᵀ|·scaling (queries and keys as L297-302
    form them), neither the sink nor the mask."""
    from transformers.models.gpt_oss import modeling_gpt_oss as source

    model, m, ids = _discover("gpt_oss")
    assert [a.impl for a in m.attention] == ["eager", "eager"]
    want: dict[str, float] = {}

    def grab(path: str) -> Any:
        def hook(a: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            shape = (*h.shape[:-1], -1, a.head_dim)
            q = a.q_proj(h).view(shape).transpose(1, 2)
            k = a.k_proj(h).view(shape).transpose(1, 2)
            q, k = source.apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
            k = source.repeat_kv(k, a.num_key_value_groups)
            want[path] = float((q @ k.transpose(2, 3) * a.scaling).abs().max())

        return hook

    for a in m.attention:
        model.get_submodule(a.path).register_forward_pre_hook(grab(a.path), with_kwargs=True)
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["attn_logits"]) as probe:
        with torch.no_grad():
            model(ids, use_cache=False)
        probe.step()
        assert probe.latest is not None
        got = {p: probe.latest.scalars[probe.tag("attn_logit_max", p)] for p in want}
    assert len(got) == 2
    assert got == pytest.approx(want, rel=1e-5)
