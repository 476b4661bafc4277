"""Norms whose input holds all-zero slices: a padding token's embedding row, a blank pixel.

An RMS norm maps a zero row to zeros whatever its statistics, so a probe that perturbs an
element of that row sees nothing move and cannot tell which entries share statistics. The
middle position of the examples below is such a slice on purpose.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normprobe

PAD = 3


class UserRMSNorm(nn.Module):
    """An RMSNorm of user code over the last dim (found by its name, kind by behaviour)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class PixelScale(nn.Module):
    """StyleGAN's pixel norm: each pixel's channel vector over its RMS (no name any rule
    knows, no parameters): found by behaviour alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-8)


class PaddedLM(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width, padding_idx=PAD)
        self.norms = nn.ModuleList(UserRMSNorm(width) for _ in range(depth))
        self.fcs = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.final = UserRMSNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, fc in zip(self.norms, self.fcs, strict=True):
            h = h + fc(norm(h))
        return self.final(h)


class BlankPixelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 1, bias=False)
        self.norm = PixelScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


def _padded_ids() -> torch.Tensor:
    ids = torch.randint(4, 32, (3, 5))
    ids[1, 2] = PAD  # the middle position: an all-zero embedding row
    ids[2, :2] = PAD
    return ids


def test_rmsnorm_reading_a_padding_row_is_an_rmsnorm() -> None:
    torch.manual_seed(0)
    model = PaddedLM()
    ids = _padded_ids()
    assert model.embed(ids)[1, 2].abs().max() == 0  # the row the old probe perturbed
    found = normprobe.discover(model, ids)
    kinds = {n.path: (n.kind, n.layout, n.dims) for n in found.norms}
    assert kinds == {p: ("rmsnorm", "channels-last", (16,)) for p in kinds}
    assert set(kinds) == {"norms.0", "norms.1", "final"}
    assert not [d for d in found.doubts if d.kind == "unknown-norm"]


def test_convert_norms_converts_them_and_keeps_the_output() -> None:
    torch.manual_seed(0)
    model = PaddedLM()
    ids = _padded_ids()
    with torch.no_grad():
        before = model(ids)
    normprobe.convert_norms(model, "rmsnorm", example_inputs=(ids,))
    assert all(isinstance(n, nn.RMSNorm) for n in (*model.norms, model.final))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::normprobe.DiscoveryWarning")  # no residual adds
@pytest.mark.parametrize("blank", ["middle pixel", "middle image"])
def test_pixel_norm_around_blank_pixels_is_found(blank: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 5)
    if blank == "middle pixel":
        x[1, :, 2, 2] = 0
    else:
        x[1] = 0
    found = normprobe.discover(BlankPixelNet(), x)
    (norm,) = found.norms
    assert (norm.path, norm.kind, norm.layout) == ("norm", "rmsnorm", "channels-first")
    assert norm.recognized_by.startswith("behaviour")


def test_transformers_helium_converts_on_its_dummy_inputs() -> None:
    """Helium's dummy inputs hold its pad token (id 3, an all-zero embedding row), and
    `convert_norms` without example inputs discovers on them: its HeliumRMSNorm layers are
    RMSNorms, converted with the output unchanged."""
    from transformers import HeliumConfig, HeliumModel

    torch.manual_seed(0)
    config = HeliumConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = HeliumModel(config).eval()
    assert config.pad_token_id in model.dummy_inputs["input_ids"]
    ids = torch.randint(4, 64, (2, 8))
    with torch.no_grad():
        before = model(ids).last_hidden_state
    model = normprobe.convert_norms(model, "rmsnorm")
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == 2 * 2 + 1
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, before, rtol=1e-5, atol=1e-5)
