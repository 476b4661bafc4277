"""The end of a backward: where a step's gradients are complete and not clipped yet.

Trainers clip between the backward pass and the optimizer step (``clip_grad_norm_``, the Hugging
Face Trainer's ``max_grad_norm``, Accelerate's ``clip_grad_norm_``), so the optimizer step sees
clipped gradients. A hook on the model's output tensor, registered by the root module's forward
hook on the forwards that need it, queues a final callback of the autograd engine
(``Variable._execution_engine.queue_callback``) that queues itself once more from inside: it
then runs after every final callback queued during the backward, DDP's and FSDP's among them,
which write the reduced gradients into ``param.grad``. A compiled model's output takes no hook
from inside its graph: there each trainable parameter carries a post-accumulate-grad hook,
registered once, that queues the callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..nested import iter_tensors
from .hooks import ProbeHook


class BackwardEnd:
    """Calls ``ended`` at the end of each backward through a `watch`-ed output (with
    ``compiled``: each backward that reaches a trainable parameter of ``model``)."""

    def __init__(self, model: nn.Module, ended: Callable[[], None], compiled: bool) -> None:
        self.ended = ended
        self.compiled = compiled
        self._queued = False
        self._handles = (
            [
                p.register_post_accumulate_grad_hook(ProbeHook(self._reached))  # type: ignore[no-untyped-call]
                for p in model.parameters()
                if p.requires_grad
            ]
            if compiled
            else []
        )

    def watch(self, out: Any) -> None:
        """The model returned ``out``: end the backward through it with ``ended`` (its first
        tensor that requires a gradient carries the hook; none on compiled models)."""
        if self.compiled or not torch.is_grad_enabled():
            return
        self._queued = False  # a backward that raised never ran its callback
        for _, t in iter_tensors(out):
            if t.requires_grad:
                t.register_hook(self._reached)  # type: ignore[no-untyped-call]
                return

    def _reached(self, *_: Any) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._again)

    def _again(self) -> None:
        # queued from a final callback: after those queued during the backward (DDP's, FSDP's)
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        self.ended()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
