"""The output head is read where its module's own forward applied the weight. A tied embedding
applied by the parent (``x @ emb.weight.T``, x-transformers' ``tie_embedding``) leaves no
module returning the logits: hooking the embedding would read the lookup as logits, so there
is no head and no `logits` family, rather than a wrong one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tb import read_events
from torch import nn

import normprobe


class TiedLM(nn.Module):
    def __init__(self, tied: bool, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.tied = tied
        self.emb = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)
        if tied:
            del self.out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for norm, fc in zip(self.norms, self.fcs, strict=True):
            x = x + fc(norm(x))
        x = self.norm(x)
        return x @ self.emb.weight.T if self.tied else self.out(x)


@pytest.mark.parametrize("tied", [False, True])
def test_a_head_is_the_module_whose_forward_made_the_logits(tmp_path: Path, tied: bool) -> None:
    torch.manual_seed(0)
    model = TiedLM(tied)
    ids = torch.randint(0, 50, (4, 8))
    assert normprobe.discover(model, ids).head == (None if tied else "out")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1, metrics=["logits"]):
            logits = model(ids)
            logits.sum().backward()
            opt.step()
    scalars = read_events(str(tmp_path)).scalars
    if tied:
        assert not [t for t in scalars if "/logits/" in t]
        return
    assert scalars["normprobe/logits/max_abs"] == [(0, pytest.approx(float(logits.abs().max())))]


def test_x_transformers_tied_embedding_has_no_head() -> None:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    layers = Decoder(dim=16, depth=2, heads=2)
    ids = torch.randint(0, 32, (2, 8))
    for tie in (False, True):
        model = TransformerWrapper(
            num_tokens=32, max_seq_len=16, attn_layers=layers, tie_embedding=tie
        )
        assert normprobe.discover(model, ids).head == (None if tie else "to_logits")
