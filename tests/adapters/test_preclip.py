"""Gradients as the trainer sees them before clipping, in every way in (a plain loop, Accelerate,
the Hugging Face Trainer, Lightning), with the total, the rest and the clip factor; each against
the gradients computed by hand before clipping, with clipping active (values smaller by the clip
factor fail)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from clipping import (
    CLIP,
    MAX_NORM,
    REST,
    TOTAL,
    batches,
    check_clipped,
    clipped_loop,
    logged,
    norms,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tb import read_events
from torch import nn
from torch.utils.data import DataLoader

import normprobe
from normprobe import report as rp
from normprobe import tags
from normprobe.common import is_compiled
from normprobe.models import MLPStack, TinyTransformer


def test_plain_loop_reads_before_clip_grad_norm() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=16)
    records, hand, totals = clipped_loop(model, batches(4))
    check_clipped(records, hand, totals, 3)


def test_accumulated_micro_batches_give_one_large_batch() -> None:
    data = batches(8, rows=4)
    results = []
    for accumulate, inputs in ((4, data), (1, [torch.cat(data[i : i + 4]) for i in (0, 4)])):
        torch.manual_seed(0)
        records, hand, totals = clipped_loop(
            MLPStack(depth=3, width=16), inputs, accumulate=accumulate
        )
        check_clipped(records, hand, totals, 3)
        results.append([logged(r, "blocks", 3) for r in records])
    small, large = results
    for a, b in zip(small, large, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_a_grad_scaler_handed_over_is_divided_out() -> None:
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    records, hand, totals = clipped_loop(MLPStack(depth=3, width=16), batches(3), scaler=scaler)
    check_clipped(records, hand, totals, 3)


def test_a_grad_scaler_not_handed_over_is_found_at_its_step() -> None:
    """Step 0 is read at the backward's end before the scaler is known: divided at the step."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records, hand, totals = clipped_loop(
            MLPStack(depth=3, width=16), batches(3), scaler=scaler, hand_scaler=False
        )
    check_clipped(records, hand, totals, 3)


def test_a_grad_scaler_not_handed_over_without_clipping() -> None:
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    records, hand, _ = clipped_loop(
        MLPStack(depth=3, width=16), batches(2), scaler=scaler, hand_scaler=False, max_norm=math.inf
    )
    for record, expected in zip(records, hand, strict=True):
        assert logged(record, "blocks", 3) == pytest.approx(expected, rel=1e-5)
        assert record.scalars[CLIP] == pytest.approx(1.0, rel=1e-6)


def test_a_grad_scaler_stepping_unseen_is_warned_not_logged() -> None:
    """Unscaled by hand and stepped by ``opt.step()``: no scaler to find. Unclipped, the
    power of two shows (nothing written); clipped too, the warning says which it may be."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with pytest.warns(RuntimeWarning, match=r"4096x.*a power of two.*scaler=scaler"):
        records, _, _ = clipped_loop(
            MLPStack(depth=3, width=16),
            batches(2),
            scaler=scaler,
            hand_scaler=False,
            own_step=True,
            max_norm=math.inf,
        )
    assert records and not any(k.startswith("normprobe/grad_") for r in records for k in r.scalars)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"clipped and loss-scaled.*scaler=scaler"):
        clipped_loop(
            MLPStack(depth=3, width=16),
            batches(1),
            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12),
            hand_scaler=False,
            own_step=True,
        )


def test_gradients_set_by_hand_are_read_at_the_step() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = normprobe.MemorySink()
    probe = normprobe.Probe(model, optimizer=opt, sinks=[sink], every=1, metrics=["grad_norm"])
    probe.discover_now(torch.randn(2, 8))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    hand = norms(model.blocks, model)
    opt.step()
    probe.remove()
    [record] = sink.records
    assert logged(record, "blocks", 2) == pytest.approx(hand, rel=1e-6)
    assert CLIP not in record.scalars  # read at the step: clipping cannot be told apart


class Regress(nn.Module):
    """A model the Hugging Face Trainer trains: its output carries the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.model(x) ** 2).mean() * 50}


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


def test_parametrized_model() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=16, hidden_mult=1)
    for block in model.blocks:
        nn.utils.parametrize.register_parametrization(block.mlp.fc, "weight", Symmetric())
    records, hand, totals = clipped_loop(model, batches(3))
    check_clipped(records, hand, totals, 3)


def test_compiled_model() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=16)
    compiled = torch.compile(model, backend="eager")
    records, hand, totals = clipped_loop(model, batches(3), forward=compiled, persistent=True)
    check_clipped(records, hand, totals, 3)


def test_spike_capped_by_clipping_is_seen() -> None:
    """Clipped to 1e-3 the total at the step never changes; the spike before clipping shows."""
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = normprobe.MemorySink()
    x = torch.randn(8, 8)
    probe = normprobe.attach(
        model, opt, sinks=[sink], every=1000, spikes=normprobe.Spikes(window=16)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(30):
            (model(x) ** 2).mean().mul(1000 if step == 25 else 1).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
        probe.remove()
    spikes = [r.step for r in sink.records if tags.format("spike", "grad_z") in r.scalars]
    assert spikes == [25]


def test_spike_detector_takes_the_scale_found_at_the_step() -> None:
    """Step 0's norm, read at the backward's end before the scaler is known, is divided too:
    left 4096x, it would hide the spike at step 8 among 8 steps of history."""
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    sink = normprobe.MemorySink()
    x = torch.randn(8, 8)
    probe = normprobe.attach(
        model, opt, sinks=[sink], every=1000, spikes=normprobe.Spikes(window=8)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(10):
            scaler.scale((model(x) ** 2).mean().mul(1000 if step == 8 else 1)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        probe.remove()
    spikes = [r.step for r in sink.records if tags.format("spike", "grad_z") in r.scalars]
    assert spikes == [8]


def test_accelerate_clip_grad_norm() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=16)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    sink = normprobe.MemorySink()
    data = batches(6)
    probe = normprobe.attach(
        model, opt, sinks=[sink], every=1, metrics=["grad_norm"], example_inputs=(data[0],)
    )
    hand, totals = [], []
    with probe:
        for x in data:
            with accelerator.accumulate(model):
                accelerator.backward((model(x) ** 2).mean() * 50)
                if accelerator.sync_gradients:
                    hand.append(norms(model.blocks, model))
                    totals.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                opt.step()
                opt.zero_grad()
    check_clipped(sink.records, hand, totals, 3)


@pytest.mark.slow
def test_hf_trainer_total_is_its_own_grad_norm(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from normprobe.hf import NormProbeCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    data = [
        {"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))}
        for _ in range(32)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=1,
        learning_rate=0.05,
        max_grad_norm=0.25,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NormProbeCallback()])
    trainer.train()
    scalars: dict[str, list[tuple[int, float]]] = {}
    for run in sorted({p.parent for p in tmp_path.rglob("events.out.tfevents.*")}):
        scalars |= read_events(str(run)).scalars
    theirs = dict(scalars["train/grad_norm"])
    ours = dict(scalars[TOTAL])
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert min(theirs.values()) > 2 * 0.25  # the Trainer clipped every step
    rest = dict(scalars[REST])
    for step, total in ours.items():
        blocks = sum(
            dict(scalars[tags.format("grad_norm", "transformer.h", b)])[step] ** 2 for b in (0, 1)
        )
        assert blocks + rest[step] ** 2 == pytest.approx(total**2, rel=1e-5)
        assert dict(scalars[CLIP])[step] == pytest.approx(0.25 / total, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", ["parametrized", "compiled"])
def test_hf_trainer_parametrized_or_compiled(tmp_path: Path, wrapped: str) -> None:
    """Each block's norm where the Trainer is about to clip (its accelerator's
    ``clip_grad_norm_``, watched) is the one logged, two micro-batches a step."""
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from normprobe.hf import NormProbeCallback

    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = MLPStack(depth=3, width=16, hidden_mult=1)
    if wrapped == "parametrized":
        for block in inner.blocks:
            nn.utils.parametrize.register_parametrization(block.mlp.fc, "weight", Symmetric())
    model = Regress(inner)
    compiled = {"torch_compile": True, "torch_compile_backend": "eager"}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=0.05,
        max_grad_norm=MAX_NORM,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **(compiled if wrapped == "compiled" else {}),
    )
    probe = NormProbeCallback(metrics=["grad_norm"], spikes=None)
    records: list[normprobe.Record] = []

    class Latest(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            assert probe.latest is not None
            records.append(probe.latest)

    data = [{"x": torch.randn(16)} for _ in range(16)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe, Latest()])
    hand, totals = [], []
    clip = trainer.accelerator.clip_grad_norm_

    def watched(params: Any, max_norm: float, *a: Any, **k: Any) -> torch.Tensor:
        hand.append(norms(inner.blocks, model))
        total = clip(params, max_norm, *a, **k)
        totals.append(float(total))
        return total

    trainer.accelerator.clip_grad_norm_ = watched  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:  # the shared state keeps the dynamo backend: later Accelerators would compile
        AcceleratorState._reset_state()
    assert wrapped != "compiled" or is_compiled(trainer.model_wrapped)
    check_clipped(records, hand, totals, 3, stack="model.blocks")


class ClipSpy(Callback):
    """Each block's gradient norm where Lightning is about to clip, and after it clipped (at
    the end of the batch, before the next step zeroes them)."""

    def __init__(self) -> None:
        self.before: list[dict[str, float]] = []
        self.after: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before.append(norms(pl_module.model.blocks, pl_module.model))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.after.append(norms(pl_module.model.blocks, pl_module.model))


class LM(L.LightningModule):
    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        model = TinyTransformer(depth=2)
        self.model = torch.compile(model, backend="eager") if compiled else model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("compiled", [False, True])
def test_lightning_reads_before_gradient_clip_val(tmp_path: Path, compiled: bool) -> None:
    torch._dynamo.reset()
    spy = ClipSpy()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        log_every_n_steps=1,
        gradient_clip_val=0.05,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        callbacks=[normprobe.NormProbe(every=1, metrics=["grad_norm"]), spy],
    )
    trainer.fit(LM(compiled), DataLoader(torch.randint(0, 96, (24, 16)), batch_size=8))  # type: ignore[arg-type]
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    scalars = read_events(trainer.logger.log_dir).scalars
    for step, (before, after) in enumerate(zip(spy.before, spy.after, strict=True)):
        assert after["total"] == pytest.approx(0.05, rel=1e-3)  # Lightning clipped
        assert before["total"] > 0.1
        ours = {
            f"block{b}": dict(scalars[tags.format("grad_norm", "model.blocks", b)])[step]
            for b in (0, 1)
        }
        ours["total"] = dict(scalars[TOTAL])[step]
        assert ours == pytest.approx({k: before[k] for k in ours}, rel=1e-5)
        # read where Lightning has not clipped yet: the factor is clip_grad_norm_'s own,
        # gradient_clip_val over the total, which shrank the total Lightning stepped with
        factor = dict(scalars[CLIP])[step]
        assert factor == pytest.approx(0.05 / (before["total"] + 1e-6), rel=1e-5)
        assert factor == pytest.approx(after["total"] / before["total"], rel=1e-4) and factor < 1


def test_report_notes_a_run_clipped_on_most_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 8)
    with (
        pytest.warns(RuntimeWarning, match="6777x .* clipped that much"),
        normprobe.attach(model, opt, log_dir=str(tmp_path), every=2, spikes=None),
    ):
        for _ in range(8):
            (model(x) ** 2).mean().mul(100).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
    flags = [f for f in rp.report(tmp_path).flags if f.kind == "clipped gradients"]
    assert len(flags) == 1 and flags[0].severity == "note"
    assert "raise max_grad_norm" in flags[0].message
