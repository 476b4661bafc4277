"""The TensorBoard sink's checksums: TensorBoard's own, computed in C."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
from tb import read_events, read_texts
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer

from normprobe import tags
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


@pytest.mark.parametrize(("seconds", "drawn"), [(3600.0, [3, 5]), (0.0, [3, 4, 5])])
def test_heatmaps_are_redrawn_at_a_bounded_cadence(
    tmp_path: Path, seconds: float, drawn: list[int]
) -> None:
    pytest.importorskip("matplotlib")
    sink = TensorBoardSink(log_dir=str(tmp_path), heatmap_every=1, heatmap_seconds=seconds)
    for record in _profile_records(6):
        sink.write(record)
    sink.close()
    images = read_events(str(tmp_path)).images[heatmap_tag("grad_norm", "blocks")]
    # from 4 logged steps on, at every record but at most once an hour; and at the close
    # unless nothing changed since the last drawing
    assert images == drawn


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
    from normprobe.models import ResidualStack

    torch.manual_seed(0)
    stack = ResidualStack(8, 16)
    opt = torch.optim.SGD(stack.parameters(), lr=0.0)
    with normprobe.attach(stack, opt, log_dir=str(tmp_path), every=1):
        for _ in range(3):
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
