"""`normprobe report`: the table against the event files, each flag on a model built to have it
and on one built not to, the depth picture, the command line and bad input."""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from report_runs import check_d_stack, lm_loss, square_loss, tokens, train
from tb import read_events
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import normprobe
from normprobe import plots, tags
from normprobe import report as rp
from normprobe.metrics import SERIES, attn_logits, bn_stats, grad_norm, logits, resid_cos, resid_rms
from normprobe.metrics.core.run import run_flags
from normprobe.models import ResidualStack, TinyTransformer


@pytest.fixture(scope="module")
def lm_run(report_runs: dict[str, Path]) -> Path:
    return report_runs["healthy"]


@pytest.fixture(scope="module")
def stacks(
    tmp_path_factory: pytest.TempPathFactory, report_runs: dict[str, Path]
) -> dict[str, rp.RunReport]:
    root = tmp_path_factory.mktemp("stacks")
    return {
        "pre": rp.report(report_runs["stack_pre"]),
        "post": rp.report(report_runs["stack_post"]),
        "deepnorm": rp.report(check_d_stack(root / "deepnorm", pre_ln=False, deepnorm=True)),
        # a small input: the first blocks' norms divide by a small RMS, the deep ones by ~4
        "pre_small_input": rp.report(check_d_stack(root / "small", True, input_scale=0.1)),
        # a large input: the blocks' writes are lost in it (representation collapse)
        "pre_large_input": rp.report(report_runs["stack_large_input"]),
    }


def kinds(rep: rp.RunReport, stack: str | None = None) -> set[str]:
    return {f.kind for f in rep.flags if stack is None or f.stack == stack}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="normprobe")
    rp.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


# --- the table ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_rows_match_the_event_files(lm_run: Path) -> None:
    rep = rp.report(lm_run)
    scalars = read_events(str(lm_run)).scalars

    def series(
        name: str, subject: str, block: int | None = None, layer: str | None = None
    ) -> dict[int, float]:
        return dict(scalars[tags.format(name, subject, block, layer)])

    def check(stack: str, metric: str, expected: dict[int, float]) -> None:
        row = rep.row(stack, metric)
        assert row.steps == tuple(sorted(expected))
        assert row.values == pytest.approx([expected[s] for s in row.steps])
        assert (row.first, row.last) == pytest.approx((expected[0], expected[8]))
        assert (row.min, row.max) == pytest.approx((min(expected.values()), max(expected.values())))

    assert rep.steps == [0, 2, 4, 6, 8]
    check("blocks", "grad_ratio", series("grad_ratio", "blocks"))
    check("blocks", "resid_slope", series("resid_slope", "blocks"))
    check("blocks", "resid_rms[last]", series("resid_rms", "blocks", 3))
    per_block = [series("grad_norm", "blocks", b) for b in range(4)]
    check(
        "blocks",
        "grad_norm[mean]",
        {s: statistics.fmean(b[s] for b in per_block) for s in per_block[0]},
    )
    cos = [series("resid_cos", "blocks", b) for b in (2, 3)]  # the deep half of 4 blocks
    check("blocks", "resid_cos[deep]", {s: (cos[0][s] + cos[1][s]) / 2 for s in cos[0]})
    attn = [series("attn_logit_max", "blocks", b, "attn") for b in range(4)]
    check("blocks", "attn_logit_max[max]", {s: max(a[s] for a in attn) for s in attn[0]})
    ln_1 = [series("norm_in_rms", "blocks", b, "ln_1") for b in range(4)]
    check("blocks", "norm_in_rms .ln_1", {s: statistics.fmean(n[s] for n in ln_1) for s in ln_1[0]})
    check("model", "logits/max_abs", series("logits", "max_abs"))
    check("model", "norm_in_rms ln_f", series("norm_in_rms", "ln_f"))

    row = rep.row("blocks", "grad_ratio")
    line = next(x for x in rep.table().splitlines() if "grad_ratio" in x)
    assert line.split() == [
        "grad_ratio",
        *(f"{v:.4g}" for v in (row.first, row.last, row.min, row.max)),
        *row.trend.split(),
    ]
    assert rep.flags == [] and rep.table().endswith("No flags.")


def test_trend_words() -> None:
    def trend(*values: float) -> str:
        return rp.Trend("s", "m", tuple(range(len(values))), values, ()).trend

    assert trend(1.0, 3.0) == "up x3"
    assert trend(2.0, 0.5) == "down x0.25"
    assert trend(1.0, 1.05) == "flat"
    assert trend(-1.0, 2.0) == "up"
    assert trend(1.0, math.nan) == "non-finite"
    assert trend(4.0) == "one step"


# --- flags -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gradient_skew_flags_follow_check_d(stacks: dict[str, rp.RunReport]) -> None:
    # check [d]'s numbers, read back through the event files
    assert round(stacks["post"].row("lins", "grad_ratio").last, 2) == 2.35
    assert round(stacks["pre"].row("lins", "grad_ratio").last, 2) == 0.40
    top = [f for f in stacks["post"].flags if f.stack == "lins"]
    assert [(f.kind, f.severity) for f in top] == [("top-heavy gradients", "note")]
    assert (
        top[0].value == pytest.approx(2.35, abs=0.005) and top[0].step == 2
    )  # the last of the steps it held at
    # DeepNorm brings Post-LN to ~1; Pre-LN's 0.40 is its normal skew, not flagged
    assert not {"top-heavy gradients", "bottom-heavy gradients"} & kinds(stacks["deepnorm"], "lins")
    assert "bottom-heavy gradients" not in kinds(stacks["pre"], "lins")
    low = stacks["pre_small_input"]
    assert "bottom-heavy gradients" in kinds(low, "lins")
    assert low.row("lins", "grad_ratio").last <= grad_norm.BOTTOM_LIMIT
    # past TOP_PROBLEM at the last logged steps, top-heavy gradients are a problem
    ratio = {tags.format("grad_ratio", "lins"): [(0, 12.0), (1, 11.0)]}
    (flag,) = run_flags(ratio, {})
    assert (flag.kind, flag.severity, flag.threshold) == ("top-heavy gradients", "problem", 10.0)


def test_gradient_skew_of_a_stack_without_residual_adds_is_not_flagged() -> None:
    # a last / first gradient ratio of 3 at three logged steps: top-heavy on a Post-LN stack,
    # no finding on a stack whose blocks make no residual add (ShuffleNetV2's stages)
    ratio = {tags.format("grad_ratio", "stage2"): [(0, 3.0), (1, 3.0), (2, 3.0)]}

    def found(placement: str) -> list[str]:
        texts = {tags.format("placement", "stage2"): [(0, placement)]}
        return [f.kind for f in run_flags(ratio, texts)]

    assert found("post-ln") == ["top-heavy gradients"]
    assert found("no-residual") == []


def test_residual_growth_and_collapse_flags(stacks: dict[str, rp.RunReport]) -> None:
    pre, post, large = stacks["pre"], stacks["post"], stacks["pre_large_input"]
    # Pre-LN's stream grows with depth: a note; its deep blocks nearly parallel, not collapsed
    assert pre.row("lins", "resid_growth").last >= resid_rms.GROWTH_MIN
    assert pre.row("lins", "resid_slope").last >= resid_rms.SLOPE_LIMIT
    growth = next(f for f in pre.flags if f.kind == "residual growth")
    assert growth.severity == "note"
    assert 0.95 < pre.row("lins", "resid_cos[deep]").last < resid_cos.COLLAPSE_COS
    assert "representation collapse" not in kinds(pre)
    # an input 100x the writes: the deep blocks' streams are parallel to 1e-3, a problem
    collapse = next(f for f in large.flags if f.kind == "representation collapse")
    assert collapse.severity == "problem"
    assert collapse.value == pytest.approx(large.row("lins", "resid_cos[deep]").last)
    assert "24..47" in collapse.message
    # Post-LN renormalizes every block: flat stream, cosine well below the limit
    assert pre.row("lins", "resid_growth").last > 3 * post.row("lins", "resid_growth").last
    assert post.row("lins", "resid_cos[deep]").last < resid_cos.COLLAPSE_COS - 0.05
    assert not {"residual growth", "representation collapse"} & kinds(post)


@pytest.mark.slow
def test_nan_onset_names_the_first_module(tmp_path: Path, lm_run: Path) -> None:
    def poison(model: nn.Module, step: int) -> None:
        if step == 6:
            assert isinstance(model, ResidualStack)
            with torch.no_grad():
                model.lins[3].weight[0, 0] = math.nan

    torch.manual_seed(0)
    model = ResidualStack(6, 16)
    run = train(tmp_path, model, lambda i: torch.randn(8, 16), square_loss, 9, 1, 1e-2, poison)
    rep = rp.report(run)
    (flag,) = [f for f in rep.flags if f.kind == "nan onset"]
    # step 6 is the onset even though later steps name an earlier module (NaN weights spread)
    assert flag.step == 6 and "lins.3" in flag.message
    assert flag.value == dict(read_events(str(run)).scalars[tags.format("nonfinite", "modules")])[6]
    row = rep.row("lins", "resid_rms[last]")  # a measured NaN is logged as NaN
    assert row.steps[-1] == 8 and all(math.isnan(v) for v in row.values[6:])
    assert "non-finite" in rep.table()
    assert "nan onset" not in kinds(rp.report(lm_run))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


@pytest.mark.slow
@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_batchnorm_drift(tmp_path: Path, shift: float) -> None:
    # inputs whose mean moves by `shift` per step: the running statistics lag behind the batches
    torch.manual_seed(0)
    model = BatchNormNet()
    run = train(tmp_path, model, lambda i: torch.randn(32, 8) + shift * i, square_loss, 31, 10)
    # a validation pass as the Lightning callback makes it: normprobe/val_bn_* at step 31
    with normprobe.attach(model, log_dir=str(run), every=1000, metrics=["bn_stats"]) as probe:
        probe.begin_step(31)
        probe.validate_next_forward()
        with torch.no_grad():
            model.eval()(torch.randn(32, 8) + shift * 31)
        probe.flush_validation()
    rep = rp.report(run)
    assert rep.row("model", "val_bn_mean_drift[max]").steps == (31,)
    drift = rep.row("model", "bn_mean_drift[max]")
    if shift:
        (flag,) = [f for f in rep.flags if f.kind == "batchnorm drift"]
        assert "bn_mean_drift" in flag.message and "val_bn_mean_drift" in flag.message
        assert drift.last > bn_stats.LIMITS["mean_drift"]
        assert drift.last == pytest.approx(
            dict(read_events(str(run)).scalars[tags.format("bn_mean_drift", "bn")])[30]
        )
    else:
        assert rep.flags == []
        assert drift.last < bn_stats.LIMITS["mean_drift"] / 5


@pytest.mark.slow
def test_logit_blow_up(tmp_path: Path, lm_run: Path) -> None:
    def grow(model: nn.Module, step: int) -> None:
        assert isinstance(model, TinyTransformer)
        with torch.no_grad():
            model.head.weight.mul_(2.0)
            for block in model.blocks:
                block.attn.qkv.weight[:64].mul_(2.0)  # queries and keys (width 32)

    torch.manual_seed(0)
    model = TinyTransformer(depth=2, width=32, context=16)
    rep = rp.report(train(tmp_path, model, tokens, lm_loss, 9, 2, lr=0.0, before=grow))
    flags = {f.stack: f for f in rep.flags if f.kind == "logit blow-up"}
    # the head's logits past Gemma 2's cap of 30: a note; attention's past tau = 100: a problem
    assert flags["model"].value == rep.row("model", "logits/max_abs").last > logits.LIMIT
    assert flags["model"].severity == "note"
    assert flags["blocks"].value == rep.row("blocks", "attn_logit_max[max]").last
    assert flags["blocks"].value > attn_logits.TAU and flags["blocks"].severity == "problem"
    healthy = rp.report(lm_run)
    assert "logit blow-up" not in kinds(healthy)
    assert healthy.row("model", "logits/max_abs").last < logits.LIMIT / 10


# --- the picture -------------------------------------------------------------------------------
def test_png_of_depth_profiles(tmp_path: Path, lm_run: Path) -> None:
    rep = rp.report(lm_run)
    assert set(rep.profiles) == {
        f"{name}/blocks" for name, s in SERIES.items() if s.shape == "block"
    }
    step, values = rep.profiles["resid_rms/blocks"][-1]
    assert step == 8 and values == pytest.approx(
        [
            dict(read_events(str(lm_run)).scalars[tags.format("resid_rms", "blocks", b)])[8]
            for b in range(4)
        ]
    )
    assert math.isnan(rep.profiles["resid_cos/blocks"][0][1][0])  # block 0 has no cosine
    out = rep.write_png(tmp_path / "depth.png")
    with Image.open(out) as image:
        image.load()
        assert image.format == "PNG"
        # one panel per per-block series, two columns
        panels = len(rep.profiles)
        rows = -(-panels // 2)
        assert image.size == rp.png_size(panels) == (2 * rp.PANEL_SIZE[0], rows * rp.PANEL_SIZE[1])
        pixels = np.asarray(image.convert("RGB")).astype(int)
    (w, h), latest = rp.PANEL_SIZE, plots.ramp(4, 5)  # the last step's line, darkest
    cells = [
        pixels[r * h : (r + 1) * h, c * w : (c + 1) * w] for r in range(rows) for c in range(2)
    ]
    drawn = [(cell != 255).any(axis=2).mean() for cell in cells]
    darkest = [(np.abs(cell - latest).sum(axis=2) <= 24).sum() for cell in cells]
    # every panel has the last step's line (its legend entry alone is ~70 pixels); a cell left
    # over in the grid stays blank
    assert all(d > 0.05 for d in drawn[:panels]) and all(d < 0.005 for d in drawn[panels:]), drawn
    assert all(n > 200 for n in darkest[:panels]), darkest


# --- the command line and bad input -----------------------------------------------------------
@pytest.mark.slow
def test_cli_exit_status_and_output(
    lm_run: Path,
    stacks: dict[str, rp.RunReport],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    assert cli(["report", str(lm_run)]) == 0
    out = capsys.readouterr().out
    assert f"normprobe report: {lm_run}" in out and "No flags." in out
    # notes alone exit 0
    assert cli(["report", stacks["post"].run_dir, "--png", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "No problems.\nNotes (2), worth a look" in out
    assert "[top-heavy gradients] lins at step 2" in out
    assert f"depth profiles: {tmp_path / 'p.png'}" in out and (tmp_path / "p.png").is_file()
    # a problem exits 1, listed before the notes
    assert cli(["report", stacks["pre_large_input"].run_dir]) == 1
    out = capsys.readouterr().out
    assert out.index("Problems (") < out.index("[representation collapse]") < out.index("Notes (")


@pytest.mark.slow
def test_lightning_layout_and_several_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], report_runs: dict[str, Path]
) -> None:
    logs = tmp_path / "lightning_logs"
    shutil.copytree(report_runs["stack_pre"], logs / "version_0")
    assert rp.report(logs).run_dir == str(logs / "version_0")  # the only run below it
    shutil.copytree(report_runs["stack_post"], logs / "version_1")
    assert rp.find_runs(logs) == [logs / "version_0", logs / "version_1"]
    with pytest.raises(ValueError, match=r"holds 2 runs.*version_0.*version_1"):
        rp.report(logs)
    # Pre-LN and Post-LN at init raise notes only
    assert cli(["report", str(logs), "--png", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("normprobe report: ") == 2
    for version in ("version_0", "version_1"):
        assert (tmp_path / f"d-{version}.png").is_file()
    event_file = next((logs / "version_1").glob("events.out.tfevents.*"))
    assert rp.report(event_file).row("lins", "grad_ratio").last == pytest.approx(2.35, abs=0.005)


def test_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        rp.report(missing)
    assert cli(["report", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no TensorBoard event files.*empty"):
        rp.report(empty)
    assert cli(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "events.out.tfevents" in err

    other = tmp_path / "other"
    with SummaryWriter(str(other)) as writer:
        writer.add_scalar("loss", 1.0, 0)
    with pytest.raises(ValueError, match=r"no normprobe/ tags.*'loss'"):
        rp.report(other)
    assert cli(["report", str(other)]) == 2
    assert "was the probe attached" in capsys.readouterr().err


@pytest.mark.slow
def test_a_folder_written_twice_reads_as_one_run_the_later_file_winning(tmp_path: Path) -> None:
    # a script run twice into one folder: two event files holding the same steps
    ratios = []
    for seed in range(2):
        torch.manual_seed(seed)
        model = ResidualStack(8, 16, pre_ln=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with normprobe.attach(model, opt, log_dir=str(tmp_path), every=2) as probe:
            for _ in range(5):
                model(torch.randn(4, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        assert probe.latest is not None
        ratios.append(probe.latest.scalars[tags.format("grad_ratio", "lins")])
        time.sleep(1.1)  # event file names carry the second they were started
    rep = rp.report(tmp_path)
    assert rep.event_files == 2 and rep.steps == [0, 2, 4]
    assert rep.repeated_steps == [0, 2, 4]
    assert "3 logged steps (0..4) appear in more than one event file" in rep.table()
    assert rep.row("lins", "grad_ratio").last == pytest.approx(ratios[1], rel=1e-6)
    assert rep.row("lins", "grad_ratio").last != pytest.approx(ratios[0], rel=1e-3)


def test_one_logged_step_raises_no_trend_flag(tmp_path: Path) -> None:
    # the Post-LN stack's 2.35 at init, logged once: diagnose's business, not a run's trend
    torch.manual_seed(0)
    stack = ResidualStack(48, 64, pre_ln=False)
    with normprobe.attach(stack, log_dir=str(tmp_path)) as probe:
        stack(torch.randn(16, 64)).pow(2).mean().backward()
        probe.step()
    rep = rp.report(tmp_path)
    assert rep.row("lins", "grad_ratio").last == pytest.approx(2.35, abs=0.005)
    assert rep.flags == []


def test_flag_wording_follows_the_placement(stacks: dict[str, rp.RunReport]) -> None:
    post = {f.kind: f.message for f in stacks["post"].flags if f.stack == "lins"}
    assert "as in Post-LN" in post["top-heavy gradients"]
    pre = {f.kind: f.message for f in stacks["pre_large_input"].flags if f.stack == "lins"}
    assert "typical of Pre-LN" in pre["representation collapse"]
    low = {f.kind: f.message for f in stacks["pre_small_input"].flags if f.stack == "lins"}
    assert "Pre-LN's skew" in low["bottom-heavy gradients"]
    for rep in stacks.values():
        for flag in rep.flags:
            # advice names calls a user makes on their own model, never the library's toys
            assert "TinyTransformer" not in flag.message and "ResidualStack" not in flag.message
            if flag.stack == "lins" and rep is stacks["post"]:
                assert "Pre-LN" not in flag.message
