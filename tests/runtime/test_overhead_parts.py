"""``benchmarks/overhead.py --parts``: each family's own time on a logged step, read by wrapping
the callables families hand the probe; the wrapping is undone afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import normprobe
from normprobe.models import ResidualStack
from normprobe.runtime import hooks, modes, plan

sys.path.append(str(Path(__file__).parents[2] / "benchmarks"))  # a folder, no package
import overhead


def test_parts_times_each_family_that_reads_and_restores_the_probe() -> None:
    before = (
        dict(vars(plan.ProbePlan)),
        hooks.ProbeHook.__call__,
        modes.AttentionLogits.__torch_function__,
    )
    torch.manual_seed(0)
    rows = torch.randn(4, 8)
    case = overhead.Case("stack", lambda: ResidualStack(4, 8), lambda m: m(rows).pow(2).mean(), 1)
    bare, logged, spent = overhead.parts(case, torch.device("cpu"), steps=2)
    assert bare > 0 and logged > 0
    # every family that reads this model is timed under its name, the runtime apart
    reading = {"resid_rms", "grad_norm", "norm_rms", "update_ratio", "weight_rms", "nonfinite"}
    assert reading | {"runtime"} <= {part for part, s in spent.items() if s > 0}
    assert set(spent) <= {*normprobe.METRICS, "runtime"}
    assert "model" not in spent  # the model's own operations are not a part
    after = (
        dict(vars(plan.ProbePlan)),
        hooks.ProbeHook.__call__,
        modes.AttentionLogits.__torch_function__,
    )
    assert after == before
