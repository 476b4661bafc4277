"""A called list of alternating sublayers (KEEL's flat ModuleList of attention and
feed-forward layers, one residual add each) is a stack of their repeating unit, so gpt2's N
counts layers; a hybrid list of whole layers (two adds each) keeps one block per entry."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import normprobe

D, LAYERS = 32, 4


class Mix(nn.Module):
    """A Pre-LN sublayer; ``out`` writes into the stream (token mixing or channel MLP)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, hidden)
        self.out = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.up(self.norm(x))))


class Attn(Mix):
    def __init__(self) -> None:
        super().__init__(D)


class Ff(Mix):
    def __init__(self) -> None:
        super().__init__(2 * D)


class Layer(nn.Module):
    """A whole layer: two residual adds."""

    def __init__(self, first: type[Mix], second: type[Mix]) -> None:
        super().__init__()
        self.a, self.b = first(), second()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        return x + self.b(x)


class Flat(nn.Module):
    """``layers = [Attn, Ff, Attn, Ff, ...]``, each called by the parent and added."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(m() for _ in range(LAYERS) for m in (Attn, Ff))
        self.final = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.final(x)


class AttnLayer(Layer):
    def __init__(self) -> None:
        super().__init__(Attn, Ff)


class FfLayer(Layer):
    def __init__(self) -> None:
        super().__init__(Ff, Attn)


class Hybrid(nn.Module):
    """Whole layers of two classes alternating (Jamba's pattern): one block each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(m() for _ in range(LAYERS // 2) for m in (AttnLayer, FfLayer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _map(model: nn.Module) -> normprobe.ModelMap:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normprobe.discover(model, torch.randn(2, 8, D))


def test_alternating_sublayers_are_grouped_into_layers() -> None:
    torch.manual_seed(0)
    m = _map(Flat())
    (stack,) = m.stacks
    assert (stack.path, stack.depth, stack.block_type) == ("layers", LAYERS, "Attn+Ff")
    assert stack.blocks == tuple(f"layers.{2 * i}" for i in range(LAYERS))
    assert len(m.adds_in("layers")) == 2 * LAYERS
    assert [a.block for a in m.adds_in("layers")] == [i for i in range(LAYERS) for _ in (0, 1)]
    assert m.norm("final").role == "final" and not m.doubts


def test_gpt2_counts_the_layers_of_grouped_sublayers() -> None:
    torch.manual_seed(0)
    model = Flat()
    normprobe.reinit(model, "gpt2", example_inputs=(torch.randn(2, 8, D),))
    writers = torch.cat([layer.out.weight.detach().flatten() for layer in model.layers])
    due = 0.02 / math.sqrt(2 * LAYERS)  # 2N = the 8 residual adds along the stream
    assert abs(writers.std().item() / due - 1) < 0.05


def test_whole_layers_of_two_classes_stay_one_block_each() -> None:
    torch.manual_seed(0)
    m = _map(Hybrid())
    (stack,) = m.stacks
    assert stack.depth == LAYERS and not stack.members
    assert [a.block for a in m.adds_in("layers")] == [i for i in range(LAYERS) for _ in (0, 1)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Stage(nn.Module):
    """A downsampling layer, then a Sequential of blocks."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.down = nn.Linear(D, D)
        self.blocks = nn.Sequential(*(Block() for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(self.down(x))
        return out


class Stages(nn.Module):
    """Stages of several depths (DaViT's and TinyViT's 1, 1, 3, 1)."""

    def __init__(self, depths: tuple[int, ...]) -> None:
        super().__init__()
        self.stages = nn.Sequential(*(Stage(k) for k in depths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stages(x)
        return out


def test_a_stage_of_one_block_is_a_doubt_that_gpt2_heeds() -> None:
    # the one-block stages hold no stack, so their adds fall to `stages`: N would be 4 stages
    torch.manual_seed(0)
    model, x = Stages((1, 1, 3, 1)), torch.randn(2, 8, D)
    m = _map(model)
    assert [(d.kind, d.path) for d in m.doubts] == [("nested-stacks", "stages")]
    with pytest.raises(ValueError, match=r"nested-stacks at stages.*n_layers="):
        normprobe.reinit(model, "gpt2", example_inputs=(x,))


def test_stages_of_two_blocks_or_more_are_no_doubt() -> None:
    torch.manual_seed(0)
    model, x = Stages((2, 3)), torch.randn(2, 8, D)
    assert not _map(model).doubts
    normprobe.reinit(model, "gpt2", example_inputs=(x,))
    for stage, depth in zip(model.stages, (2, 3), strict=True):
        writers = torch.cat([b.fc2.weight.detach().flatten() for b in stage.blocks])
        assert abs(writers.std().item() / (0.02 / math.sqrt(2 * depth)) - 1) < 0.05


class Decay(nn.Module):
    """A layer applying a matrix and a learned per-channel decay (RecurrentGemma's RG-LRU)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.log_decay = nn.Parameter(torch.full((D,), -3.0))
        self.gate_bias = nn.Parameter(torch.ones(2, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight) * torch.sigmoid(self.log_decay) + self.gate_bias.sum(0)


class DecayBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.decay, self.head = nn.LayerNorm(D), Decay(), nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x + self.decay(self.norm(x)))
        return out


def test_gpt2_keeps_a_vector_that_is_no_bias_and_zeroes_every_bias() -> None:
    torch.manual_seed(0)
    model = DecayBlock()
    normprobe.reinit(model, "gpt2", example_inputs=(torch.randn(2, 8, D),))
    layer = model.decay
    assert torch.equal(layer.log_decay, torch.full((D,), -3.0))
    assert not layer.gate_bias.any()
    # the one block's writer: N = 1
    assert abs(layer.weight.std().item() / (0.02 / math.sqrt(2)) - 1) < 0.1


@pytest.mark.parametrize("coef", [0, 2])
def test_a_first_unit_holding_more_inside_is_still_grouped(coef: int) -> None:
    """x-transformers' ``add_value_residual``: the first attention makes the values the later
    ones mix in, so its entry's structure differs inside while the entries' classes and their
    children's repeat (attention, feed-forward) x 4. ``sandwich_coef=2`` orders the sublayers
    a a a f a f f f: no unit repeats, no stack (a doubt instead)."""
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    sandwich = {"sandwich_coef": coef} if coef else {}
    layers = Decoder(dim=16, depth=4, heads=2, add_value_residual=True, **sandwich)
    model = TransformerWrapper(num_tokens=32, max_seq_len=16, attn_layers=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        m = normprobe.discover(model, torch.randint(0, 32, (2, 8)))
    if coef:
        assert not m.stacks and "no-stack" in {d.kind for d in m.doubts}
        return
    (stack,) = m.stacks
    assert stack.path == "attn_layers.layers" and stack.depth == 4
    assert stack.members == tuple(
        (f"attn_layers.layers.{2 * i}", f"attn_layers.layers.{2 * i + 1}") for i in range(4)
    )
    assert [a.block for a in m.adds_in("attn_layers.layers")] == [0, 0, 1, 1, 2, 2, 3, 3]
