"""Healthy trainings the thresholds were *not* set from: a check that the calibration
(``benchmarks/calibration_set.py``) holds on models it never saw, trained as a user would.

    python benchmarks/calibration_unseen.py [--small] [--out DIR] [--only NAME ...]

Five models from libraries' own configs, with random weights: Hugging Face BERT (masked LM),
T5 (encoder-decoder), Qwen2 (causal LM), timm ConvNeXt-atto and torchvision MobileNetV2
(BatchNorm). Each trains in a plain loop with its usual optimizer (AdamW with a linear warmup
and gradient clipping at 1 for the transformers, as Hugging Face's Trainer does; SGD with
Nesterov momentum for MobileNetV2), ``normprobe.attach`` watching, and is read back with
``normprobe.report_run``. None may raise a problem. The script prints each run's loss, its
flags and the calibration table's statistics (``benchmarks/calibration.py``);
``tests/diagnose/test_calibration_unseen.py`` trains them at `SMALL`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from calibration_set import images
from torch import nn

import normprobe
from normprobe.corpus import CharCorpus
from normprobe.report import RunReport


@dataclass(frozen=True)
class Size:
    """How long the runs train and how often the probe logs."""

    steps: int
    every: int


FULL = Size(steps=300, every=10)
SMALL = Size(steps=60, every=5)
WIDTH, DEPTH, HEADS, CONTEXT, BATCH, IMAGE = 64, 4, 4, 32, 16, 32


@dataclass
class Setup:
    """A model, how one step's loss is drawn, its optimizer and its warmup (in steps)."""

    model: nn.Module
    loss: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    warmup: int = 0
    clip: float | None = None  # gradient-norm clipping, as the user would set it


@dataclass(frozen=True)
class Run:
    name: str
    build: Callable[[], Setup]
    about: str


def _adamw(model: nn.Module, lr: float, decay: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay)


# --- the models ----------------------------------------------------------------------------
def _bert() -> Setup:
    """BERT's masked LM: 15% of the characters replaced by a [MASK] id, predicted back."""
    from transformers import BertConfig, BertForMaskedLM

    corpus = CharCorpus(context=CONTEXT, seed=0)
    mask_id = corpus.vocab_size  # one id past the characters
    config = BertConfig(
        vocab_size=corpus.vocab_size + 1,
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        intermediate_size=4 * WIDTH,
        max_position_embeddings=CONTEXT,
    )
    model = BertForMaskedLM(config)

    def loss() -> torch.Tensor:
        x, _ = corpus.batch(BATCH)
        masked = torch.rand(x.shape) < 0.15
        labels = torch.where(masked, x, -100)
        return model(input_ids=x.masked_fill(masked, mask_id), labels=labels).loss

    return Setup(model, loss, _adamw(model, 1e-3), warmup=30, clip=1.0)


def _t5() -> Setup:
    """T5 reads 24 characters and writes the 8 that follow them."""
    from transformers import T5Config, T5ForConditionalGeneration

    corpus = CharCorpus(context=CONTEXT, seed=0)
    config = T5Config(
        vocab_size=corpus.vocab_size,
        d_model=WIDTH,
        d_kv=WIDTH // HEADS,
        d_ff=2 * WIDTH,
        num_layers=DEPTH // 2 + 1,
        num_decoder_layers=DEPTH // 2 + 1,
        num_heads=HEADS,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)

    def loss() -> torch.Tensor:
        x, _ = corpus.batch(BATCH)
        return model(input_ids=x[:, :24], labels=x[:, 24:].contiguous()).loss

    return Setup(model, loss, _adamw(model, 1e-3), warmup=30, clip=1.0)


def _qwen2() -> Setup:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    corpus = CharCorpus(context=CONTEXT, seed=0)
    config = Qwen2Config(
        vocab_size=corpus.vocab_size,
        hidden_size=WIDTH,
        intermediate_size=3 * WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=CONTEXT,
    )
    model = Qwen2ForCausalLM(config)

    def loss() -> torch.Tensor:
        x, _ = corpus.batch(BATCH)
        return model(input_ids=x, labels=x).loss  # the model shifts the labels

    return Setup(model, loss, _adamw(model, 1e-3), warmup=30, clip=1.0)


def _classifier(model: nn.Module, batch: int) -> Callable[[], torch.Tensor]:
    draw = images(IMAGE, batch, noise=1.0, seed=1)

    def loss() -> torch.Tensor:
        x, y = draw()
        return nn.functional.cross_entropy(model(x), y)

    return loss


def _convnext() -> Setup:
    import timm

    model = timm.create_model("convnext_atto", num_classes=10)
    return Setup(model, _classifier(model, 32), _adamw(model, 1e-3, 0.05), warmup=30)


def _mobilenet() -> Setup:
    from torchvision.models import mobilenet_v2

    model = mobilenet_v2(num_classes=10, width_mult=0.5)
    opt = torch.optim.SGD(
        model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=4e-5
    )
    return Setup(model, _classifier(model, 32), opt, warmup=10)


RUNS = [
    Run("hf-bert-mlm", _bert, "transformers' BertForMaskedLM (Post-LN), masked characters"),
    Run("hf-t5", _t5, "transformers' T5ForConditionalGeneration, 24 characters -> next 8"),
    Run("hf-qwen2", _qwen2, "transformers' Qwen2ForCausalLM (q/k/v biases, GQA)"),
    Run("timm-convnext", _convnext, "timm convnext_atto (LayerNorm2d, layer scale), AdamW"),
    # Its deepest BatchNorms' running variances start at 1, |log| 9.6 off their batches', and
    # close in by 0.1 a step (momentum 0.1): within ~90 steps that warm-up reads as drift past
    # log 2 (2.2 at step 55), falling at every logged step: a note, not a problem.
    Run("tv-mobilenet-bn", _mobilenet, "torchvision MobileNetV2 x0.5 (BatchNorm), SGD momentum"),
]


# --- training ----------------------------------------------------------------------------------
@dataclass
class Trained:
    run: Run
    report: RunReport
    losses: list[float]

    @property
    def problems(self) -> list[str]:
        return [str(f) for f in self.report.flags if f.severity == "problem"]


def train(run: Run, size: Size, log_dir: Path) -> Trained:
    """Train ``run`` for ``size.steps`` with a probe writing to ``log_dir``; read it back."""
    torch.manual_seed(0)
    s = run.build()
    warm = max(s.warmup, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda i: min(1.0, (i + 1) / warm))
    shutil.rmtree(log_dir, ignore_errors=True)
    losses = []
    log = str(log_dir)
    with normprobe.attach(s.model, optimizer=s.optimizer, log_dir=log, every=size.every) as p:
        for _ in range(size.steps):
            loss = s.loss()
            p.observe_loss(loss)
            s.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if s.clip is not None:
                nn.utils.clip_grad_norm_(s.model.parameters(), s.clip)
            s.optimizer.step()
            schedule.step()
            losses.append(loss.item())
    return Trained(run, normprobe.report_run(log_dir), losses)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(t: Trained) -> str:
    """The run's loss (mean of its first and last tenth), its flags, the table's statistics."""
    from calibration import STATISTICS

    tenth = max(len(t.losses) // 10, 1)
    lines = [
        f"{t.run.name}: {len(t.losses)} steps, loss {_mean(t.losses[:tenth]):.3f} -> "
        f"{_mean(t.losses[-tenth:]):.3f}, problems {len(t.problems)}"
    ]
    lines += [f"  {f.severity}: {f}" for f in t.report.flags]
    cells = [f"{st.kind} {st.read(t.report):.3g}" for st in STATISTICS]
    return "\n".join([*lines, "  " + "; ".join(cells)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these")
    parser.add_argument("--small", action="store_true", help="the test's reduced runs")
    args = parser.parse_args(argv)
    size = SMALL if args.small else FULL
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for run in RUNS:
            if args.only is None or run.name in args.only:
                trained = train(run, size, Path(args.out or tmp) / run.name)
                print(summary(trained), flush=True)
                failed += bool(trained.problems)
    return 1 if failed else 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
