"""NormProbe on a pipeline (``torch.distributed.pipelining``): two CPU processes over gloo, the
2 stages of a 4-block pre-LN transformer, run by tests/helpers/pipeline_train.py.

Under GPipe (the stages' blocks in a sliced ``ModuleList``) and 1F1B (in a ``ModuleDict``
under their global keys) with 2 micro-batches every value is what one process reads on the same
weights and whole batch: blocks under their global numbers, statistics of both micro-batches,
the stack's ratios over both stages; one collective a logged step, rank 0 alone writes, no hook
stays. What cannot be read that way is refused at attach, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launch import flat, run_ranks

pytestmark = [pytest.mark.subprocess, pytest.mark.distributed]

SCRIPT = Path(__file__).parents[1] / "helpers" / "pipeline_train.py"
PASS_STAGE = "normprobe probes a pipeline stage when attach() is given it"
# the clip factor: gradients are read at the optimizer step (the schedule scales them after
# the last backward), where clipping cannot be told apart
ABSENT = {"normprobe/grad_clip_factor/model"}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def ranks(out: Path) -> dict[int, dict[str, Any]]:
    return run_ranks(SCRIPT, out, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_read_what_one_process_reads(
    ranks: dict[int, dict[str, Any]], schedule: str
) -> None:
    staged, single = ranks[0][schedule], ranks[0]["single"]
    assert staged["warnings"] == []
    for step in ("0", "2"):
        got, want = flat(staged[step]), flat(single[step])
        assert len(want) > 120 and got.keys() == want.keys() - ABSENT
        # blocks 2 and 3 are stage 1's, under their global numbers; block 2's cosine is with
        # the stream stage 0 handed on
        assert {"normprobe/grad_norm/blocks/3", "normprobe/resid_cos/blocks/2"} < got.keys()
        for tag, value in got.items():
            assert value == pytest.approx(want[tag], rel=1e-5, nan_ok=True), tag
        # the stack's ratios span both stages
        for series in ("grad_ratio", "resid_growth", "resid_slope"):
            tag = f"normprobe/{series}/blocks"
            assert got[tag] == pytest.approx(want[tag], rel=1e-5), tag
    for rank in (0, 1):
        seen = ranks[rank][schedule]
        assert json.dumps(seen["2"]) == json.dumps(staged["2"])  # every stage holds the whole
        assert seen["hooks_left"] == seen["hooks"]
        assert seen["collectives"] == [1, 0, 1]  # one a logged step (0 and 2), none between


def test_a_record_larger_than_the_buffer_widens_it(ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert ranks[rank]["exchange"] == {"sizes": [20, 21], "capacity": 42, "calls": 2}


def test_rank_zero_alone_writes(ranks: dict[int, dict[str, Any]], out: Path) -> None:
    for schedule in ("gpipe", "1f1b"):
        assert list((out / f"{schedule}0").glob("events.out.tfevents.*"))
        assert not list((out / f"{schedule}1").glob("events.out.tfevents.*"))


def test_layouts_that_cannot_be_combined_are_refused(ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        seen = ranks[rank]
        assert seen["stage"] == (
            "RuntimeError: Net is the module of a torch.distributed.pipelining PipelineStage: "
            f"{PASS_STAGE}: attach(stage_module, opt, pipeline=stage, "
            "example_inputs=(stage_input,))"
        )
        assert seen["no_inputs"].startswith("ValueError: attach(..., pipeline=stage) maps")
        assert seen["outliers"].startswith("ValueError: normprobe cannot read outliers on Net")
        assert "do not combine into the batch's" in seen["outliers"]
        assert seen["uneven"] == (
            "RuntimeError: normprobe numbers a stack's blocks across pipeline stages when every "
            "stage holds part of the same stacks (at least 2 blocks of each), and found stage 0: "
            "blocks (3 blocks); stage 1: no stack"
        )
        assert seen["data_parallel"] == (
            "RuntimeError: normprobe cannot combine pipeline parallelism (1 stages) with data "
            "parallelism (2 ranks): ranks would be combined both as stages and as copies; probe "
            "one pipeline (its stages in the default process group)"
        )
        assert seen["looped"] == (
            "RuntimeError: normprobe cannot probe 4 stages on 2 ranks (an interleaved or "
            "looped schedule): each rank must hold one stage"
        )
        # stages run by hand, no PipelineStage: found at the first logged step
        assert seen["blocks"].startswith("RuntimeError: the ranks probe different blocks")
        assert PASS_STAGE in seen["blocks"]
