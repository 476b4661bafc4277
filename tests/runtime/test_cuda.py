"""What only a CUDA device shows: host syncs, float32 and bfloat16 statistics on the device,
and surgery keeping the device. Skipped without CUDA (``make gpu-check`` runs them)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import normprobe
from normprobe import tags
from normprobe.models import MLPStack, TinyTransformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(model: TinyTransformer, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model.loss(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_one_sync_on_a_logged_step_and_none_otherwise() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(width=64, depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 96, (4, 32), device="cuda")
    sink = normprobe.MemorySink()
    normprobe.attach(model, opt, sinks=[sink], every=3)
    for _ in range(4):  # discovery, and constants made on the device at their first use
        _step(model, opt, x)
    counts = []
    for _ in range(6):  # steps 4..9: logged are 6 and 9
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(model, opt, x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts == [0, 0, 1, 0, 0, 1]
    assert [r.step for r in sink.records] == [0, 3, 6, 9]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_statistics_on_the_device_match_the_cpu(autocast: bool) -> None:
    torch.manual_seed(0)
    cpu = TinyTransformer(width=64, depth=4)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randint(0, 96, (4, 32))
    records = []
    for model, batch in ((cpu, x), (gpu, x.cuda())):
        sink = normprobe.MemorySink()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with normprobe.attach(model, opt, sinks=[sink], every=1):
            with torch.autocast(batch.device.type, torch.bfloat16, enabled=autocast):
                loss = model.loss(batch, batch)
            loss.float().backward()
            opt.step()
        records.append(sink.records[0].scalars)
    on_cpu, on_gpu = records
    assert set(on_gpu) == set(on_cpu)
    # bf16 keeps 8 bits of mantissa: its statistics agree to a few percent, fp32's to 1e-4
    tolerance = 5e-2 if autocast else 1e-4
    for tag in (
        tags.format("resid_rms", "blocks", 3, depth=4),
        tags.format("grad_ratio", "blocks"),
        tags.format("logits", "max_abs"),
    ):
        assert on_gpu[tag] == pytest.approx(on_cpu[tag], rel=tolerance), tag


def test_surgery_and_reinit_keep_device_and_dtype() -> None:
    model = TinyTransformer(width=64, depth=2).cuda().to(torch.bfloat16)
    x = torch.randint(0, 96, (2, 16), device="cuda")
    normprobe.convert_norms(model, "rmsnorm", example_inputs=(x,))
    normprobe.reinit(model, "gpt2", example_inputs=(x,))
    for p in model.parameters():
        assert p.is_cuda and p.dtype == torch.bfloat16
    assert torch.isfinite(model(x).float()).all()


def test_gradients_before_clipping_carry_no_loss_scale() -> None:
    """A GradScaler's scale, a device tensor, is divided out of the gradients read at the end
    of the backward; the values are those computed by hand before clipping."""
    from clipping import batches, check_clipped, clipped_loop

    torch.manual_seed(0)
    model = MLPStack(depth=3, width=16).cuda()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    records, hand, totals = clipped_loop(model, [x.cuda() for x in batches(3)], scaler=scaler)
    check_clipped(records, hand, totals, 3)
