"""A timm ResNet-18 with its BatchNorm statistics logged: batch vs running statistics, and the
train-vs-eval gap.

    python examples/vision_batchnorm.py [--steps 20] [--batch 16] [--every 5]
    tensorboard --logdir runs/vision

Random weights (no download) on a synthetic pattern task: 32x32 images of horizontal or
vertical stripes with random phase, frequency and noise. The `bn_stats` metric writes, per
BatchNorm, `normprobe/bn_mean_drift/...` and `bn_var_drift/...` (how far the batch's statistics
are from the running ones) and `bn_gap/...` (RMS of train-mode minus eval-mode output, relative).
After training, one eval-mode batch is read as validation (`normprobe/val_bn_*`), as the
Lightning callback does on its first validation batch.
"""

from __future__ import annotations

import argparse
import math

import timm
import torch

import normprobe
from normprobe import tags


def stripes(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of stripes (label 0: horizontal, 1: vertical) and their labels."""
    labels = torch.randint(0, 2, (batch,), generator=generator)
    coords = torch.arange(32, dtype=torch.float32)
    freq = 0.3 + 0.5 * torch.rand(batch, 1, 1, generator=generator)
    phase = 2 * math.pi * torch.rand(batch, 1, 1, generator=generator)
    rows, cols = coords.view(1, 32, 1), coords.view(1, 1, 32)
    along = torch.where(labels.view(-1, 1, 1) == 0, rows, cols)
    image = torch.sin(freq * along + phase).expand(batch, 32, 32)
    noise = 0.3 * torch.randn(batch, 3, 32, 32, generator=generator)
    return image.unsqueeze(1) + noise, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=5, help="log every this many steps")
    parser.add_argument("--log-dir", default="runs/vision")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = torch.Generator().manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    with normprobe.attach(model, optimizer=opt, log_dir=args.log_dir, every=args.every) as probe:
        for step in range(args.steps):
            images, labels = stripes(args.batch, data)
            loss = loss_fn(model(images), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.3f}")
        train = dict(probe.latest.scalars) if probe.latest else {}

        model.eval()
        images, labels = stripes(64, data)
        probe.validate_next_forward()
        with torch.no_grad():
            accuracy = (model(images).argmax(1) == labels).float().mean().item()
        probe.flush_validation()
        print(f"eval accuracy on 64 new images: {accuracy:.2f}")

    assert probe.model_map is not None
    n_bn = sum(n.kind == "batchnorm" for n in probe.model_map.norms)
    gap_tags = tags.prefix("bn_gap")  # then the layer's subject
    gaps = {k.removeprefix(gap_tags): v for k, v in train.items() if k.startswith(gap_tags)}
    print(f"\n{n_bn} BatchNorm layers; largest train-vs-eval gaps at the last logged step:")
    for name, gap in sorted(gaps.items(), key=lambda kv: -kv[1])[:5]:
        drift = train[tags.format("bn_mean_drift", name)]
        print(f"  {name:<22} bn_gap {gap:.3f}  bn_mean_drift {drift:.3f}")
    print(f"\nSee the panels with: tensorboard --logdir {args.log_dir}")


if __name__ == "__main__":
    main()
