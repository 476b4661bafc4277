"""Weight-normed layers: discovery sees the layer, not its parametrization; reinit sets the weight
the layer applies.

Weight norm computes ``w = g * v / ||v||`` (norms over every dim but ``dim``), from two
parameters: ``parametrizations.weight.original0`` (g) and ``original1`` (v) with
``torch.nn.utils.parametrizations.weight_norm``, ``weight_g`` and ``weight_v`` with the old
``torch.nn.utils.weight_norm``. A sample std of n normal draws has relative standard error
1/sqrt(2n); stds are checked to within 4 of them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from zoo_hf import wav2vec2_config

import normprobe
from normprobe.discovery import ModelMap

DEPTH = 4
WIDTH = 32


def _old_weight_norm(layer: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for the parametrization
        return nn.utils.weight_norm(layer)


class UnitRows(nn.Module):
    """A user's parametrization: each row of the weight scaled to unit norm."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w / w.norm(dim=1, keepdim=True)


PARAMETRIZE: dict[str, Callable[[nn.Module], Any]] = {
    "weight_norm": parametrizations.weight_norm,
    "old_weight_norm": _old_weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "user": lambda layer: parametrize.register_parametrization(layer, "weight", UnitRows()),
}


class Block(nn.Module):
    """Pre-LN MLP block whose output layer (the stream writer) is parametrized."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)
        PARAMETRIZE[kind](self.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, WIDTH)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


def _g_v(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter, int]:
    """(g, v, dim) of a weight-normed layer, either API."""
    if parametrize.is_parametrized(layer):
        chain = layer.parametrizations.weight
        return chain.original0, chain.original1, chain[0].dim
    hook = next(h for h in layer._forward_pre_hooks.values() if hasattr(h, "dim"))
    return layer.weight_g, layer.weight_v, hook.dim


def _effective(layer: nn.Module) -> torch.Tensor:
    g, v, dim = _g_v(layer)
    return torch._weight_norm(v, g, dim).detach()


def _assert_std(t: torch.Tensor, expected: float) -> None:
    tolerance = 4 / math.sqrt(2 * t.numel())
    got = t.float().std().item()
    assert abs(got / expected - 1) < tolerance, f"std {got:.6f}, expected {expected:.6f}"


def _assert_weight_norm_holds(layer: nn.Module) -> None:
    """g positive and equal to the norms of v's slices, as weight norm defines g."""
    g, v, dim = _g_v(layer)
    assert bool((g > 0).all()), "a magnitude g is not positive"
    torch.testing.assert_close(g, torch.norm_except_dim(v, 2, dim))


def _assert_no_parametrization(m: ModelMap) -> None:
    assert all(".parametrizations" not in n.path for n in m.norms), [n.path for n in m.norms]
    assert all(".parametrizations" not in w for w in m.weight_layers), m.weight_layers


def _train_step(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("kind", list(PARAMETRIZE))
def test_a_parametrized_writer_is_the_layer_not_a_norm(kind: str) -> None:
    model = Net(kind)
    m = normprobe.discover(model, _ids())
    assert [n.path for n in m.norms] == [f"blocks.{i}.ln" for i in range(DEPTH)]
    _assert_no_parametrization(m)
    assert [a.writers for a in m.residual_adds] == [(f"blocks.{i}.out",) for i in range(DEPTH)]
    assert m.residual_adds[0].writer_params == ("blocks.0.out.weight",)
    assert "blocks.0.out" in m.weight_layers


@pytest.mark.parametrize("kind", ["weight_norm", "old_weight_norm"])
def test_gpt2_gives_the_applied_weight_its_std(kind: str) -> None:
    torch.manual_seed(0)
    model = Net(kind)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    normprobe.reinit(model, "gpt2", example_inputs=(_ids(),))
    for block in model.blocks:
        # the writer of each of the 4 blocks: 0.02 / sqrt(2 * 4), over 32 x 128 weights
        _assert_std(_effective(block.out), 0.02 / math.sqrt(2 * DEPTH))
        _assert_std(block.fc.weight.detach(), 0.02)
        _assert_weight_norm_holds(block.out)
        assert block.out.bias.abs().max().item() == 0.0
    # the same Parameter objects, trainable, under the same names
    assert list(model.state_dict()) == keys
    assert all(params[n] is p and p.requires_grad for n, p in model.named_parameters())
    ids = _ids()
    _train_step(model, lambda m: nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()))


@pytest.mark.parametrize("kind", ["weight_norm", "old_weight_norm"])
def test_zeroing_a_weight_normed_writer_keeps_its_direction(kind: str) -> None:
    """zero_branch zeroes the applied weight through g alone: v with a zero norm would be 0/0."""
    model = Net(kind)
    normprobe.reinit(model, "zero_branch", example_inputs=(_ids(),))
    g, v, _ = _g_v(model.blocks[0].out)
    assert g.abs().max().item() == 0.0
    assert v.norm().item() > 0
    assert _effective(model.blocks[0].out).abs().max().item() == 0.0
    ids = _ids()
    _train_step(model, lambda m: nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()))
    assert g.abs().max().item() > 0  # the branch learns from zero


def test_folding_a_branch_scale_into_a_weight_normed_writer() -> None:
    model = Net("weight_norm")
    ids = _ids()
    normprobe.insert_branch_scale(model, "layerscale", init=0.5, example_inputs=(ids,))
    with torch.no_grad():
        expected = model(ids)
        normprobe.remove_branch_scale(model)
        torch.testing.assert_close(model(ids), expected)
    _assert_weight_norm_holds(model.blocks[0].out)


def test_a_parametrization_without_right_inverse_is_left_as_it_is() -> None:
    model = Net("user")
    before = {k: v.clone() for k, v in model.state_dict().items() if ".out." in k}
    with pytest.warns(UserWarning, match=r"weight keeps its value"):
        normprobe.reinit(model, "gpt2", example_inputs=(_ids(),))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items() if "bias" not in k)


def test_wav2vec2_positional_conv() -> None:
    """wav2vec2's positional conv (``weight_norm(conv, dim=2)``) writes into the encoder's
    stream: 0.02 / sqrt(2 * 2) for its 2 layers, over 32 x 8 x 8 = 2048 weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(wav2vec2_config(layers=2, layerdrop=0.0))
    audio = torch.randn(2, 800, generator=torch.Generator().manual_seed(0))
    conv = model.encoder.pos_conv_embed.conv
    path = "encoder.pos_conv_embed.conv"
    m = normprobe.discover(model, audio)
    _assert_no_parametrization(m)
    pos = next(a for a in m.residual_adds if path in a.writers)
    assert pos.writers == (path,)
    assert pos.writer_params == (f"{path}.weight",)

    # its add is in no stack: the map doubts its N, and the 2 layers are given
    assert [(d.kind, d.path) for d in m.doubts] == [("add-outside-stack", "encoder")]
    keys = list(model.state_dict())
    normprobe.reinit(model, "gpt2", model_map=m, n_layers=2)
    _assert_std(_effective(conv), 0.02 / math.sqrt(2 * 2))
    _assert_weight_norm_holds(conv)
    assert list(model.state_dict()) == keys
    _train_step(model, lambda mod: mod(audio).last_hidden_state.pow(2).mean())
