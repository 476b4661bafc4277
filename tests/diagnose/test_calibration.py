"""The calibration set (``benchmarks/calibration_set.py``) at its reduced size: no problem on a
healthy run, and each broken run caught, as a problem, by the flag made for its fault, naming
where the fault was put."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).parents[2] / "benchmarks"))  # a folder, no package
import calibration as table
import calibration_set as cal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.slow
@pytest.mark.parametrize("case", cal.HEALTHY, ids=lambda c: c.name)
def test_healthy_run_raises_no_problem(case, tmp_path) -> None:
    outcome = cal.run_case(case, cal.SMALL, tmp_path)
    raised = [str(f) for f in outcome.report.flags if f.severity == "problem"]
    assert not raised, "\n".join(raised)


@pytest.mark.slow
@pytest.mark.parametrize("case", cal.BROKEN, ids=lambda c: c.name)
def test_broken_run_is_caught_where_the_fault_is(case, tmp_path) -> None:
    outcome = cal.run_case(case, cal.SMALL, tmp_path)
    flag = outcome.found
    assert flag is not None, (
        f"{case.fault.what}: no {case.fault.kind!r} problem naming {case.fault.where}; flags:\n"
        + "\n".join(f"{f.severity}: {f}" for f in outcome.report.flags)
    )
    assert flag.severity == "problem"


def test_every_fault_has_its_statistic_in_the_table() -> None:
    kinds = {s.kind for s in table.STATISTICS}
    assert {c.fault.kind for c in cal.BROKEN} <= kinds
    assert len(cal.HEALTHY) >= 8 and len(cal.BROKEN) >= 8
