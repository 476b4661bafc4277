"""A called list of alternating sublayers (KEEL's flat ModuleList of attention and
feed-forward layers, one residual add each) is a stack of their repeating unit, so gpt2's N
counts layers; a hybrid list of whole layers (two adds each) keeps one block per entry."""

from __future__ import annotations

import math
import warnings

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
