"""A character-level transformer trained with Lightning, watched by NormProbe in one line.

    python examples/lightning_transformer.py [--steps 300] [--placement pre|post|sandwich]
    tensorboard --logdir lightning_logs

The LightningModule below is written the way one usually is; the only normprobe line is the
callback in `main()`. The corpus ships with Python (see `normprobe.corpus`): nothing downloads.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

import normprobe
from normprobe.corpus import CharBatches, CharCorpus
from normprobe.models import TinyTransformer


class CharLM(L.LightningModule):
    def __init__(self, vocab_size: int, placement: str = "pre", lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyTransformer(
            vocab_size=vocab_size,
            width=64,
            depth=4,
            heads=4,
            context=64,
            placement=placement,  # type: ignore[arg-type]
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, targets = batch
        loss = self.model.loss(inputs, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--placement", choices=["pre", "post", "sandwich"], default="pre")
    parser.add_argument("--root", default=".", help="where lightning_logs/ goes")
    args = parser.parse_args()
    torch.manual_seed(0)
    corpus = CharCorpus(context=64)
    data = DataLoader(CharBatches(corpus, batch_size=16), batch_size=None)
    trainer = L.Trainer(
        max_steps=args.steps,
        log_every_n_steps=10,
        default_root_dir=args.root,
        accelerator="cpu",
        callbacks=[normprobe.NormProbe()],  # the one line
    )
    trainer.fit(CharLM(corpus.vocab_size, args.placement), data)
    print(f"\nSee the panels with: tensorboard --logdir {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
