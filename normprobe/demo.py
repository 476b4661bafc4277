"""`make demo`: four small transformers trained side by side, each watched by NormProbe.

The runs differ only where normalization sits and how it starts:

* ``pre-ln``: LayerNorm before each branch, a final LayerNorm (the modern default);
* ``post-ln``: LayerNorm after each residual add (the original Transformer), no warmup;
* ``post-ln-deepnorm``: the same Post-LN model re-initialized with ``normprobe.reinit(...,
  "deepnorm")``;
* ``pre-ln-rmsnorm``: the Pre-LN model with its norms swapped by ``normprobe.convert_norms(...,
  "rmsnorm")``.

They train on a character corpus read from Python's own standard library (nothing is
downloaded), write one TensorBoard run each under ``runs/demo/``, and end with a table that
compares them, each run's time per step included.

Torch runs on one thread by default: on a machine with two cores, two threads wait for each
other at every operation as soon as anything else needs a core, and a step then takes several
times longer (``--threads 2`` is faster on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from .corpus import CharBatches, CharCorpus
from .dashboard import dashboard_url
from .models import TinyTransformer
from .reinit import reinit
from .surgery import convert_norms

WIDTH, DEPTH, HEADS, CONTEXT = 64, 6, 4, 64
BATCH, LR = 32, 3e-3
# measured on 2 CPU cores, one thread: a step with its share of logging, and each run's set-up
SECONDS_PER_STEP, SECONDS_PER_RUN = 0.1, 3.0


def _pre_ln(vocab: int) -> nn.Module:
    return TinyTransformer(vocab, WIDTH, DEPTH, HEADS, CONTEXT, placement="pre")


def _post_ln(vocab: int) -> nn.Module:
    return TinyTransformer(vocab, WIDTH, DEPTH, HEADS, CONTEXT, placement="post")


def _deepnorm(vocab: int) -> nn.Module:
    model = _post_ln(vocab)
    return reinit(model, "deepnorm", example_inputs=(torch.zeros(2, CONTEXT, dtype=torch.long),))


def _rmsnorm(vocab: int) -> nn.Module:
    return convert_norms(_pre_ln(vocab), "rmsnorm")


RUNS: dict[str, Callable[[int], nn.Module]] = {
    "pre-ln": _pre_ln,
    "post-ln": _post_ln,
    "post-ln-deepnorm": _deepnorm,
    "pre-ln-rmsnorm": _rmsnorm,
}


@dataclass
class Result:
    name: str
    loss: float
    grad_ratio: float
    resid_growth: float
    attn_logit_max: float
    ms_per_step: float


def _train(name: str, make: Callable[[int], nn.Module], steps: int, root: str) -> Result:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from .lightning import NormProbe

    class CharLM(L.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model
            self.losses: list[torch.Tensor] = []

        def training_step(
            self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
        ) -> torch.Tensor:
            inputs, targets = batch
            logits = self.model(inputs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            self.log("train_loss", loss, prog_bar=True)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    # each run starts afresh: event files of an earlier demo would mix with this one's steps
    shutil.rmtree(os.path.join(root, "demo", name), ignore_errors=True)
    torch.manual_seed(0)
    corpus = CharCorpus(context=CONTEXT, seed=0)
    module = CharLM(make(corpus.vocab_size))
    probe = NormProbe()
    trainer = L.Trainer(
        max_steps=steps,
        log_every_n_steps=max(1, steps // 20),
        accelerator="cpu",
        logger=TensorBoardLogger(root, name="demo", version=name),
        callbacks=[probe],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    print(f"\n== {name}")
    start = time.perf_counter()
    trainer.fit(module, DataLoader(CharBatches(corpus, BATCH), batch_size=None))
    seconds = time.perf_counter() - start
    latest = probe.latest
    if latest is None:
        raise RuntimeError(f"the {name} run logged no step")
    tail = torch.stack(module.losses[-20:]).mean().item()  # one read at the end
    attention = latest.series("attn_logit_max").values()
    return Result(
        name,
        tail,
        latest.grad_ratio(),
        latest.resid_growth(),
        max(attention, default=math.nan),
        1000 * seconds / steps,
    )


def expected_seconds(steps: int) -> float:
    """How long the demo takes on 2 CPU cores with ``steps`` steps per run."""
    return len(RUNS) * (SECONDS_PER_RUN + steps * SECONDS_PER_STEP)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def summary(results: list[Result], log_dir: str) -> str:
    """The table printed at the end of the demo."""
    lines = [
        "",
        f"{'run':<18} {'loss':>7} {'grad ratio':>11} {'resid growth':>13} {'attn logit max':>15}"
        f" {'ms/step':>8}",
    ]
    for r in results:
        lines.append(
            f"{r.name:<18} {r.loss:>7.3f} {r.grad_ratio:>11.2f} {r.resid_growth:>13.2f} "
            f"{r.attn_logit_max:>15.2f} {r.ms_per_step:>8.0f}"
        )
    lines += [
        "",
        "grad ratio = last block's gradient norm / first block's (Post-LN piles gradient at the",
        "top: > 1); resid growth = residual-stream RMS after the last block / after the first;",
        "ms/step = the run's wall time (training, probe and logging) / its steps.",
        "",
        f"See every panel with:  tensorboard --logdir {log_dir}",
        "then open (Time Series, the summary pinned first):",
        dashboard_url(log_dir),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--root", default="runs", help="TensorBoard root directory")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (2: faster on an idle machine)"
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(
        f"normprobe demo: {len(RUNS)} runs of {args.steps} steps, about "
        f"{_duration(expected_seconds(args.steps))} on 2 CPU cores"
    )
    start = time.perf_counter()
    results = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            for name, make in RUNS.items():
                results.append(_train(name, make, args.steps, args.root))
    finally:
        torch.set_num_threads(threads)
    print(summary(results, os.path.join(args.root, "demo")))
    print(f"\nThe demo took {_duration(time.perf_counter() - start)}.")


if __name__ == "__main__":
    main()
