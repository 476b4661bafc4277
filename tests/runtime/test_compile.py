"""torch.compile: with the probe's hooks in place before compilation, no graph break and no
recompilation comes from normprobe, logged steps included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tb import read_events
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

import normprobe
from normprobe import tags
from normprobe.models import TinyTransformer


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.slow
def test_compiled_model_keeps_one_graph_and_logs_the_eager_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 96, (2, 16))
    results = {}
    for compiled in (False, True):
        torch.manual_seed(1)
        model = TinyTransformer(depth=2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        probe = normprobe.Probe(model, optimizer=opt, every=5, persistent_hooks=compiled)
        probe.discover_now(x)  # hooks exist before torch.compile sees the model
        run = torch.compile(model, backend="eager") if compiled else model
        per_step = []
        for _ in range(20):
            before = _graphs()
            loss = torch.nn.functional.cross_entropy(run(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            after = _graphs()
            per_step.append((after[0] - before[0], after[1] - before[1]))
        probe.remove()
        assert probe.latest is not None and probe.latest.step == 15
        results[compiled] = (per_step, probe.latest.scalars)
    per_step, compiled_values = results[True]
    assert all(graphs == 0 and breaks == 0 for graphs, breaks in per_step[1:])
    assert per_step[0][1] == 0
    eager_values = results[False][1]
    # attention logits need a torch function mode, and the backward's NaN provenance tensor
    # hooks, which compiled graphs cannot hold
    eager_only = (tags.prefix("nonfinite") + "backward_modules", "normprobe/attn_")
    expected = {k: v for k, v in eager_values.items() if not k.startswith(eager_only)}
    assert compiled_values == pytest.approx(expected, rel=1e-4)


class Compiled(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.compile(TinyTransformer(depth=2), backend="eager")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch)  # through the compiled module
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class CountGraphs(Callback):
    def __init__(self) -> None:
        self.per_step: list[tuple[int, int]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.before = _graphs()

    def on_train_batch_end(self, *args: Any) -> None:
        after = _graphs()
        self.per_step.append((after[0] - self.before[0], after[1] - self.before[1]))


@pytest.mark.slow
def test_lightning_module_with_a_compiled_model(tmp_path: Path) -> None:
    spy = CountGraphs()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=5,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        callbacks=[normprobe.NormProbe(), spy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(torch.randint(0, 96, (160, 16)), batch_size=8)  # type: ignore[arg-type]
    trainer.fit(Compiled(), data)
    assert len(spy.per_step) == 20
    assert all(step == (0, 0) for step in spy.per_step[1:]), spy.per_step
    assert spy.per_step[0][1] == 0
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    events = read_events(trainer.logger.log_dir)
    steps = [s for s, _ in events.scalars[tags.format("grad_ratio", "model.blocks")]]
    assert steps == [0, 4, 9, 14, 19]
    assert tags.format("resid_rms", "model.blocks", 1) in events.scalars
