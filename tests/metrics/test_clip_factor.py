"""``grad_clip_factor`` on gradients large enough to be read from a sample: exact when clipping
scales every gradient alike, close when it does not."""

from __future__ import annotations

import math

import pytest
import torch
from clipping import CLIP, MAX_NORM, batches, check_clipped, clipped_loop

import normprobe
from normprobe.metrics.core.grads import CLIP_SAMPLE, GradSquares
from normprobe.models import MLPStack


# width 128: read from a sample; width 16: every gradient whole, the total before clipping is
# grad_norm's own
@pytest.mark.parametrize("width", [128, 16])
def test_the_clip_factor_is_exact_under_clip_grad_norm(width: int) -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=width)
    largest = max(p.numel() for p in model.parameters())
    assert largest > 10 * CLIP_SAMPLE if width == 128 else largest <= CLIP_SAMPLE
    records, hand, totals = clipped_loop(model, batches(3, width=width))
    check_clipped(records, hand, totals, 2)  # the factor: MAX_NORM / total, to 1e-4
    for record, total in zip(records, totals, strict=True):
        assert record.scalars[CLIP] == pytest.approx(MAX_NORM / total, rel=1e-5)


def test_a_clip_by_value_reads_close_to_the_exact_factor() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=128)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = normprobe.MemorySink()
    probe = normprobe.attach(model, opt, every=1, metrics=["grad_norm"], sinks=[sink])
    exact = []
    for x in batches(3, width=128):
        (model(x) ** 2).mean().backward()
        before = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
        after = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        exact.append(after / before)
        opt.step()
        opt.zero_grad()
    probe.remove()
    assert all(0.05 < e < 0.95 for e in exact)  # clipped, and not by one factor everywhere
    read = [r.scalars[CLIP] for r in sink.records]
    assert read == pytest.approx(exact, rel=0.03)


# width 32: every gradient at most CLIP_SAMPLE entries, so the sample before clipping is the
# total of the squares grad_norm takes anyway (no read); width 64: the 64x256 weights are sampled
@pytest.mark.parametrize(("width", "reads"), [(32, [0, 1, 0]), (64, [1, 2, 1])])
def test_gradients_nothing_clipped_are_not_read_again_at_the_step(
    monkeypatch: pytest.MonkeyPatch, width: int, reads: list[int]
) -> None:
    calls = [0]
    sampled_total = GradSquares.sampled_total

    def counted(self: GradSquares) -> torch.Tensor:
        calls[0] += 1
        return sampled_total(self)

    monkeypatch.setattr(GradSquares, "sampled_total", counted)
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = normprobe.MemorySink()
    with normprobe.attach(model, opt, every=1, metrics=["grad_norm"], sinks=[sink]) as probe:
        counts = []
        for clip in (False, True, False):
            calls[0] = 0
            (model(torch.randn(4, width)) ** 2).mean().backward()
            if clip:  # in place: the factor is read at the step again
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
            counts.append(calls[0])
            assert probe.latest is not None
            factor = probe.latest.scalars[CLIP]
            assert factor < 0.1 if clip else factor == 1.0
    assert counts == reads  # before clipping (unless whole); at the step only after a clip
