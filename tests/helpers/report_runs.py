"""Short runs logged for the report's tests: a healthy language model and the 48-block stack of
sanity check [d]."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import normprobe
from normprobe.models import ResidualStack, TinyTransformer

Batch = Callable[[int], torch.Tensor]


def train(
    log_dir: Path,
    model: nn.Module,
    batch: Batch,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    steps: int,
    every: int,
    lr: float = 1e-3,
    before: Callable[[nn.Module, int], None] | None = None,
) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN run's own warning
        warnings.simplefilter("ignore", normprobe.DiscoveryWarning)  # no stacks in BatchNormNet
        with normprobe.attach(model, opt, log_dir=str(log_dir), every=every):
            for i in range(steps):
                if before is not None:
                    before(model, i)
                loss(model, batch(i)).backward()
                opt.step()
                opt.zero_grad()
    return log_dir


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(model, TinyTransformer)
    return model.loss(x, x)


def square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def tokens(i: int) -> torch.Tensor:
    return torch.randint(0, 96, (4, 16))


def healthy_lm(log_dir: Path) -> Path:
    """Pre-LN TinyTransformer, 4 blocks, 9 AdamW steps logged every 2: no flag at all."""
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, width=32, context=16)
    return train(log_dir, model, tokens, lm_loss, steps=9, every=2)


def check_d_stack(
    log_dir: Path,
    pre_ln: bool,
    input_scale: float = 1.0,
    deepnorm: bool = False,
    steps: int = 3,
) -> Path:
    """The 48-block stack and batch of sanity check [d] (same seed as test_runtime's,
    where grad_ratio/lins reads 0.40 for Pre-LN and 2.35 for Post-LN), logged at ``steps`` steps
    of an optimizer with learning rate 0: the same values each step, a condition held over
    steps."""
    torch.manual_seed(0)
    stack = ResidualStack(48, 64, pre_ln=pre_ln)
    if deepnorm:
        normprobe.reinit(stack, "deepnorm", example_inputs=(torch.zeros(2, 64),))
    x = torch.randn(16, 64) * input_scale
    opt = torch.optim.SGD(stack.parameters(), lr=0.0)
    with normprobe.attach(stack, opt, log_dir=str(log_dir), every=1):
        for _ in range(steps):
            stack(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return log_dir
