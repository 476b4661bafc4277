"""A plain PyTorch training loop watched by `normprobe.attach`: the loop itself does not change.

    python examples/plain_pytorch.py [--steps 200] [--every 10] [--placement pre|post|sandwich]
    tensorboard --logdir runs/plain

A character-level `TinyTransformer` learns the corpus that ships with Python
(`normprobe.corpus.CharCorpus`: nothing downloads). The probe maps the model on its first forward,
advances with the optimizer's `step()` and logs every `--every`-th step to `--log-dir`
(residual-stream RMS, gradient and update norms per block, attention logits, ...).
"""

from __future__ import annotations

import argparse

import torch

import normprobe
from normprobe import tags
from normprobe.corpus import CharCorpus
from normprobe.models import TinyTransformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="log every this many steps")
    parser.add_argument("--placement", choices=["pre", "post", "sandwich"], default="pre")
    parser.add_argument("--log-dir", default="runs/plain")
    args = parser.parse_args()

    torch.manual_seed(0)
    corpus = CharCorpus(context=64)
    model = TinyTransformer(vocab_size=corpus.vocab_size, placement=args.placement)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    with normprobe.attach(model, optimizer=opt, log_dir=args.log_dir, every=args.every) as probe:
        for step in range(args.steps):
            inputs, targets = corpus.batch(16)
            loss = model.loss(inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 50 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.3f}")

    assert probe.latest is not None and probe.model_map is not None
    print(f"\n{probe.model_map.stacks[0].placement} stack, last logged step {probe.latest.step}:")
    for series, subject in (
        ("grad_ratio", "blocks"),
        ("resid_growth", "blocks"),
        ("logits", "max_abs"),
    ):
        tag = tags.format(series, subject)
        print(f"  {tag:<32} {probe.latest.scalars[tag]:.3f}")
    print(f"\nSee the panels with: tensorboard --logdir {args.log_dir}")


if __name__ == "__main__":
    main()
