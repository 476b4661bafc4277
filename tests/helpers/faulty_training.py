"""A tiny transformer trained for a few steps with a fault put in on demand
(tests/runtime/test_faults.py, and the script it runs in a subprocess)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import normprobe
from normprobe.models import TinyTransformer

EVERY = 2
STEPS = 8


def make_model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(width=16, depth=3, heads=2, context=16)


def batch(step: int) -> torch.Tensor:
    """The same tokens for a step whatever happened before it."""
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(step))


def _raise_backward(grad: torch.Tensor) -> None:
    raise RuntimeError("backward failed")


class Tripwire:
    """Raises from inside block 1's attention (its output projection) when ``step == at``."""

    def __init__(self, model: TinyTransformer, kind: str, at: int | None) -> None:
        self.kind, self.at, self.step = kind, at, -1
        self.handle = model.blocks[1].attn.proj.register_forward_hook(self.fire)

    def fire(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.step != self.at:
            return
        if self.kind == "forward":
            raise RuntimeError("forward failed")
        if self.kind == "interrupt":
            raise KeyboardInterrupt
        if self.kind == "backward":
            out.register_hook(_raise_backward)


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose step raises on its ``fail_at``-th call and otherwise calls ``super().step``."""

    def __init__(self, params: Any, fail_at: int | None = None) -> None:
        # torch runs step hooks around a class's step once an instance of that class exists;
        # make sure AdamW's own step runs them too, as in any program that built an AdamW
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        super().__init__(params, lr=1e-2)
        self.fail_at = fail_at
        self.calls = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.calls == self.fail_at:
            raise RuntimeError("optimizer step failed")
        self.calls += 1
        return super().step(closure)


def train(
    model: TinyTransformer, opt: torch.optim.Optimizer, wire: Tripwire, start: int = 0
) -> None:
    for step in range(start, STEPS):
        wire.step = step
        x = batch(step)
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()


def attach(model: nn.Module, opt: torch.optim.Optimizer, log_dir: Path) -> normprobe.Probe:
    return normprobe.attach(
        model, opt, log_dir=str(log_dir), every=EVERY, example_inputs=(batch(0),)
    )
