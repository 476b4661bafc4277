"""Two-process DDP training on CPU (gloo) with NormProbe, run by tests/adapters/test_distributed.py.

    python tests/helpers/ddp_train.py OUT_DIR

Lightning starts the second rank by running this script again. Each rank writes what it saw
locally to OUT_DIR/rank<r>.json: its own activation values on logged steps, the synchronized
gradient norms, and how many collectives normprobe issued per step. On step 1 (a logged
one), rank 1 skips the last block, so it has no value for that block's metrics there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

import normprobe
from normprobe.models import Block

SKIP_STEP = 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 32)
        self.blocks = nn.ModuleList(Block(32, 4) for _ in range(3))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 96)

    def forward(self, idx: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks[:-1] if skip_last else self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        skip = self.global_rank == 1 and self.global_step == SKIP_STEP
        logits = self.net(batch, skip_last=skip)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Witness(Callback):
    """Records this rank's own view, to compare with what normprobe logged for all ranks."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: dict[str, Any] = {"local": {}, "grads": {}, "collectives": {}}
        self.collectives = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        gather = dist.all_gather

        def counting(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("normprobe"):
                self.collectives += 1
            return gather(*args, **kwargs)

        dist.all_gather = counting  # count the collectives normprobe issues
        net = pl_module.net
        self.handles = [
            net.head.register_forward_hook(self._record("logits_max", lambda t: t.abs().max())),
            *(
                block.register_forward_hook(
                    self._record(f"resid_{i}", lambda t: t.pow(2).mean().sqrt())
                )
                for i, block in enumerate(net.blocks)
            ),
        ]

    def _record(self, name: str, stat: Any) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if module.training:
                step = str(self.trainer.global_step)
                self.seen["local"].setdefault(step, {})[name] = float(stat(out.detach()))

        return hook

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.seen["grads"][str(trainer.global_step)] = [
            float(torch.cat([p.grad.flatten() for p in b.parameters()]).norm())
            for b in pl_module.net.blocks
        ]

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.seen["collectives"][str(trainer.global_step - 1)] = self.collectives
        self.collectives = 0

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        callback = next(c for c in trainer.callbacks if isinstance(c, normprobe.NormProbe))
        assert callback.probe is not None
        self.seen["sinks"] = len(callback.probe.sinks)
        rank = trainer.global_rank
        (self.out / f"rank{rank}.json").write_text(json.dumps(self.seen))


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    data = DataLoader(torch.randint(0, 96, (64, 16)), batch_size=8)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_find_unused_parameters_true",  # rank 1 skips a block once
        max_steps=4,
        log_every_n_steps=2,
        logger=TensorBoardLogger(str(out), name="ddp", version=0),
        callbacks=[normprobe.NormProbe(), Witness(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(LM(), data)


if __name__ == "__main__":
    main()
