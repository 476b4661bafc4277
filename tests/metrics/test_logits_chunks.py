"""The ``logits`` family reads every call of the head in a forward: a head applied to chunks of
the sequence (litgpt's ``lm_head_chunk_size``) gives the statistics of all its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import normprobe
from normprobe.models import TinyTransformer


class ChunkedHead(TinyTransformer):
    """A GPT whose head runs on 4-token chunks of the sequence, as litgpt's can: the chunks
    returned as a list (litgpt) or joined."""

    joined = True

    def forward(self, idx: torch.Tensor) -> Any:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        chunks = [self.head(chunk) for chunk in self.ln_f(x).split(4, dim=1)]
        return torch.cat(chunks, dim=1) if self.joined else chunks


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "list"])
def test_a_head_applied_in_chunks_is_read_whole(tmp_path: Path, joined: bool) -> None:
    torch.manual_seed(0)
    model = ChunkedHead(width=32, depth=2, context=16)
    model.joined = joined
    with torch.no_grad():  # the largest logit in the last chunk, not the first
        model.head.weight.mul_(5)
    idx = torch.randint(0, 96, (2, 16))
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["logits"], every=1) as probe:
        with torch.no_grad():
            out = model(idx)
        probe.step()
        scalars = probe.latest.scalars if probe.latest is not None else {}
    logits = out if joined else torch.cat(out, dim=1)
    first = logits[:, :4]
    assert float(logits.abs().max()) != float(first.abs().max())  # the chunks differ
    expected = {
        "max_abs": float(logits.abs().max()),
        "rms": float(logits.pow(2).mean().sqrt()),
        "z": float(torch.logsumexp(logits, dim=-1).mean()),
    }
    for stat, value in expected.items():
        assert scalars[f"normprobe/logits/{stat}"] == pytest.approx(value, rel=1e-5)


def test_one_call_per_forward_is_unchanged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model: nn.Module = TinyTransformer(width=32, depth=2, context=16)
    idx = torch.randint(0, 96, (2, 16))
    with normprobe.attach(model, log_dir=str(tmp_path), metrics=["logits"], every=1) as probe:
        for _ in range(2):  # a second logged forward starts afresh
            with torch.no_grad():
                logits = model(idx)
            probe.step()
        scalars = probe.latest.scalars if probe.latest is not None else {}
    assert scalars["normprobe/logits/rms"] == pytest.approx(float(logits.pow(2).mean().sqrt()))
