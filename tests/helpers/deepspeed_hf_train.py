"""A Hugging Face Trainer with DeepSpeed configs of ZeRO stages 0 to 3 and NormProbeCallback,
on two CPU processes over gloo; run by tests/adapters/test_deepspeed.py with RANK, WORLD_SIZE
and the master's address in the environment.

    python tests/helpers/deepspeed_hf_train.py OUT_DIR STAGES

Each of STAGES (``0,1,2,3``) trains the same GPT-2 (same weights, same batches) with two
micro-batches a step and ``max_grad_norm`` (DeepSpeed's ``gradient_clipping``) far below the
gradients' norm. The witness wraps the engine's ``_take_model_step``, which clips and steps,
and reads each block's whole gradient there with DeepSpeed's ``safe_get_full_grad``: reduced,
before DeepSpeed clips it. Each rank writes rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from accelerate.state import AcceleratorState
from deepspeed.utils import safe_get_full_grad
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from normprobe import tags
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


def main() -> None:
    out, stages = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    # gloo alone: DeepSpeed would compile its shared-memory collectives on first use (35 s)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    runs = {stage: train(out, stage) for stage in stages}
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
