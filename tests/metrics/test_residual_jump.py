"""A residual jump is one layer writing far more than the rest: a block whose stream is 10x the
one before it, and whose write is more than 3x the median write of the blocks after it. A
jump whose block writes as the later ones do says the stream before it was small."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from olmo2 import train_olmo2
from tb import read_events
from torch import nn

import normprobe
from normprobe import tags
from normprobe.metrics import resid_rms
from normprobe.models import TinyTransformer


def _jump(report: normprobe.RunReport) -> normprobe.Flag | None:
    return next((f for f in report.flags if f.kind == "residual jump"), None)


def _train_frozen(model: TinyTransformer, log_dir: Path) -> None:
    """Three logged steps at learning rate 0: the stream profile stays the init's."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(log_dir), every=1):
            for _ in range(3):
                x = torch.randint(0, 96, (4, 16))
                model.loss(x, x).backward()
                opt.step()


def test_olmo2_whose_first_blocks_write_little_has_no_jump(tmp_path: Path) -> None:
    """transformers' OLMo-2 at width 64: its post norms' eps outweighs the first blocks' tiny
    branch outputs, so blocks 0 and 1 write 0.07 and 0.5 where the later ones write 1-1.4; the
    stream leaving block 1 is 7-12x block 0's in a healthy run."""
    train_olmo2(tmp_path, layers=6, steps=4, batch=(8, 33))
    scalars = read_events(str(tmp_path)).scalars
    profile = [dict(scalars[tags.format("resid_rms", "model.layers", b)])[3] for b in range(6)]
    assert profile[1] / profile[0] > resid_rms.JUMP_LIMIT / 2  # a jump by the ratio alone
    assert _jump(normprobe.report_run(tmp_path)) is None


def test_one_block_scaled_up_is_a_jump_even_right_after_the_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=6, context=16)

    def scaled(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 1e3

    model.blocks[1].mlp.register_forward_hook(scaled)
    _train_frozen(model, tmp_path)
    flag = _jump(normprobe.report_run(tmp_path))
    assert flag is not None and flag.severity == "problem"
    assert "leaving block 1 has" in flag.message and flag.value > resid_rms.JUMP_LIMIT


def test_a_last_block_writing_more_than_quiet_peers_is_no_jump(tmp_path: Path) -> None:
    """transformers' OLMo-hybrid: two linear-attention layers whose writes start near 0.01, then
    one full-attention layer writing about 1. The stream leaving the last block is 35x the one
    before it in a healthy run; with no block after it, nothing says that layer blew up."""
    torch.manual_seed(0)
    model = TinyTransformer(width=32, depth=3, context=16)

    def loud(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 1e2  # the first two blocks' writes stay at GPT-2's small init

    model.blocks[2].attn.register_forward_hook(loud)
    model.blocks[2].mlp.register_forward_hook(loud)
    _train_frozen(model, tmp_path)
    scalars = read_events(str(tmp_path)).scalars
    profile = [dict(scalars[tags.format("resid_rms", "blocks", b)])[2] for b in range(3)]
    assert profile[2] / profile[1] > resid_rms.JUMP_LIMIT  # a jump by the ratio alone
    assert _jump(normprobe.report_run(tmp_path)) is None
