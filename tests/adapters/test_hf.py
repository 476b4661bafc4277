"""The Hugging Face Trainer with `normprobe.hf.NormProbeCallback`: real Trainers, real event
files read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tb import read_events
from torch import nn

import normprobe
from normprobe import tags
from normprobe.models import ResidualStack

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from normprobe.hf import NormProbeCallback  # noqa: E402


def _args(out: Path, config: type[Any] = TrainingArguments, **kw: Any) -> Any:
    """``config`` (TrainingArguments, or a subclass such as TRL's SFTConfig) for a short CPU run
    logging to TensorBoard; ``kw`` add to and override the defaults."""
    base: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return config(**{**base, **kw})


def _gpt2() -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    data = [
        {"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))}
        for _ in range(64)
    ]
    return GPT2LMHeadModel(config), data


def _run_dirs(out: Path) -> list[Path]:
    return sorted({p.parent for p in out.rglob("events.out.tfevents.*")})


@pytest.mark.slow
def test_logs_on_the_trainers_steps_into_its_own_run(tmp_path: Path) -> None:
    model, data = _gpt2()
    callback = NormProbeCallback()
    args = _args(
        tmp_path,
        max_steps=6,
        logging_steps=2,
        logging_first_step=True,
        gradient_accumulation_steps=2,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    [run] = _run_dirs(tmp_path)  # one run: the Trainer's TensorBoard writer, shared
    events = read_events(str(run))
    loss_steps = [s for s, _ in events.scalars["train/loss"]]
    assert loss_steps == [1, 2, 4, 6]
    ratio = events.scalars[tags.format("grad_ratio", "transformer.h")]
    assert [s for s, _ in ratio] == loss_steps
    for block in (0, 1):
        assert [s for s, _ in events.scalars[tags.format("resid_rms", "transformer.h", block)]] == (
            loss_steps
        )
    assert events.profiles  # the depth view went to the same run
    assert callback.probe is None  # removed at the end of training
    assert normprobe.attached_probe(model) is None


@pytest.mark.slow
def test_every_overrides_the_logging_steps(tmp_path: Path) -> None:
    model, data = _gpt2()
    args = _args(tmp_path, max_steps=6, logging_steps=2)
    Trainer(
        model=model, args=args, train_dataset=data, callbacks=[NormProbeCallback(every=3)]
    ).train()
    [run] = _run_dirs(tmp_path)
    events = read_events(str(run))
    assert [s for s, _ in events.scalars["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "transformer.h")]] == [3, 6]


class _Wrapped(nn.Module):
    """Sanity check [d]'s stack as a Trainer model: ``forward(x)`` returns the loss mean(out^2)."""

    def __init__(self, pre_ln: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stack = ResidualStack(48, 64, pre_ln=pre_ln)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.stack(x).pow(2).mean()}


@pytest.mark.slow
@pytest.mark.parametrize(("pre_ln", "expected"), [(True, 0.40), (False, 2.35)])
def test_the_stack_gradient_ratio_through_the_trainer(
    tmp_path: Path, pre_ln: bool, expected: float
) -> None:
    model = _Wrapped(pre_ln)
    x = torch.randn(16, 64)  # check [d]'s input, drawn right after the stack
    data = [{"x": row} for row in x]
    callback = NormProbeCallback(metrics=["grad_norm"])
    # one step over the whole batch; clipping (max_grad_norm 1.0) scales every block alike
    args = _args(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=16,
        logging_first_step=True,
        remove_unused_columns=False,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.latest is not None and callback.latest.step == 1
    ratio = callback.latest.scalars[tags.format("grad_ratio", "stack.lins")]
    assert ratio == pytest.approx(expected, abs=0.005)


@pytest.mark.slow
def test_without_a_tensorboard_reporter_it_warns_and_writes_beside_the_output(
    tmp_path: Path,
) -> None:
    model, data = _gpt2()
    args = _args(tmp_path, max_steps=2, logging_steps=1, report_to=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args, train_dataset=data, callbacks=[NormProbeCallback()]).train()
    assert any("reports to no TensorBoard run" in str(w.message) for w in caught)
    events = read_events(str(tmp_path / "normprobe"))
    assert [s for s, _ in events.scalars[tags.format("grad_ratio", "transformer.h")]] == [1, 2]


def test_bad_every_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"positive integer.*got 0"):
        NormProbeCallback(every=0)


def test_attach_unwraps_an_accelerate_optimizer() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, wrapped = accelerator.prepare(model, inner)
    sink = normprobe.MemorySink()
    probe = normprobe.attach(
        model, wrapped, sinks=[sink], every=1, example_inputs=(torch.ones(2, 4),)
    )
    with probe:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            wrapped.step()
    assert probe.optimizer is inner
    assert [r.step for r in sink.records] == [0, 1]
    with pytest.raises(TypeError, match="got int"):
        normprobe.attach(nn.Linear(2, 2), 3)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_ddp_through_accelerate_launch(tmp_path: Path) -> None:
    """Two CPU processes (DDP over gloo) under `accelerate launch`: the main process alone
    writes, on the Trainer's steps, the gradients both ranks hold after DDP averaged them and
    before the Trainer clipped them (those at the optimizer step, times the Trainer's own total
    before clipping over the total there)."""
    script = Path(__file__).parents[1] / "helpers" / "hf_ddp_train.py"
    launcher = Path(sys.executable).with_name("accelerate")
    path = os.pathsep.join(p for p in (str(script.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
         str(script), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [(r["writes"], r["sinks"]) for r in ranks] == [(True, 1), (False, 0)]
    assert ranks[0]["grads"] == ranks[1]["grads"]  # DDP averaged them
    [run] = _run_dirs(tmp_path)  # one run, written by the main process only
    events = read_events(str(run))
    grad = events.scalars[tags.format("grad_norm", "transformer.h", 0)]
    assert [s for s, _ in grad] == [s for s, _ in events.scalars["train/loss"]] == [1, 2, 4]
    theirs = dict(events.scalars["train/grad_norm"])  # before clipping
    assert dict(events.scalars[tags.format("grad_norm_total", "model")]) == pytest.approx(
        theirs, rel=1e-5
    )
    assert all(theirs[s] > 2 * ranks[0]["totals"][str(s)] for s in theirs)  # clipped
    for step, value in grad:
        at_step = ranks[0]["grads"][str(step)] * theirs[step] / ranks[0]["totals"][str(step)]
        assert value == pytest.approx(at_step, rel=1e-5)


def test_trl_sft_trainer_logs_beside_its_loss(tmp_path: Path) -> None:
    """TRL's trainers subclass the Trainer: the callback works in them unchanged."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, _ = _gpt2()
    vocab = {str(i): i for i in range(61)} | {"[UNK]": 61, "[PAD]": 62, "[EOS]": 63}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    data = datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(0, 61, (16,)).tolist() for _ in range(32)]}
    )
    args = _args(tmp_path, trl.SFTConfig, max_steps=4, logging_steps=2)
    callback = NormProbeCallback()
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[callback]
    )
    trainer.train()
    scalars: dict[str, list[tuple[int, float]]] = {}
    for run in _run_dirs(tmp_path):
        scalars |= read_events(str(run)).scalars
    assert [s for s, _ in scalars["train/loss"]] == [2, 4]
    assert [s for s, _ in scalars[tags.format("grad_ratio", "transformer.h")]] == [2, 4]
    assert normprobe.attached_probe(model) is None
