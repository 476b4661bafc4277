"""The sanity-check examples ([a]-[f]) and the integration examples, run as a user runs them.

Every script runs in a subprocess with the working directory in ``tmp_path``, so whatever it
writes (TensorBoard runs, PNGs) lands there and not in the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tb import read_events

from normprobe import tags
from normprobe.mup import COORD_PANEL_SIZE

pytestmark = pytest.mark.subprocess

EXAMPLES = Path(__file__).parents[2] / "examples"

# every expectation each check script declares: all must print an OK line
CHECKS = {
    "a": ("check_a_layernorm.py", ["kind", "eps_placement", "recognized_by",
                                   "slip_eps_placement", "max_abs_diff"]),
    "b": ("check_b_rmsnorm.py", ["converted_kind", "zero_mean_diff", "ln_shift_change",
                                 "rms_shift_change"]),
    "c": ("check_c_batchnorm.py", ["bn_mean_drift", "bn_var_drift", "bn_gap",
                                   "train_feature_mean", "running_mean", "train_eval_diff"]),
    "d": ("check_d_grad_ratio.py", ["pre_ln_placement", "pre_ln_ratio", "post_ln_placement",
                                    "post_ln_ratio"]),
    "e": ("check_e_kaiming.py", ["kaiming_std", "kaiming_ey2", "kaiming_per_layer",
                                 "xavier_std", "xavier_ey2", "xavier_per_layer"]),
    "f": ("check_f_gpt2_scaling.py", ["unscaled_growth", "gpt2_growth"]),
}  # fmt: skip


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # threads that sleep when idle (as test_claims.py): spinning ones slow small models many
    # times over when the cores are shared
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def verdicts(label: str, stdout: str) -> dict[str, str]:
    """Expectation name -> OK / MISMATCH, from the script's ``[label] name ...`` lines."""
    found = re.findall(rf"^\[{label}\] (\w+) .* (OK|MISMATCH)$", stdout, flags=re.MULTILINE)
    return dict(found)


def measured(label: str, name: str, stdout: str) -> float:
    line = re.search(rf"^\[{label}\] {name} .* measured (\S+) ", stdout, flags=re.MULTILINE)
    assert line, stdout
    return float(line.group(1))


@pytest.mark.parametrize("label", sorted(CHECKS))
def test_check_script_passes(label: str, tmp_path: Path) -> None:
    script, names = CHECKS[label]
    done = run(script, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert verdicts(label, done.stdout) == dict.fromkeys(names, "OK"), done.stdout
    assert done.stdout.rstrip().endswith(f"check [{label}] passed")
    assert list(tmp_path.iterdir()) == []  # event files went to a temporary directory
    if label == "d":  # Pre-LN 0.40 and Post-LN 2.35, to two decimals
        assert round(measured("d", "pre_ln_ratio", done.stdout), 2) == 0.40
        assert round(measured("d", "post_ln_ratio", done.stdout), 2) == 2.35


@pytest.mark.parametrize(
    ("label", "override", "wrong"),
    [("a", "kind=rmsnorm", "kind"), ("b", "rms_shift_change=3.1", "rms_shift_change")],
)
def test_check_script_fails_on_a_wrong_expectation(
    label: str, override: str, wrong: str, tmp_path: Path
) -> None:
    script, names = CHECKS[label]
    done = run(script, "--expect", override, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    expected = {n: "MISMATCH" if n == wrong else "OK" for n in names}
    assert verdicts(label, done.stdout) == expected, done.stdout
    assert done.stdout.rstrip().endswith(f"check [{label}] FAILED: {wrong}")


def test_check_script_refuses_an_unknown_expectation(tmp_path: Path) -> None:
    done = run("check_a_layernorm.py", "--expect", "nonsense=1", cwd=tmp_path)
    assert done.returncode == 2
    assert "NAME must be one of ['kind'," in done.stderr


def test_plain_pytorch(tmp_path: Path) -> None:
    done = run("plain_pytorch.py", "--steps", "2", "--every", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "See the panels with: tensorboard --logdir runs/plain" in done.stdout
    assert tags.format("grad_ratio", "blocks") in done.stdout
    events = read_events(str(tmp_path / "runs" / "plain"))
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "blocks")]] == [0, 1]


def test_hf_transformers(tmp_path: Path) -> None:
    done = run("hf_transformers.py", "--steps", "2", "--every", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ModelMap of GPT2LMHeadModel" in done.stdout
    assert re.search(r"transformer\.h\s+4\s+GPT2Block\s+pre-ln\s+2", done.stdout), done.stdout
    assert "tensorboard --logdir runs/hf" in done.stdout
    events = read_events(str(tmp_path / "runs" / "hf"))
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "transformer.h")]] == [0, 1]


def test_vision_batchnorm(tmp_path: Path) -> None:
    args = ("--steps", "2", "--every", "1", "--batch", "4")
    done = run("vision_batchnorm.py", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20 BatchNorm layers" in done.stdout
    events = read_events(str(tmp_path / "runs" / "vision"))
    assert [s for s, _ in events.scalars[tags.format("bn_gap", "bn1")]] == [0, 1]
    assert [s for s, _ in events.scalars[tags.format("val_bn_gap", "bn1")]] == [2]


def test_mup_coord_check(tmp_path: Path) -> None:
    args = ("--steps", "2", "--widths", "64", "256", "--png")
    done = run("mup_coord_check.py", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Coordinate check (SP, adam lr=0.003)" in done.stdout
    assert "Coordinate check (muP, adam lr=0.003)" in done.stdout
    slopes = re.findall(r"^(SP|muP)\s+([-+]\d\.\d\d)\s+([-+]\d\.\d\d)", done.stdout, re.MULTILINE)
    assert [row[0] for row in slopes] == ["SP", "muP"]
    assert {p.name for p in tmp_path.iterdir()} == {"coord_check_sp.png", "coord_check_mup.png"}
    from PIL import Image

    for name in ("sp", "mup"):  # a panel per step (0, 1, 2), side by side, not blank
        with Image.open(tmp_path / f"coord_check_{name}.png") as image:
            assert image.format == "PNG" and image.width == 3 * COORD_PANEL_SIZE[0]
            inked = sum(image.convert("L").histogram()[:250])  # pixels not (nearly) white
            assert inked > 0.03 * image.width * image.height
