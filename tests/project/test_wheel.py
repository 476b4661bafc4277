"""The built wheel installs into a fresh virtual environment and works from there."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).parents[2]


def _run(*cmd: str | Path, cwd: Path) -> str:
    # without PYTHONPATH: a checkout on it would be imported instead of the installed wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_wheel_installs_and_runs_in_a_fresh_environment(tmp_path: Path) -> None:
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        tmp_path / "dist",
        ROOT,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("normprobe-*.whl")
    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", env, cwd=tmp_path)
    python = env / "bin" / "python"
    # the dependencies (torch, tensorboard, ...) from this environment, not normprobe itself: a
    # path added by a .pth file is searched after the new environment's own site-packages
    env_site = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
        ).strip()
    )
    ours = {sysconfig.get_path("purelib"), *site.getsitepackages()}
    (env_site / "normprobe_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    _run(python, "-m", "pip", "install", "--no-deps", "-q", wheel, cwd=tmp_path)
    assert "report" in _run(env / "bin" / "normprobe", "--help", cwd=tmp_path)
    script = (
        "import normprobe, torch, pathlib\n"
        f"assert pathlib.Path(normprobe.__file__).is_relative_to({str(env)!r})\n"
        "from normprobe.models import ResidualStack\n"
        "m = ResidualStack(4, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "sink = normprobe.MemorySink()\n"
        "with normprobe.attach(m, opt, sinks=[sink], every=1):\n"
        "    m(torch.randn(2, 8)).sum().backward(); opt.step()\n"
        "print(sorted(sink.records[0].scalars)[0])\n"
    )
    assert _run(python, "-c", script, cwd=tmp_path).startswith("normprobe/")
