"""A Hugging Face `Trainer` watched by `normprobe.hf.NormProbeCallback`: one line in `callbacks`.

    python examples/hf_trainer.py [--steps 60] [--output-dir runs/hf]
    tensorboard --logdir runs/hf

A tiny GPT-2 built from a config (random weights: nothing downloads) learns the character corpus
that ships with Python (`normprobe.corpus.CharCorpus`). The Trainer reports to TensorBoard; the
callback logs normprobe's metrics on the Trainer's logging steps into the same run as
`train/loss`.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from normprobe import tags
from normprobe.corpus import CharCorpus
from normprobe.hf import NormProbeCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output-dir", default="runs/hf")
    args = parser.parse_args()

    torch.manual_seed(0)
    corpus = CharCorpus(context=64)
    inputs, _ = corpus.batch(512)
    data = [{"input_ids": row, "labels": row} for row in inputs]  # GPT-2 shifts the labels
    config = GPT2Config(
        vocab_size=corpus.vocab_size, n_positions=64, n_embd=64, n_layer=4, n_head=4
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        logging_first_step=True,
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = NormProbeCallback()  # the whole change to an existing Trainer script
    Trainer(model=model, args=training, train_dataset=data, callbacks=[callback]).train()

    latest = callback.latest
    assert latest is not None
    print(f"\nlast logged step {latest.step}:")
    for series, subject in (
        ("grad_ratio", "transformer.h"),
        ("resid_growth", "transformer.h"),
        ("logits", "max_abs"),
    ):
        tag = tags.format(series, subject)
        print(f"  {tag:<40} {latest.scalars[tag]:.3f}")
    print(f"\ntensorboard --logdir {args.output_dir}")


if __name__ == "__main__":
    main()
