"""A Hugging Face Trainer with a DeepSpeed ZeRO-3 config and NormProbeCallback, on two CPU
processes over gloo; run by tests/adapters/test_deepspeed.py with RANK, WORLD_SIZE and the master's
address in the environment.

    python tests/helpers/deepspeed_hf_train.py OUT_DIR

Two micro-batches a step, ``max_grad_norm`` (DeepSpeed's ``gradient_clipping``) far below the
gradients' norm. The witness wraps the ZeRO optimizer's step too and reads each block's whole
gradient there with DeepSpeed's ``safe_get_full_grad``: before DeepSpeed clips it. Each rank
writes rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from normprobe import tags
from normprobe.hf import NormProbeCallback

CLIP = 0.05


class Witness(TrainerCallback):
    """Each step's whole block gradients before clipping, what the callback logged, and the
    Trainer's own (pre-clip) total gradient norm."""

    def __init__(self, probe: NormProbeCallback) -> None:
        self.probe = probe
        self.seen: dict[str, Any] = {"grads": {}, "logged": {}, "totals": {}}
        self.step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        zero, blocks = kwargs["optimizer"].optimizer, kwargs["model"].transformer.h
        inner = zero.step

        def step(*a: Any, **k: Any) -> Any:
            self.seen["grads"][self.step] = [
                float(torch.cat([safe_get_full_grad(p).flatten() for p in b.parameters()]).norm())
                for b in blocks
            ]
            return inner(*a, **k)

        zero.step = step
        self.seen["optimizer"] = type(zero).__name__

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step + 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        latest = self.probe.latest
        if latest is not None and latest.step == state.global_step:
            profile = latest.profiles[tags.format("grad_norm", "transformer.h")]
            self.seen["logged"][state.global_step] = profile

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "grad_norm" in logs:
            self.seen["totals"][state.global_step] = logs["grad_norm"]


def main() -> None:
    out = Path(sys.argv[1])
    # gloo alone: DeepSpeed would compile its shared-memory collectives on first use (35 s)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
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
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=3,
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
    Trainer(model=model, args=args, train_dataset=data, callbacks=[probe, witness]).train()
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(witness.seen))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
