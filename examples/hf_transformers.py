"""A Hugging Face transformers model: what `normprobe.discover` finds, then training with a probe.

    python examples/hf_transformers.py [--arch gpt2|llama] [--steps 30] [--every 10]
    tensorboard --logdir runs/hf

The model is built from a small config (4 blocks, width 64) with random weights: nothing is
downloaded. It learns the character corpus that ships with Python (`normprobe.corpus`).
`discover` takes the same arguments as the model (`input_ids=...`); `attach` maps the model on
its first forward by itself.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import normprobe
from normprobe.corpus import CharCorpus


def build(arch: str, vocab_size: int, context: int) -> torch.nn.Module:
    if arch == "gpt2":
        gpt2 = GPT2Config(
            vocab_size=vocab_size,
            n_positions=context,
            n_embd=64,
            n_layer=4,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(gpt2)
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(llama)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="log every this many steps")
    parser.add_argument("--log-dir", default="runs/hf")
    args = parser.parse_args()

    torch.manual_seed(0)
    corpus = CharCorpus(context=64)
    model = build(args.arch, corpus.vocab_size, corpus.context)
    ids, _ = corpus.batch(2)
    print(normprobe.discover(model, input_ids=ids), "\n")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with normprobe.attach(model, optimizer=opt, log_dir=args.log_dir, every=args.every) as probe:
        for step in range(args.steps):
            ids, _ = corpus.batch(8)
            loss = model(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.3f}")

    assert probe.latest is not None
    ratios = {k: v for k, v in probe.latest.scalars.items() if "/grad_ratio/" in k}
    for tag, value in ratios.items():
        print(f"{tag} at step {probe.latest.step}: {value:.3f}")
    print(f"\nSee the panels with: tensorboard --logdir {args.log_dir}")


if __name__ == "__main__":
    main()
