"""The `normprobe` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normprobe
from normprobe.models import ResidualStack

pytestmark = pytest.mark.subprocess


def _normprobe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "normprobe", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_diagnose_and_report_subcommands(tmp_path: Path) -> None:
    (tmp_path / "entry.py").write_text(
        "import torch\n"
        "from normprobe.models import ResidualStack\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return ResidualStack(48, 64), torch.randn(16, 64)\n"
    )
    done = _normprobe("diagnose", "entry:build", "--path", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # findings: no final norm, residual growth
    assert "Pre-LN stack without a final norm" in done.stdout

    model = ResidualStack(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with normprobe.attach(model, opt, log_dir=str(tmp_path / "run"), every=1):
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    done = _normprobe("report", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    assert "lins" in done.stdout and "grad_ratio" in done.stdout
    missing = _normprobe("report", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "nowhere" in missing.stderr + missing.stdout
