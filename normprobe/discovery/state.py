"""Running a model without leaving a trace: its modes, buffers and RNG state come back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def preserved(module: nn.Module, *, grads: bool = False) -> Iterator[None]:
    """Restore ``module``'s train/eval modes and buffers (BatchNorm statistics) on exit, and
    with ``grads`` its parameters' gradients (cleared meanwhile); random numbers drawn inside
    come from forked generators (the CPU's and those of the module's CUDA devices)."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    params = list(module.parameters()) if grads else []
    saved_grads = [p.grad for p in params]
    tensors = [*module.parameters(), *module.buffers()]
    cuda = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        try:
            for p in params:
                p.grad = None
            yield
        finally:
            for m, mode in modes:
                m.training = mode
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g
