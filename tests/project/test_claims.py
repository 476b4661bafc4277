"""Every claim script runs in ``--quick`` mode and produces its table, its plot and a verdict
(the numbers of a quick run say nothing; docs/claims.md quotes full runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

CLAIMS = Path(__file__).parents[2] / "examples" / "claims"
SCRIPTS = sorted(p for p in CLAIMS.glob("*.py") if not p.name.startswith("_"))
VERDICTS = ("reproduced", "not reproduced at this scale", "contradicted")


def test_there_is_a_script_per_claim() -> None:
    assert len(SCRIPTS) == 8, [p.name for p in SCRIPTS]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_claim_script_quick(script: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path)],
        # threads that sleep when idle: spinning ones slow small models many times over when
        # the cores are shared
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("Claim: ")
    verdict = next(line for line in out.splitlines() if line.startswith("Verdict: "))
    assert verdict.removeprefix("Verdict: ").startswith(VERDICTS), verdict
    record = json.loads((tmp_path / f"{script.stem}.json").read_text())
    assert record["quick"] is True and record["verdict"] in VERDICTS and record["why"]
    assert record["rows"] and all(len(r) == len(record["header"]) for r in record["rows"])
    # the table is printed: a line holding every header cell, and a line per row
    lines = out.splitlines()
    assert any(all(cell in line for cell in record["header"]) for line in lines)
    for row in record["rows"]:
        assert any(all(cell in line for cell in row) for line in lines), row
    with Image.open(tmp_path / record["plot"]) as image:
        assert image.format == "PNG" and image.size[0] >= 400
