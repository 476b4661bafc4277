"""NormProbe past data parallelism: four CPU processes over gloo, run by
tests/helpers/parallel_train.py.

Tensor parallelism with FSDP2 on a 2x2 mesh reads what one process reads on the same model,
weights and batch; what it cannot read (per-head vectors; activations under sequence
parallelism) and pipeline stages are refused by name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.distributed]

SCRIPT = Path(__file__).parents[1] / "helpers" / "parallel_train.py"
PIPELINE = "normprobe does not support pipeline parallelism"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("parallel")
    path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(out), str(rank), port],
            cwd=out,
            env={**os.environ, "PYTHONPATH": path},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=300)  # a deadlock would hang here
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"rank {rank}:\n{log[-3000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def _flat(record: dict[str, Any]) -> dict[str, float]:
    flat = dict(record["scalars"])
    for tag, values in record["profiles"].items():
        flat |= {f"{tag}[{i}]": v for i, v in enumerate(values)}
    return flat


def test_tensor_parallel_reads_what_one_process_reads(ranks: dict[int, dict[str, Any]]) -> None:
    tp, single = ranks[0]["tp"], ranks[0]["single"]
    heads = ("attn_head_", "attn_heads_over_tau", "attn_logits_head/")  # refused: see below
    for step in ("0", "1"):
        got, want = _flat(tp[step]), _flat(single[step])
        kept = {t: v for t, v in want.items() if not any(h in t for h in heads)}
        assert len(kept) > 80  # every block's gradients, weights, streams, norms, attention
        assert got.keys() == kept.keys()
        for tag, value in kept.items():
            assert got[tag] == pytest.approx(value, rel=1e-5, nan_ok=True), tag
    for rank in range(4):  # every rank holds the combined values
        assert json.dumps(ranks[rank]["tp"]["1"]) == json.dumps(tp["1"])
        assert ranks[rank]["tp"]["hooks_left"] == ranks[rank]["tp"]["hooks"]


def test_tensor_parallel_refuses_per_head_vectors_by_name(
    ranks: dict[int, dict[str, Any]],
) -> None:
    tp = ranks[0]["tp"]
    assert "attn_logits_head" not in tp["metrics"] and "attn_logits" in tp["metrics"]
    (warning,) = tp["warnings"]  # the default metrics: a warning, the family left out
    assert warning.startswith("normprobe cannot read attn_logits_head on FSDPNet")
    assert "each rank holds some of the heads" in warning
    chosen = ranks[0]["tp_heads"]  # chosen by name: attach raises
    assert chosen.startswith("ValueError: normprobe cannot read attn_entropy")
    assert "blocks.0.attn.q.weight" in chosen and "ColwiseParallel / RowwiseParallel" in chosen


def test_sequence_parallel_keeps_only_parameter_statistics(
    ranks: dict[int, dict[str, Any]],
) -> None:
    for rank in range(4):
        assert ranks[rank]["sp"].startswith("ValueError: normprobe cannot read resid_rms")
        assert "activations sharded across ranks" in ranks[rank]["sp"]
        assert ranks[rank]["sp_metrics"] == [
            "grad_norm", "update_ratio", "weight_rms", "norm_gain", "spikes",
        ]  # fmt: skip


def test_pipeline_stages_are_refused(ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        seen = ranks[rank]
        assert seen["stage"].startswith(f"RuntimeError: {PIPELINE}")
        assert seen["stage"].endswith("module of a torch.distributed.pipelining PipelineStage")
        assert seen["schedule"].endswith("the model runs in a pipelining schedule")
        assert seen["blocks"].endswith("the ranks probe different blocks")
