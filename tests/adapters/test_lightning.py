"""The NormProbe callback in real Lightning Trainers."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hooks import hook_count
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning_lm import LM, tokens, trainer
from tb import read_events
from torch import nn
from torch.utils.data import DataLoader

import normprobe
from normprobe import tags


@pytest.mark.slow
def test_writes_into_the_trainers_run_on_its_steps(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    module = LM()
    t.fit(module, tokens())
    assert t.logger is not None and t.logger.log_dir is not None
    events = read_events(t.logger.log_dir)
    lightning_steps = [s for s, _ in events.scalars["train_loss"]]
    assert lightning_steps == [1, 3, 5]
    # the same steps, plus step 0 (the model at initialization)
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]] == [0, 1, 3, 5]
    assert [s for s, _ in events.scalars[tags.format("resid_rms", "model.blocks", 0)]] == [
        0,
        1,
        3,
        5,
    ]
    assert len(events.layouts) == 1
    assert hook_count(module) == 0  # removed at teardown


class GradSpy(Callback):
    """Records what the gradients are when the optimizer is about to step."""

    def __init__(self) -> None:
        self.norms: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.norms.append(
            [
                float(torch.cat([p.grad.flatten() for p in block.parameters()]).norm())
                for block in pl_module.model.blocks
            ]
        )


@pytest.mark.slow
def test_gradients_once_per_optimizer_step_before_clipping(tmp_path: Path) -> None:
    spy = GradSpy()
    t = trainer(
        tmp_path,
        callbacks=[normprobe.NormProbe(every=1, metrics=["grad_norm"]), spy],
        accumulate_grad_batches=2,
        gradient_clip_val=1e-3,
        max_steps=3,
    )
    t.fit(LM(), tokens())
    assert t.logger is not None and t.logger.log_dir is not None
    events = read_events(t.logger.log_dir)
    for block in range(3):
        series = events.scalars[tags.format("grad_norm", "model.blocks", block)]
        assert [s for s, _ in series] == [0, 1, 2]  # 6 batches, 3 optimizer steps
        assert [v for _, v in series] == pytest.approx([n[block] for n in spy.norms], rel=1e-5)
        assert min(v for _, v in series) > 1e-3  # read before clipping to 1e-3


@pytest.mark.slow
def test_other_loggers_get_scalars_and_a_tensorboard_folder(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    t = trainer(tmp_path, logger=logger)
    t.fit(LM(), tokens())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    ratio = [r for r in rows if r.get(tags.format("grad_ratio", "model.blocks"))]
    assert [int(r["step"]) for r in ratio] == [0, 1, 3, 5]
    events = read_events(str(Path(logger.log_dir) / "normprobe"))
    assert tags.format("resid_rms", "model.blocks") in events.profiles and len(events.layouts) == 1


@pytest.mark.slow
def test_without_a_logger_a_default_directory_is_used(tmp_path: Path) -> None:
    t = trainer(tmp_path, logger=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no logger; writing TensorBoard files to"):
        t.fit(LM(), tokens())
    events = read_events(str(tmp_path / "normprobe_logs"))
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]] == [0, 1, 3, 5]


def test_added_twice_is_an_error(tmp_path: Path) -> None:
    t = trainer(tmp_path, callbacks=[normprobe.NormProbe(), normprobe.NormProbe()])
    with pytest.raises(RuntimeError, match="NormProbe was added 2 times"):
        t.fit(LM(), tokens())


@pytest.mark.slow
def test_crash_mid_epoch_flushes_and_removes_hooks(tmp_path: Path) -> None:
    module = LM(fail_at=4)
    t = trainer(tmp_path, callbacks=[normprobe.NormProbe(every=1)])
    with pytest.raises(RuntimeError, match="training crashed"):
        t.fit(module, tokens())
    assert t.logger is not None and t.logger.log_dir is not None
    steps = [
        s
        for s, _ in read_events(t.logger.log_dir).scalars[tags.format("grad_ratio", "model.blocks")]
    ]
    assert steps == [0, 1, 2, 3]
    assert hook_count(module) == 0


@pytest.mark.slow
def test_resume_continues_the_steps_without_a_second_layout(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="run", version="v0")
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    t = trainer(tmp_path, logger=logger, max_steps=4, enable_checkpointing=True,
                callbacks=[normprobe.NormProbe(), checkpoints])  # fmt: skip
    t.fit(LM(), tokens())
    logger = TensorBoardLogger(str(tmp_path), name="run", version="v0")
    again = [normprobe.NormProbe(), ModelCheckpoint(dirpath=str(tmp_path / "c2"))]
    t = trainer(tmp_path, logger=logger, max_steps=8, enable_checkpointing=True, callbacks=again)
    t.fit(LM(), tokens(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    events = read_events(logger.log_dir)
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]] == [
        0,
        1,
        3,
        5,
        7,
    ]
    assert len(events.layouts) == 1


class BNModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.net(batch).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_batchnorm_statistics_at_validation(tmp_path: Path) -> None:
    train = DataLoader(torch.randn(64, 8) * 3 + 2, batch_size=16)  # type: ignore[arg-type]
    val = DataLoader(torch.randn(32, 8), batch_size=16)  # type: ignore[arg-type]
    t = trainer(tmp_path, max_steps=8, val_check_interval=4, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)
        t.fit(BNModule(), train, val)
    assert t.logger is not None and t.logger.log_dir is not None
    events = read_events(t.logger.log_dir)
    val_gap = events.scalars[tags.format("val_bn_gap", "net.1")]
    assert [s for s, _ in val_gap] == [4, 8]
    # the validation data has another distribution than the running statistics
    assert all(v > 0.1 for _, v in val_gap)
    assert tags.format("bn_gap", "net.1") in events.scalars


def test_bf16_mixed_statistics_and_gradients(tmp_path: Path) -> None:
    # (16-mixed, with its loss scaling, falls back to bf16-mixed on CPU; unscaling is tested
    # with torch.amp.GradScaler in test_runtime.py)
    spy = GradSpy()  # the gradients Lightning hands the optimizer
    probe = normprobe.NormProbe(every=1)
    t = trainer(tmp_path, precision="bf16-mixed", callbacks=[probe, spy], max_steps=3)
    t.fit(LM(), tokens())
    assert t.logger is not None and t.logger.log_dir is not None
    events = read_events(t.logger.log_dir)
    values = [v for series in events.scalars.values() for _, v in series]
    assert values and all(v == v and abs(v) < 1e6 for v in values)
    assert events.scalars[tags.format("nonfinite", "modules")][-1][1] == 0
    logged = [v for _, v in events.scalars[tags.format("grad_norm", "model.blocks", 0)]]
    assert logged == pytest.approx([n[0] for n in spy.norms], rel=1e-4)


def test_deepspeed_strategy_is_said_to_read_no_gradients() -> None:
    """Lightning's DeepSpeedStrategy runs on CUDA alone (Lightning says so at fit); where it
    runs, the callback drops the families that read ZeRO's partitioned tensors, by name."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DeepSpeedStrategy(stage=2),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    callback = normprobe.NormProbe()
    with pytest.warns(RuntimeWarning, match=r"DeepSpeedStrategy") as caught:
        callback.setup(trainer, L.LightningModule(), "fit")
    message = str(caught[0].message)
    assert "grad_norm, update_ratio, weight_rms, norm_gain, spikes" in message
    assert "normprobe.attach(engine.module, optimizer=engine.optimizer)" in message
    assert not set(callback.metrics) & {"grad_norm", "weight_rms", "update_ratio", "norm_gain"}
    assert callback.spikes is None and "resid_rms" in callback.metrics
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer.strategy.setup_environment()


class PaddedLM(LM):
    """neuralforecast's BaseModel: training_step pads the batch with a child module
    (``self.padder_train``, a ConstantPad1d) before it calls the model."""

    def __init__(self) -> None:
        super().__init__()
        self.padder = nn.ConstantPad1d((0, 1), 0)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        padded = self.padder(batch.float()).long()
        loss = self.model.loss(padded, padded)
        self.log("train_loss", loss)
        return loss


def test_a_weightless_child_called_first_is_not_mapped(tmp_path: Path) -> None:
    probe = normprobe.NormProbe()
    t = trainer(tmp_path, callbacks=[probe])
    t.fit(PaddedLM(), tokens())
    assert t.logger is not None and t.logger.log_dir is not None
    events = read_events(t.logger.log_dir)
    assert tags.format("resid_rms", "model.blocks", 0) in events.scalars  # not the padding's
