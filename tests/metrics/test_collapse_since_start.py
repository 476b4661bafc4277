"""A collapse held since the first logged step is judged only after `JUDGED_AFTER` logged steps
(branches whose writes start small start collapsed and recover as training starts); one that
sets in later is judged as soon as it is sustained."""

from __future__ import annotations

from pathlib import Path

import torch

import normprobe
from normprobe.metrics import resid_cos
from normprobe.models import ResidualStack


def _collapse(log_dir: Path, scales: list[float]) -> normprobe.Flag | None:
    """A Pre-LN stack of 8 blocks under learning rate 0, fed at each step an input of RMS
    ``scales[step]``: 100 drowns the blocks' writes (collapse), 1 does not."""
    torch.manual_seed(0)
    stack = ResidualStack(8, 16)
    x = torch.randn(8, 16)
    opt = torch.optim.SGD(stack.parameters(), lr=0.0)
    with normprobe.attach(stack, opt, log_dir=str(log_dir), every=1):
        for scale in scales:
            stack(scale * x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rep = normprobe.report_run(log_dir)
    return next((f for f in rep.flags if f.kind == "representation collapse"), None)


def test_collapsed_from_the_start_is_a_note_until_judged(tmp_path: Path) -> None:
    young = _collapse(tmp_path / "young", [100.0] * (resid_cos.JUDGED_AFTER - 1))
    assert young is not None and young.value > resid_cos.COLLAPSE_COS
    assert young.severity == "note"
    assert "since the first logged step" in young.message
    assert f"judged after {resid_cos.JUDGED_AFTER} logged steps" in young.message
    judged = _collapse(tmp_path / "judged", [100.0] * resid_cos.JUDGED_AFTER)
    assert judged is not None and judged.severity == "problem"
    assert "since the first logged step" not in judged.message


def test_a_collapse_setting_in_later_is_a_problem_once_sustained(tmp_path: Path) -> None:
    flag = _collapse(tmp_path, [1.0, 1.0, 100.0, 100.0])
    assert flag is not None and flag.step == 3
    assert flag.severity == "problem"
    healthy = _collapse(tmp_path / "healthy", [1.0] * 4)
    assert healthy is None
