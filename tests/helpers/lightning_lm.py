"""A tiny transformer as a LightningModule, its tokens, and a CPU trainer with the probe's
callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

import normprobe
from normprobe.models import TinyTransformer


class LM(L.LightningModule):
    """An existing-style LightningModule: the model lives in ``self.model``."""

    def __init__(self, depth: int = 3, fail_at: int | None = None) -> None:
        super().__init__()
        self.model = TinyTransformer(depth=depth)
        self.fail_at = fail_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("training crashed")
        loss = self.model.loss(batch, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(n: int = 64) -> DataLoader[torch.Tensor]:
    return DataLoader(torch.randint(0, 96, (n, 32)), batch_size=8)  # type: ignore[arg-type]


def trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": 6,
        "log_every_n_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": TensorBoardLogger(str(tmp_path), name="run"),
        "callbacks": [normprobe.NormProbe()],
    }
    options.update(kwargs)
    return L.Trainer(**options)
