"""More Hugging Face architectures for discovery tests, with ground truth derived from their source.

Every case (a row of ``CASES``, which ``zoo.build_hf`` builds; Segformer has a builder of its own)
makes a tiny model from a config (random weights, no downloads; the caller runs
``torch.manual_seed(0)`` and ``model.eval()``) and returns it with example inputs and an
``Expected`` (see ``zoo.py`` for its conventions). The expectations follow the rules of a
correct map (residual adds with every writer, parallel blocks as one add with two writers, fused
3-D experts as one writer, routers and gates never writers, repeated stacks, roles from the data
flow), not what discovery printed when they were written.

Line numbers refer to transformers 5.24.0 under ``site-packages/transformers``; the comment above
each case gives the reasoning behind every expected number. Conventions beyond ``zoo.py``:

* ``writers`` is given for at least every add of block 0 of each stack (and for a block whose
  branch differs from block 0's, such as DeepSeek-V3's first MoE layer). ``branch_out`` follows
  from them (``Expected``): the single writer, or None when an add has several.
* A fused experts module (one 3-D ``down_proj`` parameter applied as ``F.linear(x, W[e])``) is one
  writer, named by the module; ``writer_params`` (not part of ``Expected``) would name
  ``<experts>.down_proj``. MoE models are built with ``experts_implementation="eager"``, the
  per-expert loop the source shows: the default ``grouped_mm`` (chosen on CPU too) applies the
  whole 3-D parameter in one grouped matmul and takes about 1.4 s per forward on CPU.
* ``HOOK_DEPENDENT`` names models whose forward reads outputs that their own forward hooks
  collect; their builders run one forward first, so the hooks are installed as on any model
  that has been used.
* Attention is counted per module, not per call (ALBERT's one shared attention module counts 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zoo import Built, Expected, HFCase, Inputs, build_hf

__all__ = ["BUILDERS", "HOOK_DEPENDENT", "wav2vec2_config"]

VOCAB = 128
SEQ = 16
BATCH = 2


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _config(cls: Callable[..., Any], **kwargs: Any) -> Any:
    """``cls(**kwargs)``: transformers 5 configs take ``attn_implementation`` and the generic
    ``PreTrainedConfig`` keywords (``num_labels``, ...) through ``**kwargs``, which their typed
    signatures do not list."""
    return cls(**kwargs)


def _lm_ids() -> dict[str, Any]:
    return {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def wav2vec2_config(layers: int, layerdrop: float) -> Any:
    """A tiny wav2vec2 (width 32, two conv layers taking audio of about 1,000 samples down by
    10, a weight-normed positional conv) whose training forwards skip each of its ``layers``
    transformer layers with probability ``layerdrop``."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        layerdrop=layerdrop,
    )


def _ids_only() -> Inputs:
    return (_ids(),), {}


def _image() -> Inputs:
    return (torch.randn(BATCH, 3, 32, 32),), {}


def _bart_inputs() -> Inputs:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    dec = torch.randint(3, VOCAB, (BATCH, SEQ))
    return (ids,), {"decoder_input_ids": dec, "use_cache": False}


CASES: dict[str, HFCase] = {
    # --------------------------------------------------------------------------------------------
    # Parallel blocks: x + attn(ln(x)) + mlp(ln(x)) is ONE residual add with two writers.
    # --------------------------------------------------------------------------------------------
    # GPT-J (models/gptj/modeling_gptj.py), GPTJForCausalLM, 2 layers:
    # - Norms: GPTJBlock L213 `self.ln_1 = nn.LayerNorm(...)` (the block's only norm) -> 2;
    #   GPTJModel L276 `self.ln_f` -> 1. Total 3 layernorm.
    # - Roles: GPTJBlock.forward L227-228 `residual = hidden_states; hidden_states = self.ln_1(...)`
    #   feeds both self.attn and self.mlp -> pre (2). L354 `self.ln_f` after the layer loop ->
    #   final.
    # - Residual adds: L239 `return attn_output + feed_forward_hidden_states + residual`: two torch
    #   adds, but one residual add (a parallel block) by `transformer.h.N`, ordinal 0 -> 2 in all.
    # - Writers: GPTJAttention.forward L184 `attn_output = self.out_proj(attn_output)` and GPTJMLP
    #   L204 `hidden_states = self.fc_out(hidden_states)`, attention first -> branch_out None.
    # - Stack: GPTJModel L275 `self.h = nn.ModuleList(...)` -> 2, placement parallel (norms pre-ln).
    # - Attention: GPTJAttention calls attention_interface (L172) -> 2. Head: L375 `self.lm_head`.
    "gptj": HFCase(
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="sdpa",
        ),
        Expected(
            norms={"layernorm": 3},
            roles={"pre": 2, "final": 1},
            stacks={"transformer.h": (2, "parallel")},
            adds_per_stack={"transformer.h": 2},
            residual_adds=2,
            attention=2,
            head="lm_head",
            writers={
                "transformer.h.0#0": (
                    "transformer.h.0.attn.out_proj",
                    "transformer.h.0.mlp.fc_out",
                ),
                "transformer.h.1#0": (
                    "transformer.h.1.attn.out_proj",
                    "transformer.h.1.mlp.fc_out",
                ),
            },
        ),
    ),
    # GPT-NeoX (models/gpt_neox/modeling_gpt_neox.py), GPTNeoXForCausalLM,
    # use_parallel_residual=True, 2 layers:
    # - Norms: GPTNeoXLayer L232 `self.input_layernorm`, L233 `self.post_attention_layernorm`
    #   (nn.LayerNorm) -> 4; GPTNeoXModel L301 `self.final_layer_norm` -> 1. Total 5 layernorm.
    # - Roles: L250 `self.attention(self.input_layernorm(hidden_states), ...)` and L261
    #   `self.mlp(self.post_attention_layernorm(hidden_states))` both read the block input -> pre
    #   (4); L357 `self.final_layer_norm` after the loop -> final (1).
    # - Residual adds: L263 `hidden_states = mlp_output + attn_output + hidden_states` -> one add
    #   with two branches per layer, by `gpt_neox.layers.N` ordinal 0 -> 2.
    # - Writers: GPTNeoXAttention L223 `attn_output = self.dense(attn_output)` (runs first), then
    #   GPTNeoXMLP L48 `self.dense_4h_to_h` -> branch_out None.
    # - Stack: GPTNeoXModel L300 `self.layers` -> 2, parallel (pre-ln norms).
    # - Attention: attention_interface (L210) -> 2. Head: GPTNeoXForCausalLM L385 `self.lm_head`.
    "gpt_neox": HFCase(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            use_parallel_residual=True,
            attn_implementation="sdpa",
            **_lm_ids(),
        ),
        Expected(
            norms={"layernorm": 5},
            roles={"pre": 4, "final": 1},
            stacks={"gpt_neox.layers": (2, "parallel")},
            adds_per_stack={"gpt_neox.layers": 2},
            residual_adds=2,
            attention=2,
            head="lm_head",
            writers={
                "gpt_neox.layers.0#0": (
                    "gpt_neox.layers.0.attention.dense",
                    "gpt_neox.layers.0.mlp.dense_4h_to_h",
                ),
                "gpt_neox.layers.1#0": (
                    "gpt_neox.layers.1.attention.dense",
                    "gpt_neox.layers.1.mlp.dense_4h_to_h",
                ),
            },
        ),
    ),
    # Phi (models/phi/modeling_phi.py), PhiForCausalLM, qk_layernorm=True, 2 layers:
    # - Norms: PhiDecoderLayer L258 `self.input_layernorm` -> 2; PhiAttention L171/L174
    #   `self.q_layernorm`, `self.k_layernorm` = nn.LayerNorm(head_dim) -> 4; PhiModel L325
    #   `self.final_layernorm` -> 1. Total 7 layernorm.
    # - Roles: L274 `hidden_states = self.input_layernorm(hidden_states)` feeds self_attn (L276) and
    #   mlp (L287) -> pre (2); L195-196 `query_states = self.q_layernorm(query_states)` ... -> qk
    #   (4); L381 final_layernorm after the loop -> final (1).
    # - Residual adds: L288 `hidden_states = attn_outputs + feed_forward_hidden_states + residual`
    #   -> one parallel add per layer, by `model.layers.N` ordinal 0 -> 2.
    # - Writers: PhiAttention L234 `attn_output = self.dense(attn_output)`, PhiMLP L249
    #   `self.fc2` -> branch_out None. (resid_dropout sits between each writer and the add.)
    # - Stack: PhiModel L319 `self.layers` -> 2, parallel (pre-ln, with qk-norm).
    # - Attention: attention_interface (L222) -> 2. Head: L400 `self.lm_head` (with bias).
    "phi": HFCase(
        "PhiConfig",
        "PhiForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            qk_layernorm=True,
            attn_implementation="sdpa",
            **_lm_ids(),
        ),
        Expected(
            norms={"layernorm": 7},
            roles={"pre": 2, "qk": 4, "final": 1},
            stacks={"model.layers": (2, "parallel")},
            adds_per_stack={"model.layers": 2},
            residual_adds=2,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.dense", "model.layers.0.mlp.fc2"),
                "model.layers.1#0": ("model.layers.1.self_attn.dense", "model.layers.1.mlp.fc2"),
            },
        ),
    ),
    # Falcon (models/falcon/modeling_falcon.py), FalconForCausalLM, new_decoder_architecture=True
    # (so num_ln_in_parallel_attn = 2, L552-553), alibi=False, bias=False, 2 layers:
    # - Every projection is a FalconLinear (L60): `hidden_states = input @ self.weight.T` (L62), an
    #   nn.Linear subclass whose weight enters a matmul through a transpose: a weight layer by use.
    # - Norms: FalconDecoderLayer L561 `self.ln_attn`, L563 `self.ln_mlp` (torch LayerNorm) -> 4;
    #   FalconModel L672 `self.ln_f` -> 1. Total 5 layernorm.
    # - Roles: L582-583 `attention_layernorm_out = self.ln_attn(hidden_states); mlp_layernorm_out =
    #   self.ln_mlp(hidden_states)` feed self_attention (L588) and mlp (L616) -> pre (4); ln_f
    #   final.
    # - Residual adds: L619 `mlp_output += attention_output` (in place: joins the two branches) then
    #   L621 `dropout_add(mlp_output, residual, ...)` = L196 `out = residual + out` -> one residual
    #   add per layer, performed inside `transformer.h.N` (dropout_add is a plain function), ordinal
    #   0.
    # - Writers: FalconAttention L360 `attn_output = self.dense(attn_output)` (attention runs
    #   first), FalconMLP L527 `x = self.dense_4h_to_h(x)` -> branch_out None.
    # - Stack: FalconModel L669 `self.h` -> 2, parallel (pre-ln).
    # - Attention: with alibi None and sdpa, FalconAttention L339 calls
    #   `scaled_dot_product_attention` itself -> 2. Head: FalconForCausalLM `self.lm_head`.
    "falcon": HFCase(
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            parallel_attn=True,
            alibi=False,
            bias=False,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            bos_token_id=1,
            eos_token_id=2,
        ),
        Expected(
            norms={"layernorm": 5},
            roles={"pre": 4, "final": 1},
            stacks={"transformer.h": (2, "parallel")},
            adds_per_stack={"transformer.h": 2},
            residual_adds=2,
            attention=2,
            head="lm_head",
            writers={
                "transformer.h.0#0": (
                    "transformer.h.0.self_attention.dense",
                    "transformer.h.0.mlp.dense_4h_to_h",
                ),
                "transformer.h.1#0": (
                    "transformer.h.1.self_attention.dense",
                    "transformer.h.1.mlp.dense_4h_to_h",
                ),
            },
        ),
    ),
    # Cohere (models/cohere/modeling_cohere.py), CohereForCausalLM, use_qk_norm=True, 2 layers:
    # - Norms: CohereLayerNorm (L51) subtracts the mean (L61-63) and has a weight, no bias ->
    #   layernorm. CohereDecoderLayer L294 `self.input_layernorm` -> 2; CohereAttention L231/L234
    #   `self.q_norm`/`self.k_norm` = CohereLayerNorm((heads, head_dim)): weight shape (4, 16) / (2,
    #   16), statistics over head_dim -> 4; CohereModel L371 `self.norm` -> 1. Total 7 layernorm.
    #   The (heads, head_dim) gain multiplies elementwise (L64): not a weight layer.
    # - Roles: L324-325 `residual = hidden_states; hidden_states = self.input_layernorm(...)` feeds
    #   attention and MLP -> pre (2); L254-256 q_norm/k_norm on queries/keys -> qk (4); final (1).
    # - Residual adds: L338 `hidden_states = residual + hidden_states_attention +
    #   hidden_states_mlp`, i.e. (x + a) + m: one residual add with two writers (the second torch
    #   add is NOT a projection shortcut), by `model.layers.N` ordinal 0 -> 2.
    # - Writers: CohereAttention L284 `self.o_proj`, CohereMLP L126 `self.down_proj` -> branch_out
    #   None.
    # - Stack: CohereModel L368 `self.layers` -> 2, parallel (pre-ln, with qk-norm).
    # - Attention: attention_interface (L272) -> 2. Head: L446 `self.lm_head` (logits * logit_scale,
    #   L498, is a multiply).
    "cohere": HFCase(
        "CohereConfig",
        "CohereForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_qk_norm=True,
            attn_implementation="sdpa",
            **_lm_ids(),
        ),
        Expected(
            norms={"layernorm": 7},
            roles={"pre": 2, "qk": 4, "final": 1},
            stacks={"model.layers": (2, "parallel")},
            adds_per_stack={"model.layers": 2},
            residual_adds=2,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": (
                    "model.layers.0.self_attn.o_proj",
                    "model.layers.0.mlp.down_proj",
                ),
                "model.layers.1#0": (
                    "model.layers.1.self_attn.o_proj",
                    "model.layers.1.mlp.down_proj",
                ),
            },
        ),
    ),
    # --------------------------------------------------------------------------------------------
    # Mixture of experts: every expert writes; routers and gates never do.
    # --------------------------------------------------------------------------------------------
    # Mixtral (models/mixtral/modeling_mixtral.py), MixtralForCausalLM, 4 experts, top-2, 2 layers:
    # - MixtralExperts (L57, decorated @use_experts_implementation, eager here) holds L65
    #   `gate_up_proj` and L66 `down_proj` as 3-D parameters (experts, out, in) and applies them
    #   per expert: L87 `nn.functional.linear(current_state, self.gate_up_proj[expert_idx])`, L89
    #   `nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])`, L90 multiplies
    #   by the router weights, L91 `index_add_`. The router MixtralTopKRouter (L96) computes
    #   L106 `F.linear(hidden_states, self.weight)` then softmax/top-k: a gate, never a writer.
    # - Norms: MixtralRMSNorm (L134) -> rmsnorm. L339 `input_layernorm`, L340
    #   `post_attention_layernorm` -> 4; MixtralModel L409 `self.norm` -> 1. Total 5.
    # - Roles: L352-353 and L363-364 `residual = hidden_states; hidden_states = <norm>(...)` -> pre
    #   (4); `self.norm` after the loop -> final (1).
    # - Residual adds: L362, L366 `hidden_states = residual + hidden_states` -> 2 per layer = 4.
    # - Writers: attention MixtralAttention L327 `self.o_proj`; MoE: the experts module (down_proj
    #   is its parameter) -> `model.layers.N.mlp.experts`, one writer, so branch_out is that module.
    # - Stack: MixtralModel L406 `self.layers` -> 2, pre-ln.
    # - Attention: 2. Head: L558 `self.lm_head`.
    "mixtral": HFCase(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            experts_implementation="eager",
            **_lm_ids(),
        ),
        Expected(
            norms={"rmsnorm": 5},
            roles={"pre": 4, "final": 1},
            stacks={"model.layers": (2, "pre-ln")},
            adds_per_stack={"model.layers": 4},
            residual_adds=4,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.o_proj",),
                "model.layers.0#1": ("model.layers.0.mlp.experts",),
                "model.layers.1#1": ("model.layers.1.mlp.experts",),
            },
        ),
    ),
    # Qwen2-MoE (models/qwen2_moe/modeling_qwen2_moe.py), Qwen2MoeForCausalLM, 4 experts, top-2,
    # decoder_sparse_step=1 (every layer sparse, L358-360), 2 layers:
    # - Qwen2MoeSparseMoeBlock.forward (L340-351): L343 `shared_expert_output =
    #   self.shared_expert(...)` (a Qwen2MoeMLP whose last layer is L134 `self.down_proj`) runs
    #   first; L344 the router `self.gate` (Qwen2MoeTopKRouter, L322 `F.linear(hidden,
    #   self.weight)`, softmax, top-k); L345 `self.experts(...)` (fused 3-D experts, L302-306
    #   `F.linear(x, self.down_proj[expert_idx])` times the routing weights); L347
    #   `F.sigmoid(self.shared_expert_gate(...)) * shared_expert_output` (Linear(d, 1): a gate);
    #   L349 `expert_output + shared_expert_output` joins the two inside the branch (not residual).
    # - Norms: Qwen2MoeRMSNorm (L56). L364-365 input/post_attention_layernorm -> 4, L440 `self.norm`
    #   -> 1. Total 5 rmsnorm; roles pre 4 (L380, L395), final 1 (L505).
    # - Residual adds: L391 and L397 `hidden_states = residual + hidden_states` -> 4.
    # - Writers of the MoE add, in execution order: `mlp.shared_expert.down_proj`, then
    #   `mlp.experts` -> branch_out None. Gates: `mlp.gate`, `mlp.shared_expert_gate`.
    # - Stack: L437 `self.layers` -> 2, pre-ln. Attention: 2. Head: L596 `self.lm_head`.
    "qwen2_moe": HFCase(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            experts_implementation="eager",
            **_lm_ids(),
        ),
        Expected(
            norms={"rmsnorm": 5},
            roles={"pre": 4, "final": 1},
            stacks={"model.layers": (2, "pre-ln")},
            adds_per_stack={"model.layers": 4},
            residual_adds=4,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.o_proj",),
                "model.layers.0#1": (
                    "model.layers.0.mlp.shared_expert.down_proj",
                    "model.layers.0.mlp.experts",
                ),
                "model.layers.1#1": (
                    "model.layers.1.mlp.shared_expert.down_proj",
                    "model.layers.1.mlp.experts",
                ),
            },
        ),
    ),
    # DeepSeek-V3 (models/deepseek_v3/modeling_deepseek_v3.py), DeepseekV3ForCausalLM, 2 layers,
    # first_k_dense_replace=1 (layer 0 dense MLP, layer 1 MoE: L493-496), 4 routed experts in 1
    # group, top-2, 1 shared expert, MLA attention with q_lora_rank=32, kv_lora_rank=32:
    # - Norms: DeepseekV3RMSNorm (L38) -> rmsnorm. Per layer L498 `input_layernorm`, L499
    #   `post_attention_layernorm` (4); DeepseekV3Attention L380 `q_a_layernorm` (on the low-rank
    #   query latent: L441 `self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))`) and
    #   L392 `kv_a_layernorm` (on the compressed KV latent, L447, which kv_b_proj (L416) expands
    #   into keys AND values) (4); DeepseekV3Model L574 `self.norm` (1). Total 9.
    # - Roles: input/post_attention_layernorm pre (4, L513, L528); final (1, L633). q_a_layernorm
    #   and kv_a_layernorm sit on latents in front of a projection, not on the q/k entering q.k^T ->
    #   branch (4). (See the report: `qk` is arguable.)
    # - Residual adds: L524 and L530 `hidden_states = residual + hidden_states` -> 4.
    # - Writers: attention L482 `self.o_proj`; layer 0 DeepseekV3MLP L116 `self.down_proj`; layer 1
    #   DeepseekV3MoE.forward (L215-222): L218 router `self.gate` (sigmoid scores L136, a gate),
    #   L220 `self.experts(...)` (fused, L194 `F.linear(x, self.down_proj[expert_idx])`), L221
    #   `hidden_states + self.shared_experts(residuals)` (ungated; DeepseekV3MLP.down_proj) ->
    #   writers (mlp.experts, mlp.shared_experts.down_proj), branch_out None.
    # - Stack: L571 `self.layers` -> 2 DeepseekV3DecoderLayer (same class, different MLP) -> pre-ln.
    # - Attention: attention_interface -> 2. Head: L652 `self.lm_head`.
    "deepseek_v3": HFCase(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            experts_implementation="eager",
            **_lm_ids(),
        ),
        Expected(
            norms={"rmsnorm": 9},
            roles={"pre": 4, "branch": 4, "final": 1},
            stacks={"model.layers": (2, "pre-ln")},
            adds_per_stack={"model.layers": 4},
            residual_adds=4,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.o_proj",),
                "model.layers.0#1": ("model.layers.0.mlp.down_proj",),
                "model.layers.1#1": (
                    "model.layers.1.mlp.experts",
                    "model.layers.1.mlp.shared_experts.down_proj",
                ),
            },
        ),
    ),
    # --------------------------------------------------------------------------------------------
    # QK-norm and post-norm on the branch.
    # --------------------------------------------------------------------------------------------
    # Qwen3 (models/qwen3/modeling_qwen3.py), Qwen3ForCausalLM, head_dim 16, 2 layers:
    # - Norms: Qwen3RMSNorm (L50). Qwen3DecoderLayer L284-285 input/post_attention_layernorm (4);
    #   Qwen3Attention L229-230 `self.q_norm`/`self.k_norm` = Qwen3RMSNorm(head_dim) (4);
    #   Qwen3Model L349 `self.norm` (1). Total 9 rmsnorm.
    # - Roles: L298-299 / L313-314 pre (4); L245-246 `self.q_norm(self.q_proj(...).view(...))` -> qk
    #   (4); final (1).
    # - Residual adds: L310, L316 -> 4. Writers: L272 `self.o_proj`, Qwen3MLP L82 `self.down_proj`.
    # - Stack: L346 `self.layers` -> 2, pre-ln (with qk-norm). Attention 2. Head: L435 `lm_head`.
    "qwen3": HFCase(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            **_lm_ids(),
        ),
        Expected(
            norms={"rmsnorm": 9},
            roles={"pre": 4, "qk": 4, "final": 1},
            stacks={"model.layers": (2, "pre-ln")},
            adds_per_stack={"model.layers": 4},
            residual_adds=4,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.o_proj",),
                "model.layers.0#1": ("model.layers.0.mlp.down_proj",),
            },
        ),
    ),
    # OLMo 2 (models/olmo2/modeling_olmo2.py), Olmo2ForCausalLM, 2 layers:
    # - Norms: Olmo2RMSNorm (L51). Olmo2DecoderLayer L285 `post_attention_layernorm`, L286
    #   `post_feedforward_layernorm` (4); Olmo2Attention L213-214 `q_norm`/`k_norm` over the full
    #   projection width (heads * head_dim) (4); Olmo2Model L349 `self.norm` (1). Total 9 rmsnorm.
    # - Roles: the layer has NO pre norm: L299-309 `residual = x; x = self_attn(x); x =
    #   post_attention_layernorm(x)`, L310 `x = residual + x`; L313-316 the same for the MLP. The
    #   norms normalize the branch output before the add on a branch without a pre norm: not
    #   sandwich-post (which needs a pre norm), not post (they do not read an add's output) ->
    #   branch (4). L228-229 `self.q_norm(self.q_proj(hidden_states))` -> qk (4). L406 final (1).
    # - Residual adds: L310, L316 -> 4. Writers: L258 `self.o_proj`, Olmo2MLP L274 `self.down_proj`
    #   (the norm after them is not a weight layer).
    # - Stack: L346 `self.layers` -> 2; every norm on the residual paths is a branch norm ->
    #   in-branch. Attention 2. Head: L424 `self.lm_head`.
    "olmo2": HFCase(
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            **_lm_ids(),
        ),
        Expected(
            norms={"rmsnorm": 9},
            roles={"branch": 4, "qk": 4, "final": 1},
            stacks={"model.layers": (2, "in-branch")},
            adds_per_stack={"model.layers": 4},
            residual_adds=4,
            attention=2,
            head="lm_head",
            writers={
                "model.layers.0#0": ("model.layers.0.self_attn.o_proj",),
                "model.layers.0#1": ("model.layers.0.mlp.down_proj",),
            },
        ),
    ),
    # --------------------------------------------------------------------------------------------
    # Encoder-decoder and a shared layer run N times.
    # --------------------------------------------------------------------------------------------
    # BART (models/bart/modeling_bart.py), BartModel, 2 encoder + 2 decoder layers (Post-LN):
    # - Norms (nn.LayerNorm): BartEncoderLayer L272 `self_attn_layer_norm`, L278 `final_layer_norm`
    #   (4); BartDecoderLayer L329 `self_attn_layer_norm`, L338 `encoder_attn_layer_norm`, L341
    #   `final_layer_norm` (6); BartEncoder L498 and BartDecoder L585 `layernorm_embedding` (2).
    #   Total 12. BartEncoder has no norm after its loop (mBART's has).
    # - Roles: encoder L293-294 `hidden_states = residual + hidden_states; hidden_states =
    #   self.self_attn_layer_norm(hidden_states)`, L301-302 (final_layer_norm), decoder L364-365,
    #   L379-380, L388-389: each normalizes an add's output that becomes the stream -> post (10;
    #   the last layer's final_layer_norm is inside the block, so post, not final). The embedding
    #   norms (L524, L649) normalize token + position embeddings -> other (2).
    # - Residual adds: encoder L293, L301 (2 per layer); decoder L364, L379, L388 (3 per layer) ->
    #   4 + 6 = 10, by `{encoder,decoder}.layers.N` ordinals 0.. in order.
    # - Writers: BartAttention L255 `attn_output = self.out_proj(attn_output)` (self_attn,
    #   encoder_attn: the cross-attention's key/value path from the encoder also ends in out_proj);
    #   fc2 (L277 / L340).
    # - Stacks: L497 `encoder.layers`, L583 `decoder.layers` -> 2 each, post-ln.
    # - Attention: encoder 2 self, decoder 2 self + 2 cross -> 6. Head: BartModel has none -> None.
    "bart": HFCase(
        "BartConfig",
        "BartModel",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        ),
        Expected(
            norms={"layernorm": 12},
            roles={"post": 10, "other": 2},
            stacks={"encoder.layers": (2, "post-ln"), "decoder.layers": (2, "post-ln")},
            adds_per_stack={"encoder.layers": 4, "decoder.layers": 6},
            residual_adds=10,
            attention=6,
            head=None,
            writers={
                "encoder.layers.0#0": ("encoder.layers.0.self_attn.out_proj",),
                "encoder.layers.0#1": ("encoder.layers.0.fc2",),
                "decoder.layers.0#0": ("decoder.layers.0.self_attn.out_proj",),
                "decoder.layers.0#1": ("decoder.layers.0.encoder_attn.out_proj",),
                "decoder.layers.0#2": ("decoder.layers.0.fc2",),
            },
        ),
        inputs=_bart_inputs,
    ),
    # ALBERT (models/albert/modeling_albert.py), AlbertModel, num_hidden_layers=3, one hidden group
    # with one inner layer (the defaults num_hidden_groups=1, inner_group_num=1), embedding 32:
    # - AlbertTransformer.forward L274-282: `for i in range(num_hidden_layers): hidden_states =
    #   self.albert_layer_groups[group_idx](hidden_states, ...)` with group_idx always 0 -> the one
    #   module `encoder.albert_layer_groups.0` (AlbertLayerGroup, L241) runs 3 times in a chain ->
    #   a repeated stack of depth 3 (blocks = its path 3 times), placement post-ln.
    # - Norms (nn.LayerNorm): AlbertEmbeddings L60 `self.LayerNorm`; AlbertAttention L162
    #   `self.LayerNorm`; AlbertLayer L210 `full_layer_layer_norm` -> 3 modules.
    # - Roles: embeddings LayerNorm (L104, after the embedding sums) -> other; AlbertAttention L198
    #   `self.LayerNorm(hidden_states + attn_output)` and AlbertLayer L231
    #   `self.full_layer_layer_norm(ffn_output + attention_output)` normalize an add's output on
    #   every run -> post (2 modules).
    # - Residual adds: L198 (by `...albert_layers.0.attention`) and L231 (by `...albert_layers.0`),
    #   ordinal 0 each, once per run -> calls 0, 1, 2 -> 6 adds in all.
    # - Writers: AlbertAttention L196 `attn_output = self.dense(attn_output)`; AlbertLayer.ff_chunk
    #   L237 `ffn_output = self.ffn_output(ffn_output)`. (L272 `embedding_hidden_mapping_in` maps
    #   the 32-wide embeddings to 64 before the loop: not on a branch.)
    # - Attention: one AlbertAttention module (run 3 times) calls attention_interface (L184) -> 1.
    # - Head: AlbertModel's pooler (L351, tanh of the first token) is not logits -> None.
    "albert": HFCase(
        "AlbertConfig",
        "AlbertModel",
        dict(
            vocab_size=VOCAB,
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            attn_implementation="sdpa",
            pad_token_id=0,
        ),
        Expected(
            norms={"layernorm": 3},
            roles={"post": 2, "other": 1},
            stacks={"encoder.albert_layer_groups.0": (3, "post-ln")},
            adds_per_stack={"encoder.albert_layer_groups.0": 6},
            residual_adds=6,
            attention=1,
            head=None,
            writers={
                "encoder.albert_layer_groups.0.albert_layers.0.attention#0": (
                    "encoder.albert_layer_groups.0.albert_layers.0.attention.dense",
                ),
                "encoder.albert_layer_groups.0.albert_layers.0#0": (
                    "encoder.albert_layer_groups.0.albert_layers.0.ffn_output",
                ),
            },
        ),
        inputs=_ids_only,
    ),
    # --------------------------------------------------------------------------------------------
    # A state-space model.
    # --------------------------------------------------------------------------------------------
    # Mamba (models/mamba/modeling_mamba.py), MambaForCausalLM, hidden 64, state 8, 2 layers:
    # - Norms: MambaRMSNorm (L487). MambaBlock L513 `self.norm` (2); MambaModel L624 `self.norm_f`
    #   (1). Total 3 rmsnorm.
    # - Roles: MambaBlock.forward L524-525 `residual = hidden_states; hidden_states =
    #   self.norm(...)` feeds the mixer -> pre (2); L691 `self.norm_f` after the loop -> final (1).
    # - Residual adds: L530 `hidden_states = residual + hidden_states` -> 1 per block = 2.
    #   Inside the mixer, mamba_selective_scan's `scan_output + hidden_states * D[None, :, None]`
    #   (L271) is the SSM's D skip on the conv output, scaled by a parameter, inside the branch:
    #   not a residual add of the stream (see the report), nor are the scan's state updates.
    # - Weight layers of the branch (MambaMixer.forward L360-484): in_proj, conv1d (applied through
    #   causal_conv1d_fn L92 `F.conv1d(..., weight=weight.unsqueeze(1))` on
    #   `self.conv1d.weight.squeeze(1)`: a view of the weight), x_proj, dt_proj (L440
    #   `self.dt_proj.weight @ time_step...`: a weight in a matmul), out_proj. Every path (SSM, D
    #   skip, silu gate z) ends in L483 `self.out_proj` -> the single writer.
    # - Stack: L621 `self.layers` -> 2, pre-ln. Attention: none. Head: L718 `self.lm_head`.
    "mamba": HFCase(
        "MambaConfig",
        "MambaForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            use_mambapy=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        Expected(
            norms={"rmsnorm": 3},
            roles={"pre": 2, "final": 1},
            stacks={"backbone.layers": (2, "pre-ln")},
            adds_per_stack={"backbone.layers": 2},
            residual_adds=2,
            attention=0,
            head="lm_head",
            writers={
                "backbone.layers.0#0": ("backbone.layers.0.mixer.out_proj",),
                "backbone.layers.1#0": ("backbone.layers.1.mixer.out_proj",),
            },
        ),
    ),
    # --------------------------------------------------------------------------------------------
    # Vision.
    # --------------------------------------------------------------------------------------------
    # DINOv2 (models/dinov2/modeling_dinov2.py), Dinov2ForImageClassification, image 32, patch 8,
    # hidden 64, 2 layers, layerscale_value 1.0, input 2x3x32x32:
    # - Norms (nn.LayerNorm): Dinov2Layer L299 `norm1`, L303 `norm2` (4); Dinov2Model L391
    #   `self.layernorm` (1). Total 5.
    # - Roles: Dinov2Layer.forward L314-315 / L321-322 `residual = x; x = self.norm1(x)` -> pre (4);
    #   L415 `self.layernorm(encoder_outputs.last_hidden_state)` after the encoder -> final (1).
    # - Residual adds: L318 `hidden_states = self.drop_path(hidden_states) + residual`, L325 (same)
    #   -> 2 per layer = 4, by `dinov2.encoder.layer.N`.
    # - Writers: Dinov2Attention (the layer's `self.attention`, L300) L223 `self.o_proj`; Dinov2MLP
    #   L249 `self.fc2`. Dinov2LayerScale (L228-234, `hidden_state * self.lambda1`, a (C) parameter)
    #   follows each writer: a scale (`layer_scale1.lambda1`, `layer_scale2.lambda1`), not a writer.
    # - Stack: Dinov2Encoder L368 `self.layer` -> `dinov2.encoder.layer`, 2, pre-ln.
    # - Attention: Dinov2Attention calls attention_interface (L211) -> 2.
    # - Head: L437 `self.classifier` = Linear(2 * hidden, labels) on [cls, mean(patches)] (L459).
    "dinov2": HFCase(
        "Dinov2Config",
        "Dinov2ForImageClassification",
        dict(
            image_size=32,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            mlp_ratio=2,
            layerscale_value=1.0,
            num_labels=10,
            attn_implementation="sdpa",
        ),
        Expected(
            norms={"layernorm": 5},
            roles={"pre": 4, "final": 1},
            stacks={"dinov2.encoder.layer": (2, "pre-ln")},
            adds_per_stack={"dinov2.encoder.layer": 4},
            residual_adds=4,
            attention=2,
            head="classifier",
            writers={
                "dinov2.encoder.layer.0#0": ("dinov2.encoder.layer.0.attention.o_proj",),
                "dinov2.encoder.layer.0#1": ("dinov2.encoder.layer.0.mlp.fc2",),
            },
        ),
        inputs=_image,
    ),
    # ConvNeXt V2 (models/convnextv2/modeling_convnextv2.py), ConvNextV2ForImageClassification,
    # hidden_sizes (32, 64), depths (2, 2), patch 4, input 2x3x32x32:
    # - Norms: ConvNextV2LayerNorm (L57, an nn.LayerNorm subclass; `data_format="channels_first"`
    #   permutes NCHW to NHWC around it, L74-77) -> layernorm. Embeddings L94 (channels_first) (1);
    #   stage 1's downsampling_layer L194 (channels_first; stage 0 keeps 32 channels at stride 1,
    #   L191, so it has none) (1); ConvNextV2Layer L151 `self.layernorm` (channels_last) x 4;
    #   ConvNextV2Model L281 `self.layernorm` (nn.LayerNorm on the pooled features) (1) -> 7
    #   layernorm. ConvNextV2GRN (L39, `self.grn` L155, one per layer) computes L49-51
    #   `Gx = ||x||_2 over (H, W); Nx = Gx / (mean_C(Gx) + 1e-6); weight * (x * Nx) + bias + x`: a
    #   normalization by a global statistic with only elementwise parameters (weight/bias
    #   (1, 1, 1, 4C), zero-initialized, L44-45, L225-226) -> 4 norms of kind unknown, recognizable
    #   only by behaviour (its class name holds no "Norm"; timm's GlobalResponseNorm in
    #   tests/helpers/zoo_vision.py is counted the same way). Total 11.
    # - Roles: ConvNextV2Layer.forward L160-172 `residual = x; x = dwconv(x); ... x = layernorm(x);
    #   x = pwconv1(x); act; x = grn(x); x = pwconv2(x); ... x = residual + drop_path(x)` -> the
    #   block norm and the GRN are inside the branch -> branch (4 + 4). Embedding and downsampling
    #   norms -> other (2); L299 `self.layernorm(last_hidden_state.mean([-2, -1]))` after the last
    #   stage -> final (1).
    # - Residual adds: L172 `features = residual + self.drop_path(features)` -> 1 per layer = 4.
    #   GRN's L51 `self.weight * (x * Nx) + self.bias + x` is NOT a residual add (no weight layer).
    # - Writers: L168 `features = self.pwconv2(features)` (an nn.Linear on NHWC).
    # - Stacks: ConvNextV2Encoder L236 `self.stages` (2 stages, 0 adds) and each stage's L201
    #   `self.layers` (2 each) -> in-branch.
    # - Attention: none. Head: L326 `self.classifier`.
    "convnextv2": HFCase(
        "ConvNextV2Config",
        "ConvNextV2ForImageClassification",
        dict(
            num_channels=3,
            patch_size=4,
            num_stages=2,
            hidden_sizes=[32, 64],
            depths=[2, 2],
            num_labels=10,
        ),
        Expected(
            norms={"layernorm": 7, "unknown": 4},
            roles={"branch": 8, "other": 2, "final": 1},
            stacks={
                "convnextv2.encoder.stages": (2, "in-branch"),
                "convnextv2.encoder.stages.0.layers": (2, "in-branch"),
                "convnextv2.encoder.stages.1.layers": (2, "in-branch"),
            },
            adds_per_stack={
                "convnextv2.encoder.stages": 0,
                "convnextv2.encoder.stages.0.layers": 2,
                "convnextv2.encoder.stages.1.layers": 2,
            },
            residual_adds=4,
            attention=0,
            head="classifier",
            writers={
                "convnextv2.encoder.stages.0.layers.0#0": (
                    "convnextv2.encoder.stages.0.layers.0.pwconv2",
                ),
                "convnextv2.encoder.stages.1.layers.0#0": (
                    "convnextv2.encoder.stages.1.layers.0.pwconv2",
                ),
            },
        ),
        inputs=_image,
    ),
}


# SegFormer (models/segformer/modeling_segformer.py), SegformerForSemanticSegmentation, 2 encoder
# stages (hidden 32, 64; depths 2, 2; sr_ratios 2, 1), decoder_hidden_size 32, 4 labels, input
# 2x3x32x32. Its forward NEEDS the model's own forward hooks:
# - L580 `encoder_hidden_states = outputs.hidden_states` and L582 `self.decode_head(...)` read
#   the stage outputs that transformers 5 collects with forward hooks on every SegformerStage
#   (L369 `OutputRecorder(SegformerStage, ...)`, installed by utils/output_capturing.py
#   `install_output_capuring_hook`, `module.register_forward_hook(output_capturing_hook)`). With
#   those hooks silenced the tuple is empty and SegformerDecodeHead.forward raises IndexError
#   (`encoder_hidden_states[-1]`).
# - Norms: per stage SegformerOverlapPatchEmbeddings L77 `layer_norm` (2); per layer L276
#   `layernorm_before`, L284 `layernorm_after` (8); stage 0's attention
#   SegformerSequenceReduction L99 `layer_norm` (sr_ratio 2 > 1, L162; one per layer) (2);
#   SegformerStage L336 `self.layer_norm` (2); SegformerDecodeHead L488 `batch_norm` (1).
#   Total 14 layernorm + 1 batchnorm.
# - Roles: patch-embedding norms (L83, after the strided conv) -> other (2); L296 / L302
#   `layernorm_before`/`layernorm_after` read the stream and feed the branch -> pre (8); the
#   sequence-reduction norm (L107) normalizes the reduced key/value tokens (L179) before
#   k_proj/v_proj inside the attention branch -> branch (2); L346 the stage's closing norm after
#   its blocks loop -> final (2); decode-head BatchNorm (L519) -> other (1).
# - Residual adds: L299 and L304 `hidden_states = self.drop_path(hidden_states) + residual` ->
#   2 per layer = 8, by `segformer.stages.S.blocks.N`.
# - Writers: SegformerAttention L201 `attn_output = self.o_proj(attn_output)`; SegformerMixMLP
#   L242 `self.fc2`.
# - Stacks: SegformerModel L384 `self.stages` (2 stages in a chain, 0 adds) and each stage's
#   L323 `self.blocks` (2 layers each, pre-ln). `decode_head.linear_projections` does not chain.
# - Attention: SegformerAttention calls attention_interface (L189) -> 4.
# - Head: L492 `decode_head.classifier` (a 1x1 Conv2d producing the logits).
def build_segformer() -> Built:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = _config(
        SegformerConfig,
        num_channels=3,
        num_encoder_blocks=2,
        depths=[2, 2],
        sr_ratios=[2, 1],
        hidden_sizes=[32, 64],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=32,
        num_labels=4,
        attn_implementation="sdpa",
    )
    model: nn.Module = SegformerForSemanticSegmentation(config)
    image = torch.randn(BATCH, 3, 32, 32)
    # One forward, as on any model that has already been used: transformers installs the output
    # capturing hooks on its first forward (utils/output_capturing.py maybe_install_capturing_hooks)
    # and keeps them. Discovery must then run them; on a model that never ran, it must not strip
    # the hooks its own forward installed (the model's next forward would raise IndexError).
    model.eval()
    with torch.no_grad():
        model(image)
    s = "segformer.stages"
    exp = Expected(
        norms={"layernorm": 14, "batchnorm": 1},
        roles={"pre": 8, "branch": 2, "final": 2, "other": 3},
        stacks={
            s: (2, "pre-ln"),
            f"{s}.0.blocks": (2, "pre-ln"),
            f"{s}.1.blocks": (2, "pre-ln"),
        },
        adds_per_stack={s: 0, f"{s}.0.blocks": 4, f"{s}.1.blocks": 4},
        residual_adds=8,
        attention=4,
        head="decode_head.classifier",
        writers={
            f"{s}.0.blocks.0#0": (f"{s}.0.blocks.0.attention.o_proj",),
            f"{s}.0.blocks.0#1": (f"{s}.0.blocks.0.mlp.fc2",),
            f"{s}.1.blocks.0#0": (f"{s}.1.blocks.0.attention.o_proj",),
            f"{s}.1.blocks.0#1": (f"{s}.1.blocks.0.mlp.fc2",),
        },
    )
    return model, (image,), {}, exp


BUILDERS: dict[str, Callable[[], Built]] = {
    **{name: functools.partial(build_hf, case) for name, case in CASES.items()},
    "segformer": build_segformer,
}

# Models whose forward reads outputs collected by their own forward hooks.
HOOK_DEPENDENT: frozenset[str] = frozenset({"segformer"})
