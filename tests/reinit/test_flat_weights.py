"""Weight layers that keep their matrix as a flat vector and reshape it in the forward (e3nn's
``o3.Linear`` and tensor products): no scheme can read a fan-in from a vector, so every scheme
keeps it, says so, and zeroes only what is named a bias. Zeroing it as a bias, as kaiming,
xavier and fixup did, erased the layer: the network's output became exactly 0."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normprobe


class FlatLinear(nn.Module):
    """A linear map whose matrix is stored flat, as e3nn stores its weights."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.shape = (n_out, n_in)
        self.weight = nn.Parameter(torch.randn(n_out * n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.full((n_out,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.view(self.shape), self.bias)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = FlatLinear(width, 2 * width)
        self.down = FlatLinear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(8) for _ in range(3)], nn.LayerNorm(8))


X = torch.randn(4, 8)


@pytest.mark.parametrize("scheme", ["kaiming", "xavier", "gpt2", "fixup"])
def test_flat_weights_kept_biases_zeroed(scheme: str) -> None:
    model = _net()
    layers = [(i, name, getattr(model[i], name)) for i in range(3) for name in ("up", "down")]
    before = {(i, name): (m.weight.detach().clone(), m) for i, name, m in layers}
    options = {"allow_norms": True} if scheme == "fixup" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = normprobe.reinit_with_report(model, scheme, example_inputs=(X,), **options)
    for (i, name), (weight, m) in before.items():
        if scheme == "fixup" and name == "down":  # Fixup zeroes the last layer of a branch
            assert torch.count_nonzero(m.weight) == 0, (i, name)
        else:
            assert torch.equal(m.weight, weight), f"{scheme} changed the flat weight {i}.{name}"
        assert torch.count_nonzero(m.bias) == 0, (i, name)  # every scheme zeroes biases
    kept = [w for w in caught if "vector(s) of weight layers that are not biases" in str(w.message)]
    assert kept, f"{scheme} kept flat weights without saying so"
    flat = re.compile(r"0\.up\.(inner\.)?weight")  # fixup wraps the layers it scales
    assert flat.search(str(kept[0].message))
    assert any(flat.fullmatch(name) and "no bias" in why for name, why in report.left)
    assert model(X).abs().sum() > 0
