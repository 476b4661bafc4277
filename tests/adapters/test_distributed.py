"""NormProbe under Lightning's DDP strategy: two CPU processes talking over gloo."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tb import read_events

from normprobe import tags

pytestmark = [pytest.mark.subprocess, pytest.mark.distributed]

SCRIPT = Path(__file__).parents[1] / "helpers" / "ddp_train.py"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("ddp")
    path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a deadlock would hang here
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return out, ranks


@pytest.mark.slow
def test_gradient_norms_are_the_synchronized_ones(ddp_run: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    out, ranks = ddp_run
    events = read_events(str(out / "ddp" / "version_0"))
    assert ranks[0]["grads"] == ranks[1]["grads"]  # DDP averaged them
    for block in range(3):
        series = events.scalars[tags.format("grad_norm", "net.blocks", block)]
        assert [s for s, _ in series] == [0, 1, 3]
        for step, value in series:
            assert value == pytest.approx(ranks[0]["grads"][str(step)][block], rel=1e-5)


def test_activation_statistics_combine_all_ranks(ddp_run: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    out, ranks = ddp_run
    events = read_events(str(out / "ddp" / "version_0"))
    local = [ranks[r]["local"] for r in (0, 1)]
    for step, value in events.scalars[tags.format("logits", "max_abs")]:
        assert value == pytest.approx(max(seen[str(step)]["logits_max"] for seen in local))
    for block in range(3):
        for step, value in events.scalars[tags.format("resid_rms", "net.blocks", block)]:
            there = [
                seen[str(step)][f"resid_{block}"]
                for seen in local
                if f"resid_{block}" in seen[str(step)]
            ]
            # rank 1 skipped the last block on step 1: only rank 0's value counts there
            assert len(there) == (1 if (step, block) == (1, 2) else 2)
            want = math.sqrt(sum(v * v for v in there) / len(there))
            assert value == pytest.approx(want, rel=1e-5)


def test_one_collective_per_logged_step_and_rank_zero_writes(ddp_run: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    _, ranks = ddp_run
    for rank in (0, 1):
        assert ranks[rank]["collectives"] == {"0": 1, "1": 1, "2": 0, "3": 1}
    assert (ranks[0]["sinks"], ranks[1]["sinks"]) == (1, 0)
