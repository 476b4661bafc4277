"""A sum of a layer's branch and an attention branch is no projection shortcut: torch runs
``nn.MultiheadAttention``'s projections as one op, which looked like a shortcut's single layer
(PyG's GPSConv: ``norm1(local(x) + x) + norm2(attn(x) + x)``)."""

from __future__ import annotations

import torch
from torch import nn

import normprobe

WIDTH = 16


class GPSLayer(nn.Module):
    """GPSConv's layout: a local branch and global attention, each Post-LN, their sum then a
    Post-LN feed-forward."""

    def __init__(self) -> None:
        super().__init__()
        self.local = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(WIDTH) for _ in range(3))
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.norm1(self.local(x) + x)
        h2 = self.norm2(self.attn(x, x, x, need_weights=False)[0] + x)
        out = h1 + h2
        return self.norm3(out + self.mlp(out))


def test_an_attention_branch_is_no_projection_shortcut() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[GPSLayer() for _ in range(3)])
    found = normprobe.discover(model, torch.randn(2, 5, WIDTH))
    assert not any(a.kind == "projection" for a in found.residual_adds)
    roles = {n.path.rpartition(".")[2]: n.role for n in found.norms if n.path.startswith("0.")}
    assert roles == {"norm1": "post", "norm2": "post", "norm3": "post"}
