"""Gates computed from a condition rather than the residual stream: adaLN-Zero's (DiT, Flux,
SD3) multiply each branch's write by a linear map of the timestep and class embedding, zero at
init in the DiT paper. Discovery names them `condition_gates`, and a branch behind one counts as
written through a learned gain (`ModelMap.branch_gains`); a router or a gate computed from the
stream, even before the add's own branch, is none."""

from __future__ import annotations

import pytest
import torch
from conditioned import TinyDiT
from torch import nn

import normprobe


class StreamGated(nn.Module):
    """A gate computed from the stream at the block's start, used on the second add: outside
    that add's branch, yet from the stream."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x))
        x = x + self.a(x)
        return x + g * self.b(x)


class StreamGatedStack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(StreamGated(width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_adaln_zero_gates_are_condition_gates_and_branch_gains() -> None:
    torch.manual_seed(0)
    model = TinyDiT()
    m = normprobe.discover(model, torch.randn(2, 5, 4), torch.tensor([1, 2]))
    assert [s.path for s in m.stacks] == ["blocks"]
    adds = m.adds_in("blocks")
    assert len(adds) == 8
    for a in adds:
        gate = f"blocks.{a.block}.modulation"
        assert a.gates == (gate,) and a.condition_gates == (gate,)
        assert m.branch_gains(a) == (gate,)
        assert a.writers in ((f"blocks.{a.block}.mix",), (f"blocks.{a.block}.mlp.2",))


@pytest.mark.filterwarnings("ignore::normprobe.DiscoveryWarning")
def test_gates_computed_from_the_stream_are_not_condition_gates() -> None:
    torch.manual_seed(0)
    model = StreamGatedStack()
    m = normprobe.discover(model, torch.randn(2, 8))
    second = [a for a in m.residual_adds if a.ordinal == 1]
    assert len(second) == 3
    for a in second:
        assert a.gates == (f"blocks.{a.block}.gate",)
        assert a.condition_gates == ()
        assert m.branch_gains(a) == ()


def test_a_mixture_of_experts_router_is_not_a_condition_gate() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    torch.manual_seed(0)
    m = normprobe.discover(MixtralForCausalLM(config), torch.randint(0, 64, (1, 8)))
    routed = [a for a in m.residual_adds if a.gates]
    assert [a.gates for a in routed] == [(f"model.layers.{i}.mlp.gate",) for i in range(2)]
    assert all(a.condition_gates == () for a in routed)


def test_flux_and_dit_gate_every_branch_by_the_condition() -> None:
    from diffusers import DiTTransformer2DModel, FluxTransformer2DModel

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10,
    )  # fmt: skip
    m = normprobe.discover(
        dit, torch.randn(1, 4, 8, 8), timestep=torch.tensor([5]), class_labels=torch.tensor([3])
    )
    assert len(m.residual_adds) == 4
    for a in m.residual_adds:
        assert a.condition_gates == (f"transformer_blocks.{a.block}.norm1.linear",)
    flux = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    m = normprobe.discover(
        flux,
        torch.randn(1, 64, 16),
        encoder_hidden_states=torch.randn(1, 7, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(64, 3),
        txt_ids=torch.zeros(7, 3),
    )
    single = m.adds_in("single_transformer_blocks")
    assert len(single) == 2
    for a in single:
        assert a.condition_gates == (f"single_transformer_blocks.{a.block}.norm.linear",)
    # the double blocks: image and text streams, each gated by its own modulation
    for a in m.adds_in("transformer_blocks"):
        assert a.condition_gates and all(g.endswith(".linear") for g in a.condition_gates)
