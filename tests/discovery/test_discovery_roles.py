"""Norm roles where the norm's output is not read as it comes out: a pre-activation feeding a
block's branch and its projection shortcut, a list of post norms that skips the first sum."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import normprobe


class PreActUnit(nn.Module):
    """Pre-activation residual unit (He et al. 2016, "Identity Mappings"): ``pre = act(bn(x))``
    feeds the branch and, when the shape changes, the projection shortcut
    (``shortcut_reads="pre"``) or the projection reads the stream (``"stream"``)."""

    def __init__(self, c_in: int, c_out: int, act: Callable[[], nn.Module], shortcut_reads: str):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.act1 = act()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act2 = act()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.proj = nn.Conv2d(c_in, c_out, 1, bias=False) if c_in != c_out else None
        self.shortcut_reads = shortcut_reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act1(self.bn1(x))
        out = self.conv2(self.act2(self.bn2(self.conv1(pre))))
        if self.proj is None:
            return out + x
        return out + self.proj(pre if self.shortcut_reads == "pre" else x)


class PreActNet(nn.Module):
    """Stem conv, two stages of two units (the first of stage 2 widens: a projection add),
    a final BN and a linear head."""

    def __init__(self, act: Callable[[], nn.Module], shortcut_reads: str = "pre") -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        widths = [(8, 8), (8, 8)], [(8, 16), (16, 16)]
        self.stages = nn.ModuleList(
            nn.Sequential(*(PreActUnit(i, o, act, shortcut_reads) for i, o in stage))
            for stage in widths
        )
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(torch.relu(self.bn(x)).mean((2, 3)))


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu-inplace": lambda: nn.ReLU(inplace=True),
    "gelu": nn.GELU,
    "silu-then-identity": lambda: nn.Sequential(nn.SiLU(), nn.Identity()),
}


@pytest.mark.parametrize("act", list(_ACTIVATIONS))
def test_pre_activation_feeding_branch_and_projection_is_pre(act: str) -> None:
    # every unit's bn1 normalizes the stream its branch reads: 4 pre, 4 branch (bn2), 1 final;
    # stages.1.0's bn1 also feeds the projection shortcut, through the activation
    m = normprobe.discover(PreActNet(_ACTIVATIONS[act]), torch.randn(2, 3, 8, 8))
    roles = {n.path: n.role for n in m.norms}
    assert roles == {
        **{f"stages.{s}.{u}.bn1": "pre" for s in (0, 1) for u in (0, 1)},
        **{f"stages.{s}.{u}.bn2": "branch" for s in (0, 1) for u in (0, 1)},
        "bn": "final",
    }
    assert [(a.module, a.kind, a.pre_norm) for a in m.residual_adds] == [
        (f"stages.{s}.{u}", "projection" if (s, u) == (1, 0) else "identity", f"stages.{s}.{u}.bn1")
        for s in (0, 1)
        for u in (0, 1)
    ]


def test_projection_reading_the_stream_leaves_the_pre_activation_pre() -> None:
    # the shortcut reads x, not act(bn1(x)): bn1 still normalizes the branch's input only
    m = normprobe.discover(PreActNet(nn.ReLU, shortcut_reads="stream"), torch.randn(2, 3, 8, 8))
    assert m.norm("stages.1.0.bn1").role == "pre"
    assert m.residual_adds[2].pre_norm == "stages.1.0.bn1"


class PostActUnit(nn.Module):
    """Post-activation unit with a projection shortcut reading the unit's input."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.proj = nn.Conv2d(c_in, c_out, 1, bias=False) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.proj is None else self.proj(x)))


def test_stem_activation_feeding_a_projection_block_is_not_its_pre_norm() -> None:
    # conv -> bn -> relu -> a first unit whose branch and projection both read relu's output:
    # the stem's BN is outside the unit, it normalizes what the whole stack reads, no branch
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    units = nn.Sequential(PostActUnit(8, 16), PostActUnit(16, 16))
    m = normprobe.discover(nn.Sequential(stem, units), torch.randn(2, 3, 8, 8))
    assert m.norm("0.1").role != "pre"
    assert [a.pre_norm for a in m.residual_adds] == [None, None]


class PreNormMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.net = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x))


class PostNormList(nn.Module):
    """Sublayers in one flat list; a list of post norms on every sum but the first (as KEEL,
    Chen et al. 2025, in vit-pytorch's ``vit_with_keel_post_ln.py``)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(PreNormMLP(width) for _ in range(depth))
        self.post_norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth - 1))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i, layer in enumerate(self.layers):
            x = layer(x) + x if i == 0 else self.post_norms[i - 1](layer(x) + x)
        return self.head(x)


def test_last_of_a_post_norm_list_skipping_the_first_sum_is_post() -> None:
    # 4 adds; post_norms.k normalizes sum k+1 and nothing else reads it, so all three are
    # post, the last too: the first sum has no norm, the other two of three do
    m = normprobe.discover(PostNormList(), torch.randn(2, 5, 16))
    assert {f"post_norms.{k}": m.norm(f"post_norms.{k}").role for k in range(3)} == dict.fromkeys(
        (f"post_norms.{k}" for k in range(3)), "post"
    )
    assert [a.post_norm for a in m.residual_adds] == [None, *(f"post_norms.{k}" for k in range(3))]
    assert {m.norm(f"layers.{k}.norm").role for k in range(4)} == {"pre"}
