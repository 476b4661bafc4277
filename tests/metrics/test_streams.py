"""The residual streams of a logged forward are reduced a chunk at a time once the probe knows
they stay as read: the values of every logged forward, the first (each stream reduced as it
is read) and the later ones (held and reduced together, in chunks of 32), equal a manual
forward's, for the stream RMS, the cosines (across chunks too) and the outlier statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import normprobe
from normprobe import probes, tags
from normprobe.metrics.core.scratch import SCRATCH_MIN, Scratch
from normprobe.models import ResidualStack


@pytest.mark.parametrize("pre_ln", [True, False])
def test_every_logged_forward_matches_a_manual_one(pre_ln: bool) -> None:
    torch.manual_seed(0)
    model = ResidualStack(40, 16, pre_ln=pre_ln)  # two chunks: 32 blocks and 8
    x = torch.randn(8, 16)
    streams, h = [], x
    with torch.no_grad():
        for ln, lin in zip(model.lns, model.lins, strict=True):
            h = h + lin(ln(h)) if pre_ln else ln(h + lin(h))
            streams.append(h)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    metrics = ["resid_rms", "resid_cos", "outliers"]
    sink = normprobe.MemorySink()
    with normprobe.attach(model, opt, every=1, metrics=metrics, sinks=[sink]) as probe:
        for _ in range(3):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert probe.latest is not None
            profiles = probe.latest.profiles  # each series over the 40 blocks
            rms, cos = (
                profiles[tags.format("resid_rms", "lins")],
                profiles[tags.format("resid_cos", "lins")],
            )
            ratios = profiles[tags.format("outlier_ratio", "lins")]
            channels = profiles[tags.format("outlier_channel", "lins")]
            kurtoses = profiles[tags.format("outlier_kurtosis", "lins")]
            for i, stream in enumerate(streams):
                assert rms[i] == pytest.approx(float(stream.pow(2).mean().sqrt()), rel=1e-5)
                ratio, channel, kurtosis = probes.outlier_stats(stream).tolist()
                assert ratios[i] == pytest.approx(ratio, rel=1e-5)
                assert channels[i] == channel
                assert kurtoses[i] == pytest.approx(kurtosis, rel=1e-5)
            for i in range(1, 40):
                want = float(F.cosine_similarity(streams[i - 1], streams[i], dim=-1).mean())
                assert cos[i] == pytest.approx(want, rel=1e-5)


def test_stacked_reductions_equal_one_at_a_time() -> None:
    torch.manual_seed(0)
    for shape in [(6, 10), (2, 5, 10), (2, 3, 4, 5), (10,)]:
        tensors = [torch.randn(shape) * (k + 1) for k in range(5)]
        stacked = torch.stack(tensors)
        norms = probes.row_norms_many(stacked)
        dots = probes.row_dots_many(stacked[:-1], stacked[1:])
        parts = probes.outlier_parts_many(stacked)
        for k, t in enumerate(tensors):
            assert torch.allclose(norms[k], probes.row_norms(t))
            if k:
                # float32 rounding of sums of terms near 10: absolute, where a dot cancels
                one = probes.row_dots(tensors[k - 1], t)
                torch.testing.assert_close(dots[k - 1], one, rtol=1e-5, atol=1e-5)
            for many, one in zip(parts, probes.outlier_parts(t), strict=True):
                assert torch.allclose(many[k], one)
        scratch = torch.full(stacked.shape, math.nan)
        for with_scratch, without in zip(
            probes.outlier_parts_many(stacked, scratch), parts, strict=True
        ):
            assert torch.equal(with_scratch, without)


def test_outlier_parts_by_hand_with_and_without_scratch() -> None:
    # 3 positions, 2 channels: channel 0 holds -4 (its max |x|), channel 1 holds 3, 0, 1
    x = torch.tensor([[1.0, 3.0], [-4.0, 0.0], [2.0, -1.0]])
    low = x.bfloat16()
    view = x.t().contiguous().t()  # the same values, not contiguous
    cases = [(t, s) for t in (x, low, view) for s in (None, torch.full((3, 2), math.nan))]
    for t, scratch in cases:
        top, power, sample = probes.outlier_parts(t, scratch)
        assert top.tolist() == [4.0, 3.0] and power.tolist() == [21.0, 10.0]
        assert top.dtype == power.dtype == sample.dtype == torch.float32
        # every entry sampled: 4 over the median of the nonzero |x| (1, 1, 2, 3, 4), which is
        # 2; the kurtosis of s^2 in proportion 21 : 10 is (21^2 + 10^2) / 2 / ((21 + 10) / 2)^2
        ratio, channel, kurtosis = probes.outlier_stats_many(top, power, sample).tolist()
        assert (ratio, channel) == (2.0, 0.0)
        assert kurtosis == pytest.approx((21**2 + 10**2) / 2 / (31 / 2) ** 2)
    assert torch.equal(x, torch.tensor([[1.0, 3.0], [-4.0, 0.0], [2.0, -1.0]]))  # untouched


def test_scratch_is_reused_within_a_forward_and_released() -> None:
    scratch = Scratch()
    stream = torch.randn(4, 128, 256)  # 131,072 entries: past SCRATCH_MIN
    first = scratch.like(stream)
    assert first is not None and first.shape == stream.shape and first.dtype == torch.float32
    smaller = scratch.like(stream[:2])
    assert smaller is not None and smaller.data_ptr() == first.data_ptr()  # the same memory
    low = scratch.like(stream.bfloat16())
    assert low is not None and low.dtype == torch.float32  # reduced in float32
    wide = scratch.like(stream.double())
    assert wide is not None and wide.dtype == torch.float64
    assert scratch.like(torch.randn(SCRATCH_MIN - 1)) is None  # small: the allocator keeps it
    assert Scratch(enabled=False).like(stream) is None  # a compiled graph
    scratch.release()  # `first` still holds the old memory: a new buffer must be made
    again = scratch.like(stream)
    assert again is not None and again.data_ptr() != first.data_ptr()
