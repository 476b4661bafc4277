"""A Hugging Face Trainer with DeepSpeed configs of ZeRO stages 0 to 3 and NormProbeCallback,
then a plain loop with Accelerate's DeepSpeed plugin and ``normprobe.attach``, on two CPU
processes over gloo; run by tests/adapters/test_deepspeed.py with RANK, WORLD_SIZE and the
master's address in the environment.

    python tests/helpers/deepspeed_hf_train.py OUT_DIR STAGES ACCELERATE_STAGES

Each of STAGES (``0,1,2,3``) trains the same GPT-2 (same weights, same batches) under the
Trainer, then each of ACCELERATE_STAGES in the loop, with two micro-batches a step and
``max_grad_norm`` (DeepSpeed's ``gradient_clipping``) far below the gradients' norm. The
witness wraps the engine's ``_take_model_step``, which clips and steps, and reads each block's
whole gradient there with DeepSpeed's ``safe_get_full_grad``: reduced, before DeepSpeed clips
it. Each rank writes rank<r>.json: the Trainer's runs by stage, Accelerate's under 10 + stage.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState
from deepspeed.utils import safe_get_full_grad
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import normprobe
from normprobe import MemorySink, tags
from normprobe.hf import NormProbeCallback

CLIP = 0.05
STEPS = 2


class Witness(TrainerCallback):
    """Each step's whole block gradients before clipping, what the callback logged, and the
    Trainer's own (pre-clip) total gradient norm."""

    def __init__(self, probe: NormProbeCallback) -> None:
        self.probe = probe
        self.seen: dict[str, Any] = {"grads": {}, "logged": {}, "totals": {}}
        self.step = 0
        self.engine: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine, blocks = self.engine, kwargs["model"].transformer.h
        inner = engine._take_model_step

        def step(*a: Any, **k: Any) -> Any:
            self.seen["grads"][self.step] = [
                float(torch.cat([safe_get_full_grad(p).flatten() for p in b.parameters()]).norm())
                for b in blocks
            ]
            return inner(*a, **k)

        engine._take_model_step = step
        self.seen["optimizer"] = type(engine.optimizer).__name__

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step + 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        latest = self.probe.latest
        if latest is not None and latest.step == state.global_step:
            profile = latest.profiles[tags.format("grad_norm", "transformer.h")]
            self.seen["logged"][state.global_step] = profile

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and logs.get("grad_norm") is not None:
            self.seen["totals"][state.global_step] = logs["grad_norm"]


def train(out: Path, stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2)
    model = GPT2LMHeadModel(config)
    data = [
        {"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))}
        for _ in range(64)
    ]
    zero = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        logging_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=CLIP,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        deepspeed=zero,
    )
    probe = NormProbeCallback(every=1, metrics=["grad_norm"])
    witness = Witness(probe)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe, witness])
    _engine_when_prepared(trainer, witness)
    trainer.train()
    trainer.model_wrapped.destroy()
    AcceleratorState._reset_state()  # the next Trainer's DeepSpeed config is its own
    unset_hf_deepspeed_config()
    return witness.seen


def _engine_when_prepared(trainer: Trainer, witness: Witness) -> None:
    """Hand the witness the engine, which the Trainer makes in train() before on_train_begin."""
    prepare = trainer.accelerator.prepare

    def prepared(*args: Any, **kwargs: Any) -> Any:
        out = prepare(*args, **kwargs)
        for made in out if isinstance(out, tuple) else (out,):
            if isinstance(made, deepspeed.DeepSpeedEngine):
                witness.engine = made
        return out

    trainer.accelerator.prepare = prepared  # type: ignore[method-assign]


def accelerate_loop(stage: int) -> dict[str, Any]:
    """The same model and batches in a plain loop with Accelerate's DeepSpeed plugin:
    ``attach(model, opt)`` with what ``accelerator.prepare`` returns (the engine, Accelerate's
    optimizer), ``accelerator.clip_grad_norm_`` as a loop that clips calls it."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2)
    model = GPT2LMHeadModel(config)
    data = torch.randint(0, 64, (2 * STEPS * 2 * 2, 16))  # ranks, steps, micro-batches, rows
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage},
        }
    )
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, opt = accelerator.prepare(model, opt)
    sink = MemorySink()
    probe = normprobe.attach(engine, opt, sinks=[sink], every=1, metrics=["grad_norm"])
    seen: dict[str, Any] = {"grads": {}, "logged": {}, "optimizer": type(engine.optimizer).__name__}
    step = [0]
    inner = engine._take_model_step

    def witnessed(*a: Any, **k: Any) -> Any:
        seen["grads"][step[0]] = [
            float(torch.cat([safe_get_full_grad(p).flatten() for p in b.parameters()]).norm())
            for b in engine.module.transformer.h
        ]
        step[0] += 1
        return inner(*a, **k)

    engine._take_model_step = witnessed
    rank = torch.distributed.get_rank()
    for batch in data[rank::2].split(2):
        with accelerator.accumulate(engine):
            accelerator.backward(engine(input_ids=batch, labels=batch).loss)
            accelerator.clip_grad_norm_(engine.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    probe.remove()
    for record in sink.records:  # the engine's module is its "module"
        tag = tags.format("grad_norm", "module.transformer.h")
        seen["logged"][record.step] = record.profiles[tag]
    engine.destroy()
    AcceleratorState._reset_state()
    return seen


def main() -> None:
    out, stages = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    accelerated = [int(s) for s in sys.argv[3].split(",")]
    # gloo alone: DeepSpeed would compile its shared-memory collectives on first use (35 s)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    runs = {stage: train(out, stage) for stage in stages}
    runs |= {10 + stage: accelerate_loop(stage) for stage in accelerated}  # 10 + s: Accelerate's
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    torch.distributed.destroy_process_group()
    # the results are written: skip the interpreter's teardown, where DeepSpeed's and the
    # Trainer's native threads once aborted a rank ("terminate called without an active
    # exception", under a fully loaded machine) after everything had passed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
