"""Run by test_hf.py under `accelerate launch --cpu --num_processes 2`: a Trainer with
NormProbeCallback on two CPU processes (DDP over gloo). Each rank writes what it saw to
rank<N>.json in the output directory given as the first argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from normprobe.hf import NormProbeCallback


class Witness(TrainerCallback):
    """What this rank saw: its probe's sinks, and block 0's and the whole model's gradient norms
    just before each optimizer step (after the Trainer clipped them)."""

    def __init__(self, probe: NormProbeCallback) -> None:
        self.probe = probe
        self.seen: dict[str, Any] = {"grads": {}, "totals": {}}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.probe.probe is not None
        self.seen["sinks"] = len(self.probe.probe.sinks)
        self.seen["writes"] = state.is_world_process_zero

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = str(state.global_step + 1)
        for key, module in (
            ("grads", kwargs["model"].transformer.h[0]),
            ("totals", kwargs["model"]),
        ):
            grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
            norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
            self.seen[key][step] = float(torch.linalg.vector_norm(norms))


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    data = [
        {"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))}
        for _ in range(64)
    ]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        logging_steps=2,
        logging_first_step=True,
        per_device_train_batch_size=4,
        max_grad_norm=0.1,  # clips every step
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    probe = NormProbeCallback()
    witness = Witness(probe)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe, witness])
    trainer.train()
    rank = trainer.args.process_index
    witness.seen["world"] = trainer.args.world_size
    (out / f"rank{rank}.json").write_text(json.dumps(witness.seen))
    # a clean shutdown: leaving gloo's process group to the interpreter's exit aborts a rank now
    # and then ("terminate called without an active exception"), after it wrote its file
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
