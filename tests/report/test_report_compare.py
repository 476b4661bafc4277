"""``normprobe report RUN_A RUN_B``: runs compared at their matched steps, ratios against each
run's own report, flags raised by one run only; ``--json`` of report, comparison and diagnose;
exit status and bad input. Every run is a real probe run written to event files."""

from __future__ import annotations

import json
import math
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from report_runs import lm_loss, square_loss, tokens, train
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import normprobe
from normprobe.cli import main
from normprobe.metrics import grad_norm
from normprobe.models import Placement, ResidualStack, TinyTransformer

RUN_KEYS = {"path", "event_files", "steps", "repeated_steps", "rows", "flags"}
ROW_KEYS = {"stack", "metric", "first", "last", "min", "max", "trend", "first_step", "last_step"}
FLAG_KEYS = {"kind", "severity", "stack", "step", "value", "threshold", "message"}


def lm_run(log_dir: Path, placement: Placement) -> Path:
    """A 4-block TinyTransformer trained 5 AdamW steps, every step logged."""
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, width=32, context=16, placement=placement)
    return train(log_dir, model, tokens, lm_loss, steps=5, every=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, report_runs: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)  # what a model lacks
        return {
            "lm_pre": lm_run(root / "lm_pre", "pre"),
            "lm_post": lm_run(root / "lm_post", "post"),
            "healthy": report_runs["healthy"],  # logged every 2 steps: 0, 2, 4, 6, 8
            "stack_pre": report_runs["stack_pre"],
            "stack_post": report_runs["stack_post"],
            # an input 100x the blocks' writes: representation collapse, a problem
            "collapse": report_runs["stack_large_input"],
        }


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity, which strict JSON does not have."""

    def reject(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=reject)


def by_step(rep: normprobe.RunReport, stack: str, metric: str) -> dict[int, float]:
    """A row of a run's report: step -> value."""
    trend = rep.row(stack, metric)
    return dict(zip(trend.steps, trend.values, strict=True))


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


# --- the comparison ----------------------------------------------------------------------------
@pytest.mark.slow
def test_ratio_is_each_runs_value_divided(runs: dict[str, Path]) -> None:
    a, b = normprobe.report_run(runs["lm_pre"]), normprobe.report_run(runs["lm_post"])
    cmp = normprobe.compare_runs(runs["lm_pre"], runs["lm_post"])
    assert cmp.steps == a.steps == b.steps == [0, 1, 2, 3, 4]
    assert {(r.stack, r.metric) for r in cmp.rows} == {
        (t.stack, t.metric) for rep in (a, b) for t in rep.trends
    }
    both = 0
    for row in cmp.rows:
        values: list[float | None] = []
        for rep in (a, b):
            try:
                values.append(by_step(rep, row.stack, row.metric)[4])
            except KeyError:  # no such row in this run
                values.append(None)
        assert row.step == 4 and row.values == tuple(values), row
        if values[0] is not None and values[1] is not None and values[0] != 0:
            both += 1
            assert row.ratios[0] == 1.0 and row.ratios[1] == pytest.approx(values[1] / values[0])
    assert both >= 15
    grad = cmp.row("blocks", "grad_ratio")
    assert grad.ratios[1] == pytest.approx(
        b.row("blocks", "grad_ratio").last / a.row("blocks", "grad_ratio").last
    )
    # Post-LN has no final norm: ln_f's rows are the Pre-LN run's alone
    ln_f = cmp.row("model", "norm_in_rms ln_f")
    assert ln_f.values == (a.row("model", "norm_in_rms ln_f").last, None)
    assert ln_f.ratios == (1.0, None)

    table = cmp.table()
    assert f"A  {a.run_dir}" in table and f"B  {b.run_dir}" in table
    assert "matched steps: 0..4 (5 logged by every run); values at step 4" in table
    line = next(x for x in table.splitlines() if "grad_ratio" in x)
    assert line.split() == ["grad_ratio", *(f"{v:.4g}" for v in (*grad.values, grad.ratios[1]))]
    ln_f_line = next(x for x in table.splitlines() if "norm_in_rms ln_f" in x)
    assert ln_f_line.split()[2:] == [f"{ln_f.values[0]:.4g}", "-", "-", "not", "in", "B"]
    assert str(cmp) == table


def test_only_steps_every_run_logged_are_matched(runs: dict[str, Path]) -> None:
    # logged every step (0..4) against every other step (0..8): 0, 2 and 4 are common
    every_step, every_other = (normprobe.report_run(runs[k]) for k in ("lm_pre", "healthy"))
    cmp = normprobe.compare_runs(every_other, every_step)
    assert cmp.steps == [0, 2, 4]
    row = cmp.row("blocks", "grad_ratio")
    at = [by_step(r, "blocks", "grad_ratio") for r in (every_other, every_step)]
    assert row.step == 4 and row.values == (at[0][4], at[1][4])
    assert row.values[0] != every_other.row("blocks", "grad_ratio").last  # not its step 8
    assert row.ratios[1] == pytest.approx(at[1][4] / at[0][4])
    assert "matched steps: 0..4 (3 logged by every run)" in cmp.table()


def test_a_row_that_ends_early_is_compared_at_its_last_matched_step(tmp_path: Path) -> None:
    # run A stops writing resid_growth after step 1 (as after a NaN onset), B writes it on
    def write(run: Path, growth_steps: range) -> Path:
        with SummaryWriter(str(run)) as writer:
            for step in range(3):
                writer.add_scalar("normprobe/grad_ratio/blocks", 1.0 + step, step)
            for step in growth_steps:
                writer.add_scalar("normprobe/resid_growth/blocks", 2.0 + step, step)
        return run

    cmp = normprobe.compare_runs(write(tmp_path / "a", range(2)), write(tmp_path / "b", range(3)))
    assert cmp.steps == [0, 1, 2]
    assert cmp.row("blocks", "grad_ratio").step == 2
    growth = cmp.row("blocks", "resid_growth")
    assert (growth.step, growth.values, growth.ratios) == (1, (3.0, 3.0), (1.0, 1.0))
    line = next(x for x in cmp.table().splitlines() if "resid_growth" in x)
    assert line.split() == ["blocks", "resid_growth", "3", "3", "1", "at", "step", "1"]


def test_flags_raised_by_one_run_only(runs: dict[str, Path]) -> None:
    pre, post = normprobe.report_run(runs["stack_pre"]), normprobe.report_run(runs["stack_post"])
    cmp = normprobe.compare_runs(pre, post)
    assert {(f.kind, f.stack) for f in cmp.unshared_flags[0]} == {("residual growth", "lins")}
    assert ("top-heavy gradients", "lins") in {(f.kind, f.stack) for f in cmp.unshared_flags[1]}
    assert cmp.unshared_flags == [pre.flags, post.flags] and cmp.shared_flags == []
    assert cmp.row("lins", "grad_ratio").ratios[1] == pytest.approx(2.35 / 0.40, rel=0.01)
    table = cmp.table()
    assert f"Flags not raised by every run ({len(pre.flags) + len(post.flags)}" in table
    assert "  A  note     [residual growth] lins at step 2:" in table
    assert "  B  note     [top-heavy gradients] lins at step 2:" in table
    assert "0 problems, 1 note" in table

    # three runs: ratios of each against the first; what all three raised is listed once
    three = normprobe.compare_runs(post, pre, post)
    assert three.labels == ["A", "B", "C"]
    assert three.unshared_flags == [post.flags, pre.flags, post.flags]
    assert three.shared_flags == []
    same = normprobe.compare_runs(post, post)
    assert same.unshared_flags == [[], []]
    assert same.shared_flags == sorted({(f.kind, f.stack) for f in post.flags})
    assert "Raised by every run: [top-heavy gradients] lins" in same.table()
    ratios = three.row("lins", "grad_ratio").ratios
    assert ratios[1] == pytest.approx(0.40 / 2.35, rel=0.01) and ratios[::2] == (1.0, 1.0)
    header = next(x for x in three.table().splitlines() if x.startswith("stack"))
    assert header.split() == ["stack", "metric", "A", "B", "C", "B/A", "C/A"]


# --- the command line: exit status and --json ----------------------------------------------------
def test_compare_exit_status(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert normprobe.report_run(runs["lm_pre"]).flags == []
    assert normprobe.report_run(runs["healthy"]).flags == []
    status, out, _ = run_cli(["report", str(runs["healthy"]), str(runs["lm_pre"])], capsys)
    assert status == 0 and "No flag raised by some runs and not others." in out
    # Post-LN's flags are its own, notes: exit 0
    status, out, _ = run_cli(["report", str(runs["lm_pre"]), str(runs["lm_post"])], capsys)
    post = normprobe.report_run(runs["lm_post"]).flags
    assert post and {f.severity for f in post} == {"note"}
    assert status == 0 and "normprobe report: 2 runs compared" in out and "  B  note " in out
    assert "  A  " not in out.split("Flags not raised")[1]
    # a run with a problem makes it 1
    status, out, _ = run_cli(["report", str(runs["lm_pre"]), str(runs["collapse"])], capsys)
    assert status == 1 and "  B  problem  [representation collapse]" in out


def test_report_json_of_one_run_and_of_a_folder(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli(["report", str(runs["lm_pre"]), "--json"], capsys)
    doc = strict_json(out)
    assert status == 0 and err == ""
    assert set(doc) == {"schema", "runs", "skipped"} and doc["schema"] == "normprobe.report/1"
    (run,) = doc["runs"]
    rep = normprobe.report_run(runs["lm_pre"])
    assert set(run) == RUN_KEYS and run["path"] == rep.run_dir and run["event_files"] == 1
    assert run["steps"] == {"first": 0, "last": 4, "count": 5} and run["flags"] == []
    assert [(r["stack"], r["metric"]) for r in run["rows"]] == [
        (t.stack, t.metric) for t in rep.trends
    ]
    for row, trend in zip(run["rows"], rep.trends, strict=True):
        assert set(row) == ROW_KEYS
        assert (row["first"], row["last"], row["min"], row["max"]) == (
            trend.first, trend.last, trend.min, trend.max
        )  # fmt: skip
        assert (row["trend"], row["first_step"], row["last_step"]) == (trend.trend, 0, 4)

    # a folder of two runs and one written without the probe: both runs, the other skipped
    stacks = tmp_path / "stacks"
    shutil.copytree(runs["stack_pre"].parent, stacks)
    with SummaryWriter(str(stacks / "other")) as writer:
        writer.add_scalar("loss", 1.0, 0)
    status, out, _ = run_cli(["report", str(stacks), "--json"], capsys)
    doc = strict_json(out)
    assert status == 0  # notes only
    assert [r["path"] for r in doc["runs"]] == [str(stacks / "post"), str(stacks / "pre")]
    assert doc["skipped"] == [str(stacks / "other")]
    flags = doc["runs"][0]["flags"]
    assert flags and all(set(f) == FLAG_KEYS for f in flags)
    top = next(f for f in flags if (f["kind"], f["stack"]) == ("top-heavy gradients", "lins"))
    assert top["step"] == 2 and top["value"] == pytest.approx(2.35, abs=0.005)
    assert top["threshold"] == grad_norm.TOP_LIMIT and top["severity"] == "note"


@pytest.mark.slow
def test_compare_json_and_png(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pre, post = str(runs["stack_pre"]), str(runs["stack_post"])
    png = tmp_path / "d.png"
    status, out, err = run_cli(["report", pre, post, "--json", "--png", str(png)], capsys)
    doc = strict_json(out)  # stdout is the document alone; the pictures are named on stderr
    assert status == 0  # notes only
    assert set(doc) == {
        "schema", "runs", "matched_steps", "rows", "unshared_flags", "shared_flags"
    }  # fmt: skip
    assert doc["schema"] == "normprobe.compare/1"
    assert [(r["label"], r["path"]) for r in doc["runs"]] == [("A", pre), ("B", post)]
    assert all(set(r) == RUN_KEYS | {"label"} for r in doc["runs"])
    assert doc["matched_steps"] == {"first": 0, "last": 2, "count": 3}
    cmp = normprobe.compare_runs(pre, post)
    assert [(r["stack"], r["metric"]) for r in doc["rows"]] == [
        (r.stack, r.metric) for r in cmp.rows
    ]
    grad = next(r for r in doc["rows"] if (r["stack"], r["metric"]) == ("lins", "grad_ratio"))
    assert set(grad) == {"stack", "metric", "step", "values", "ratios"} and grad["step"] == 2
    a, b = grad["values"]
    assert grad["ratios"] == [1.0, pytest.approx(b / a)]
    # a first value of 0 has no ratio: null (update_ratio is 0 at learning rate 0)
    update = next(r for r in doc["rows"] if r["metric"] == "update_ratio[mean]")
    assert update["values"] == [0.0, 0.0] and update["ratios"] == [None, None]
    kinds = [{(f["kind"], f["stack"]) for f in flags} for flags in doc["unshared_flags"]]
    assert ("residual growth", "lins") in kinds[0] and ("top-heavy gradients", "lins") in kinds[1]
    assert doc["shared_flags"] == []
    for name in ("pre", "post"):
        assert (tmp_path / f"d-{name}.png").is_file()
        assert f"depth profiles: {tmp_path / f'd-{name}.png'}" in err


@pytest.mark.slow
def test_non_finite_values_are_null(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def poison(model: nn.Module, step: int) -> None:
        if step == 2:
            assert isinstance(model, ResidualStack)
            lin = model.lins[1]
            assert isinstance(lin, nn.Linear)
            with torch.no_grad():
                lin.weight[0, 0] = math.nan

    torch.manual_seed(0)
    model = ResidualStack(4, 16)
    run = train(
        tmp_path / "nan", model, lambda i: torch.randn(8, 16), square_loss, 4, 1, 1e-2, poison
    )
    assert math.isnan(normprobe.report_run(run).row("lins", "resid_rms[last]").last)
    status, out, _ = run_cli(["report", str(run), "--json"], capsys)
    assert status == 1
    (rep,) = strict_json(out)["runs"]
    row = next(r for r in rep["rows"] if r["metric"] == "resid_rms[last]")
    assert row["last"] is None and isinstance(row["first"], float)
    assert "nan onset" in {f["kind"] for f in rep["flags"]}
    status, out, _ = run_cli(["report", str(run), str(run), "--json"], capsys)
    row = next(r for r in strict_json(out)["rows"] if r["metric"] == "resid_rms[last]")
    assert row["values"] == [None, None] and row["ratios"] == [None, None]


ENTRY = """
import torch
from normprobe.models import ResidualStack


def build():
    torch.manual_seed(0)
    return ResidualStack(8, 32), torch.randn(16, 32)
"""


def test_diagnose_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "np_entry_compare_json.py").write_text(ENTRY)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --path edits sys.path
    argv = ["diagnose", "np_entry_compare_json:build", "--path", str(tmp_path), "--json"]
    status, out, _ = run_cli(argv, capsys)
    doc = strict_json(out)
    torch.manual_seed(0)
    result = normprobe.diagnose(ResidualStack(8, 32), torch.randn(16, 32))
    assert status == 1 and result.codes == ["no-final-norm"]
    assert set(doc) == {"schema", "model", "loss", "findings", "checks", "measurements"}
    assert doc["schema"] == "normprobe.diagnose/1" and doc["model"] == "ResidualStack"
    assert doc["loss"] == pytest.approx(result.loss)
    (finding,) = doc["findings"]
    assert set(finding) == {"code", "title", "evidence", "suggestion", "paths"}
    assert finding["code"] == "no-final-norm" and finding["paths"] == ["lins"]
    assert finding["evidence"] == list(result.findings[0].evidence)
    assert list(doc["checks"]) == list(result.checks)
    assert doc["checks"]["no-final-norm"] == {"status": "found", "reason": None}
    assert doc["checks"]["residual-growth"] == {"status": "ok", "reason": None}
    assert doc["checks"]["post-ln-top-heavy"] == {"status": "n/a", "reason": "no Post-LN stack"}
    assert doc["measurements"]["normprobe/grad_ratio/lins"] == pytest.approx(
        result.measurements["normprobe/grad_ratio/lins"]
    )
    # bad input: exit 2, the error on stderr and nothing on stdout
    status, out, err = run_cli(["diagnose", "np_entry_compare_json:nope", "--json"], capsys)
    assert (status, out) == (2, "") and "has no function 'nope'" in err


# --- bad input ---------------------------------------------------------------------------------
def test_bad_input_to_compare(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = str(runs["lm_pre"])

    def fails(*paths: Path | str) -> str:
        status, out, err = run_cli(["report", *map(str, paths), "--json"], capsys)
        assert (status, out) == (2, ""), err
        assert err.startswith("normprobe report: error: ")
        return err

    missing = tmp_path / "nope"
    assert f"no such file or directory: '{missing}'" in fails(good, missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    err = fails(empty, good)
    assert f"no TensorBoard event files (events.out.tfevents.*) in or under '{empty}'" in err

    # a folder of several runs is not one run: the error names them and the command to run
    stacks = runs["stack_pre"].parent
    err = fails(good, stacks)
    pre, post = stacks / "pre", stacks / "post"
    assert f"'{stacks}' holds " in err and str(pre) in err and str(post) in err
    assert f"name each run directory: normprobe report {post} " in err

    other = tmp_path / "other"
    with SummaryWriter(str(other)) as writer:
        writer.add_scalar("loss", 1.0, 0)
    assert "hold no normprobe/ tags" in fails(good, other)

    # normprobe tags, but at steps the other run never logged
    late = tmp_path / "late"
    with SummaryWriter(str(late)) as writer:
        for step in (5, 6):
            writer.add_scalar("normprobe/grad_ratio/blocks", 1.0, step)
    err = fails(good, late)
    assert "the runs have no logged step in common" in err and f"B ({late}) 5..6" in err

    with pytest.raises(ValueError, match="two or more runs, got 1"):
        normprobe.compare_runs(good)
    # one bad path among the single-run form keeps its exit status and stays off stdout
    assert "nope" in fails(missing)
