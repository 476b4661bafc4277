"""The runs several report tests read (tests/helpers/report_runs.py), each trained once for the
session: every one seeds itself, so a test reads what it would have trained."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from report_runs import check_d_stack, healthy_lm

import normprobe
from normprobe.metrics import resid_cos


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``healthy`` (logged every 2 steps: 0, 2, 4, 6, 8); sanity check [d]'s stack Pre-LN and
    Post-LN, alone side by side in one folder; Pre-LN with an input 100x the blocks' writes
    (representation collapse, a problem)."""
    root = tmp_path_factory.mktemp("report_runs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)  # what a model lacks
        return {
            "healthy": healthy_lm(root / "healthy"),
            "stack_pre": check_d_stack(root / "stacks" / "pre", pre_ln=True),
            "stack_post": check_d_stack(root / "stacks" / "post", pre_ln=False),
            # collapsed from the first logged step: judged after resid_cos.JUDGED_AFTER of them
            "stack_large_input": check_d_stack(
                root / "large", pre_ln=True, input_scale=100.0, steps=resid_cos.JUDGED_AFTER
            ),
        }
