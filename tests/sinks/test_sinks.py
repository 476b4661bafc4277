"""The TensorBoard sink: its checksums (TensorBoard's own, computed in C), its heatmaps (drawn
on a background thread within a CPU budget), the flags text, the summary tags and the charts."""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tb import read_events, read_texts
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer

from normprobe import plots, sinks, tags
from normprobe.sinks import Record, TensorBoardSink, charts, heatmap_tag, masked_crc32c


def test_masked_crc32c_is_tensorboards_own() -> None:
    rng = random.Random(0)
    samples = [b"", b"a", bytes(range(256))] + [
        rng.randbytes(rng.randrange(1, 5000)) for _ in range(50)
    ]
    for data in samples:
        assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)


def test_a_sink_writes_records_tensorboard_verifies(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path))
    assert record_writer.masked_crc32c is masked_crc32c
    for step in range(3):
        sink.write(
            Record(step, scalars={tags.format("x", str(i)): step + i / 10 for i in range(300)})
        )
    sink.close()
    # the reader recomputes every record's checksum in pure Python and drops what fails
    scalars = read_events(str(tmp_path)).scalars
    assert len(scalars) == 300
    series = scalars[tags.format("x", "7")]
    assert [step for step, _ in series] == [0, 1, 2]
    assert [value for _, value in series] == pytest.approx([0.7, 1.7, 2.7])


def _profile_records(n: int) -> list[Record]:
    tag = tags.format("grad_norm", "blocks")
    return [Record(step, profiles={tag: [1.0 + step, 2.0, 3.0]}) for step in range(n)]


def test_a_run_shorter_than_heatmap_seconds_gets_its_heatmaps_at_close(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=1)  # the first waits a minute
    for record in _profile_records(6):
        sink.write(record)
    sink.close()
    assert read_events(str(tmp_path)).images[heatmap_tag("grad_norm", "blocks")] == [5]


class Drawings:
    """`plots.depth_heatmap` as it is, noting the thread of each call (``entered`` is set at
    the first); with ``hold`` set, each call first waits until `release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: bool = False) -> None:
        self.draw = plots.depth_heatmap
        self.threads: list[threading.Thread] = []
        self.entered, self.go = threading.Event(), threading.Event()
        if not hold:
            self.go.set()
        monkeypatch.setattr(plots, "depth_heatmap", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        self.entered.set()
        assert self.go.wait(60)
        return self.draw(*args, **kwargs)

    def release(self) -> None:
        self.go.set()


def wait_drawn(sink: TensorBoardSink) -> None:
    """Wait for the drawing under way (there is one) to finish; the next write writes it."""
    assert sink._pending is not None
    sink._pending.exception(timeout=60)


def test_heatmaps_are_drawn_off_the_training_thread_one_drawing_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    drawings = Drawings(monkeypatch, hold=True)
    # no wait and all the CPU: a drawing starts whenever none is under way
    sink = TensorBoardSink(
        log_dir=str(tmp_path), heatmap_every=1, heatmap_seconds=0.0, heatmap_cpu=1.0
    )
    records = _profile_records(8)
    for record in records[:4]:
        sink.write(record)
    drawing = sink._pending
    assert drawing is not None and drawings.entered.wait(60)
    for record in records[4:6]:  # the drawing of step 3 waits: steps 4 and 5 start no other
        sink.write(record)
    assert sink._pending is drawing and len(drawings.threads) == 1
    assert drawings.threads[0] is not threading.current_thread()
    assert drawings.threads[0].name == "normprobe-heatmaps"
    drawings.release()
    wait_drawn(sink)
    sink.write(records[6])  # writes the picture of step 3, drawn from the columns then
    sink.flush()
    tag = heatmap_tag("grad_norm", "blocks")
    assert read_events(str(tmp_path)).images[tag] == [3]
    sink.write(records[7])
    sink.close()  # waits for a drawing under way, draws the columns added since
    assert read_events(str(tmp_path)).images[tag][0] == 3
    assert read_events(str(tmp_path)).images[tag][-1] == 7
    assert drawings.threads[-1] is threading.current_thread()  # close draws on its own thread


def test_the_next_drawing_waits_until_its_cpu_time_is_the_budgets_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    # each drawing takes 0.5 s of CPU by this clock: at 1%, the next waits 50 s after it
    now = [0.0]
    cpu = itertools.count(step=0.5)
    fake = SimpleNamespace(monotonic=lambda: now[0], thread_time=lambda: next(cpu))
    # the sink reads the clock, its drawing thread the CPU time and the clock
    monkeypatch.setattr(sinks.tensorboard, "time", fake)
    monkeypatch.setattr(sinks.heatmaps, "time", fake)
    sink = TensorBoardSink(
        log_dir=str(tmp_path), heatmap_every=1, heatmap_seconds=10.0, heatmap_cpu=0.01
    )
    clock = [0.0, 1.0, 2.0, 9.0, 10.0, 30.0, 59.9, 60.0, 61.0]
    started = []
    for step, t in enumerate(clock):
        now[0] = t
        sink.write(Record(step, profiles={tags.format("grad_norm", "blocks"): [1.0, 2.0]}))
        if sink._pending is not None:  # this write started one (it wrote the last one)
            started.append(t)
            wait_drawn(sink)  # it finishes at once by the clock
    # not before 10 s from the first record, nor before 0.5 s / 1% after the last finished
    assert started == [10.0, 60.0]
    sink.close()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_drawing_under_way_does_not_keep_a_dying_process_or_its_events(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    # the drawing never ends; an uncaught exception ends the process, which leaves at once,
    # with every step written on disk
    script = tmp_path / "crash.py"
    script.write_text(CRASH.format(log_dir=str(tmp_path / "logs")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "RuntimeError: training failed" in done.stderr, done.stderr
    events = read_events(str(tmp_path / "logs"))
    assert [s for s, _ in events.scalars[tags.format("x", "0")]] == list(range(6))
    assert not events.images


CRASH = """
import threading
from normprobe import plots, tags
from normprobe.sinks import Record, TensorBoardSink

stuck = threading.Event()
plots.depth_heatmap = lambda *args, **kwargs: stuck.wait()
sink = TensorBoardSink(log_dir={log_dir!r}, heatmap_every=1, heatmap_seconds=0.0)
for step in range(6):
    sink.write(
        Record(step, scalars={{tags.format("x", "0"): 1.0}},
               profiles={{tags.format("grad_norm", "blocks"): [1.0, 2.0]}})
    )
assert sink._pending is not None and not sink._pending.done()
raise RuntimeError("training failed")
"""


def test_heatmap_cpu_is_a_share_of_the_wall_time(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"heatmap_cpu=0 is not a fraction of the wall time"):
        TensorBoardSink(log_dir=str(tmp_path), heatmap_cpu=0)


def _two_stacks() -> Record:
    """An encoder-decoder's step: gradient norms 2, 1, 0.5 down the encoder, 1 then 3 in the
    decoder; residual RMS 1 then 1.5 in the decoder."""
    grads = {"encoder.layers": [2.0, 1.0, 0.5], "decoder.layers": [1.0, 3.0]}
    scalars = {
        tags.format("grad_norm", stack, b, depth=len(v)): x
        for stack, v in grads.items()
        for b, x in enumerate(v)
    }
    scalars[tags.format("grad_ratio", "encoder.layers")] = 0.25
    scalars[tags.format("grad_ratio", "decoder.layers")] = 3.0
    scalars[tags.format("resid_growth", "decoder.layers")] = 1.5
    scalars["train_loss"] = 2.0
    profiles = {tags.format("grad_norm", stack): v for stack, v in grads.items()}
    profiles[tags.format("attn_logits_head", "decoder.layers", 0, "attn")] = [1.0, 2.0]
    return Record(7, scalars, profiles)


def test_record_accessors_read_any_stack_by_its_name() -> None:
    record = _two_stacks()
    assert record.stacks == ["decoder.layers", "encoder.layers"]  # per-head vectors are no stack
    assert record.series("grad_ratio") == {"encoder.layers": 0.25, "decoder.layers": 3.0}
    assert record.series("grad_norm")["decoder.layers/1"] == 3.0
    assert record.series("resid_cos") == {}  # a family this step did not measure
    assert record.grad_ratio(stack="encoder.layers") == 0.25
    assert record.resid_growth() == 1.5  # the only stack with one
    with pytest.raises(ValueError, match=r"2 stacks have a grad_ratio \(encoder.layers, decod"):
        record.grad_ratio()
    with pytest.raises(ValueError, match="no grad_ratio for stack 'blocks'; stacks: encoder"):
        record.grad_ratio("blocks")
    with pytest.raises(ValueError, match="no series is called 'grad_ratios' \\(did you mean 'gr"):
        record.series("grad_ratios")
    with pytest.raises(ValueError, match="no resid_growth at step 3: its family was not among"):
        Record(3).resid_growth()


def test_flags_text_lists_problems_then_notes(tmp_path: Path) -> None:
    # a Pre-LN stack fed an input 100x its blocks' writes: representation collapse (a problem);
    # its gradients pile up in the first block (bottom-heavy: a note)
    import torch

    import normprobe
    from normprobe.metrics import resid_cos
    from normprobe.models import ResidualStack

    torch.manual_seed(0)
    stack = ResidualStack(8, 16)
    opt = torch.optim.SGD(stack.parameters(), lr=0.0)
    with normprobe.attach(stack, opt, log_dir=str(tmp_path), every=1):
        for _ in range(resid_cos.JUDGED_AFTER):  # collapsed from the start: judged after those
            stack(100 * torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
    rep = normprobe.report_run(tmp_path)
    assert [f.severity for f in rep.flags] == sorted((f.severity for f in rep.flags), reverse=True)
    texts = read_texts(str(tmp_path))[tags.format("flags", "run") + "/text_summary"]
    text = texts[-1][1]
    problems = [f for f in rep.flags if f.severity == "problem"]
    assert problems and text.startswith(f"**Problems ({len(problems)}), worth stopping for:**")
    assert text.index("[representation collapse]") < text.index("**Notes (")


def test_summary_tags_log2_ratios_and_each_stacks_largest_logit(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=0)
    logits = {tags.format("attn_logit_max", "blocks", b, "attn"): v for b, v in enumerate([3, 7])}
    ratios = [(100.0, 0.5), (0.0, math.inf)]
    for step, (grad, growth) in enumerate(ratios):
        scalars = {tags.format("grad_ratio", "blocks"): grad}
        scalars[tags.format("resid_growth", "blocks")] = growth
        sink.write(Record(step, scalars={**scalars, **logits}))
    sink.close()
    scalars = read_events(str(tmp_path)).scalars
    log2 = scalars[tags.format("summary", "grad_ratio_log2/blocks")]
    assert log2[0] == (0, pytest.approx(math.log2(100))) and math.isnan(log2[1][1])
    growth = scalars[tags.format("summary", "resid_growth_log2/blocks")]
    assert growth[0] == (0, -1.0) and math.isnan(growth[1][1])  # no log of 0 or inf
    assert scalars[tags.format("summary", "attn_logit_max/blocks")] == [(0, 7.0), (1, 7.0)]


def test_custom_scalars_chart_a_few_blocks_each_one_tag() -> None:
    names = [tags.format("resid_rms", "blocks", b, depth=10) for b in range(10)]
    names += [tags.format("grad_ratio", "blocks"), tags.format("summary", "grad_ratio_log2/x")]
    found = charts(names)
    # spread over the depth, first and last included; the summary's own tags chart nowhere
    titles = [title for _, title, _ in found]
    assert titles == ["blocks/0", "blocks/3", "blocks/6", "blocks/9", "blocks"]
    assert found[1][2] == "^" + re.escape(tags.format("resid_rms", "blocks", 3, depth=10)) + "$"


def test_flags_are_judged_within_the_cpu_budget(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=1, heatmap_cpu=1e-9)
    judged = []
    judge = sink._judge_flags

    def counted() -> None:
        judged.append(sink._records)
        judge()

    sink._judge_flags = counted  # type: ignore[method-assign]
    for step in range(5):
        sink.write(Record(step, scalars={"normprobe/resid_rms/blocks/0": 1.0}))
    # the first judging's CPU time at a billionth of the wall time: none again for hours
    assert judged == [1]
    sink.close()
    assert judged == [1, 5]  # and at close
