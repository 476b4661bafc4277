"""The examples run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tb import read_events

from normprobe import tags

pytestmark = pytest.mark.subprocess

EXAMPLES = Path(__file__).parents[2] / "examples"
# threads that sleep when idle (as test_claims.py): spinning ones slow small models many times
# over when the cores are shared
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def test_lightning_transformer_example(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_transformer.py"), "--steps", "12",
         "--root", str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "lightning_logs" / "version_0"
    assert f"tensorboard --logdir {run}" in done.stdout
    events = read_events(str(run))
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]] == [0, 9]
    assert [s for s, _ in events.scalars["train_loss"]] == [9]


def test_hf_trainer_example(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_trainer.py"), "--steps", "10",
         "--output-dir", str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = sorted({p.parent for p in tmp_path.rglob("events.out.tfevents.*")})
    events = read_events(str(run))
    # the Trainer's loss and the probe's metrics on the same steps, in the same run
    assert [s for s, _ in events.scalars["train/loss"]] == [1, 10]
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "transformer.h")]] == [1, 10]
