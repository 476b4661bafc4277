"""A residual stream that compounds, multiplied by a factor at every block, is a problem; Pre-LN's
stream grows by adding writes (sqrt(l)), a note. x-transformers 2.31.10's hyper-connections sum
their four streams at every sublayer (the mixing matrix degenerates to all ones): 16x a block."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from olmo2 import train_olmo2
from tb import read_events
from torch import nn

import normprobe
from normprobe import tags
from normprobe.metrics import resid_rms


class ScaledSkip(nn.Module):
    """``skip * x + f(x)``, its branch zero at init."""

    def __init__(self, width: int, skip: float) -> None:
        super().__init__()
        self.skip = skip
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip * x + self.fc(self.norm(x))


class Stack(nn.Module):
    def __init__(self, skip: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ScaledSkip(16, skip) for _ in range(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _growth_flags(log_dir: Path) -> list[normprobe.Flag]:
    return [f for f in normprobe.report_run(log_dir).flags if f.kind == "residual growth"]


@pytest.mark.parametrize("skip", [1.0, 3.0])
def test_a_skip_scaled_up_at_every_block_compounds(tmp_path: Path, skip: float) -> None:
    # lr 0: the branches stay zero, so block b's stream is skip**(b + 1) times the input's
    torch.manual_seed(0)
    model = Stack(skip)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
            for _ in range(3):
                model(x).pow(2).mean().backward()
                opt.step()
    scalars = read_events(str(tmp_path)).scalars
    rms = [dict(scalars[tags.format("resid_rms", "blocks", b)])[2] for b in range(5)]
    x_rms = float(x.pow(2).mean().sqrt())
    assert rms == pytest.approx([x_rms * skip ** (b + 1) for b in range(5)], rel=1e-5)
    flags = _growth_flags(tmp_path)
    if skip == 1.0:
        assert flags == []
        return
    (flag,) = flags
    assert (flag.severity, flag.threshold) == ("problem", resid_rms.COMPOUND_LIMIT)
    assert flag.value == pytest.approx(3.0, rel=1e-5)
    assert "multiplied by 3 at the typical block" in flag.message


def test_x_transformers_hyper_connections_compound(tmp_path: Path) -> None:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    layers = Decoder(dim=32, depth=4, heads=2, num_residual_streams=4)
    model = TransformerWrapper(num_tokens=64, max_seq_len=32, attn_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 64, (8, 33))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=1):
            for _ in range(3):
                logits = model(data[:, :-1])
                F.cross_entropy(logits.transpose(1, 2), data[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
    scalars = read_events(str(tmp_path)).scalars
    stack = "attn_layers.layers"
    rms = [dict(scalars[tags.format("resid_rms", stack, b)])[0] for b in range(4)]
    # each block's two sublayers sum the four streams: 4 x 4
    assert [round(math.log(v / u, 16), 2) for u, v in itertools.pairwise(rms)] == [1.0] * 3
    (flag,) = _growth_flags(tmp_path)
    assert flag.severity == "problem" and flag.value == pytest.approx(16, rel=0.01)


def test_olmo2_three_blocks_healthy_is_no_compounding(tmp_path: Path) -> None:
    """transformers' OLMo-2, three blocks of width 64: its post norms' eps outweighs the first
    blocks' small branch outputs at init, so the stream reads about 0.08, 0.6, 1.4 (writes 0.08,
    0.6, 1.3: it grows by adding) while the loss falls; the first ratio (7) said the stream
    compounds."""
    train_olmo2(tmp_path, layers=3, steps=15, batch=(2, 16))
    scalars = read_events(str(tmp_path)).scalars
    growth = dict(scalars[tags.format("resid_growth", "model.layers")])
    assert max(growth.values()) > resid_rms.GROWTH_LIMIT
    problems = [f for f in normprobe.report_run(tmp_path).flags if f.severity == "problem"]
    assert problems == []
