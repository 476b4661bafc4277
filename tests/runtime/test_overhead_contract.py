"""The overhead contract that needs no clock: memory and work on logged and unlogged steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from memory import peak_bytes

import normprobe
from normprobe.models import TinyTransformer


@pytest.mark.slow
def test_peak_memory_grows_less_than_two_percent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=256, depth=12, context=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 96, (4, 128))

    def step() -> None:
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer states exist from here on
    resident = sum(t.numel() * t.element_size() for t in model.parameters())
    resident += sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    bare = resident + peak_bytes(step)
    with normprobe.attach(model, opt, log_dir=str(tmp_path), every=2):
        logged = resident + peak_bytes(step)  # step 0: every metric is computed
        unlogged = resident + peak_bytes(step)
    assert unlogged <= bare * 1.02
    assert logged <= bare * 1.02, f"logged step peak {logged / bare:.4f} x the bare peak"
