"""NormProbe past data parallelism: four CPU processes over gloo, run by
tests/helpers/parallel_train.py.

Tensor parallelism with FSDP2 on a 2x2 mesh reads what one process reads on the same model,
weights and batch, with sequence parallelism or not; what it cannot read (per-channel outlier
statistics under sequence parallelism, the logits of a split output head) is refused by name.
Pipeline parallelism: tests/adapters/test_pipeline.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launch import flat, run_ranks

pytestmark = [pytest.mark.subprocess, pytest.mark.distributed]

SCRIPT = Path(__file__).parents[1] / "helpers" / "parallel_train.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return run_ranks(SCRIPT, tmp_path_factory.mktemp("parallel"), 4)


def test_tensor_parallel_reads_what_one_process_reads(ranks: dict[int, dict[str, Any]]) -> None:
    tp, single = ranks[0]["tp"], ranks[0]["single"]
    assert tp["metrics"] == single["metrics"] and "attn_logits_head" in tp["metrics"]
    assert tp["warnings"] == []
    for step in ("0", "2"):
        got, want = flat(tp[step]), flat(single[step])
        # every block's gradients, weights, streams, norms, attention heads, and the logits
        assert len(want) > 150
        assert got.keys() == want.keys()
        for tag, value in want.items():
            assert got[tag] == pytest.approx(value, rel=1e-5, nan_ok=True), tag
    for rank in range(4):  # every rank holds the combined values
        assert json.dumps(ranks[rank]["tp"]["2"]) == json.dumps(tp["2"])
        assert ranks[rank]["tp"]["hooks_left"] == ranks[rank]["tp"]["hooks"]
        # one collective per logged step (0 and 2), none on others: none under DTensor's ops
        assert ranks[rank]["tp"]["collectives"] == [1, 0, 1]


def test_a_split_output_head_refuses_logits_by_name(ranks: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        refused = ranks[rank]["head"]
        assert refused.startswith("ValueError: normprobe cannot read logits on FSDPNet")
        assert "the output head (head) is ColwiseParallel, its logits split" in refused
        assert "blocks.0.attn.q.weight" in refused
        assert "parallelize_module with ColwiseParallel, RowwiseParallel" in refused


def test_sequence_parallel_reads_its_part_of_the_sequence(
    ranks: dict[int, dict[str, Any]],
) -> None:
    """Each rank reads half of the sequence (a DTensor's local part): RMS, cosines, attention
    maxima and entropies, the logits of the head that gathers the sequence back combine to the
    whole's; per-channel outlier statistics would not."""
    sp, single = ranks[0]["sp"], ranks[0]["single"]
    assert "outliers" not in sp["metrics"] and sp["warnings"] == []
    for step in ("0", "2"):
        got, want = flat(sp[step]), flat(single[step])
        gone = {t for t in want if t.startswith("normprobe/outlier")}
        assert got.keys() == want.keys() - gone and len(got) > 130
        for tag, value in got.items():
            assert value == pytest.approx(want[tag], rel=1e-5, nan_ok=True), tag
    for rank in range(4):
        assert ranks[rank]["sp"]["collectives"] == [1, 0, 1]
        assert ranks[rank]["sp_outliers"].startswith(
            "ValueError: normprobe cannot read outliers on FSDPNet"
        )
    said = ranks[0]["sp_defaults"]  # the default metrics: a warning, outliers left out
    assert said.startswith("RuntimeWarning: normprobe cannot read outliers on FSDPNet")
    assert "sequence parallelism (blocks.0.attn.out: RowwiseParallel)" in said
    assert ranks[1]["sp_defaults"] == "none"  # rank 0 alone warns
