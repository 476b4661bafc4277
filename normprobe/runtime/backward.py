"""Each module's gradients in the backward of a recorded forward.

A recorded forward registers tensor hooks on the tensors each module is called with and returns,
from forward hooks armed with the probe's other reads: no hook on unlogged steps, and no module
backward hook (``register_full_backward_hook`` wraps outputs in a function that in-place changes
made afterwards break, as ``ReLU(inplace=True)`` after a BatchNorm does). The tensor hooks live on
that forward's autograd graph and go with it; a later recorded forward, or the end of the step,
silences them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..discovery.trace import iter_tensors
from ..metrics.base import GradientReader, Side
from .hooks import ProbeHook, Registration


class Forward:
    """One recorded forward: its tensor hooks act while it is ``live``."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


class Gradients:
    """Hands ``actions`` each module's gradients in the backward of the last recorded forward.

    ``input``: once complete, the gradient of each floating-point tensor the module was called
    with that autograd made (not a leaf), summed over every reader of that tensor; ``output``:
    the gradient reaching each tensor it returned. A tensor changed in place after the
    hook was registered gives the gradient of its value at that time (torch's rule for tensor
    hooks): of a module's output before a later ``relu_``, of its input before its own.
    """

    def __init__(self) -> None:
        self.actions: list[GradientReader] = []
        self._forward = Forward()

    def start(self) -> None:
        """A recorded forward starts: the hooks of earlier ones stop acting."""
        self._forward.live = False
        self._forward = Forward()

    def stop(self) -> None:
        """The step's values are dropped: its hooks stop acting."""
        self._forward.live = False

    def registrations(
        self, modules: Sequence[nn.Module], recording: Callable[[], bool]
    ) -> list[Registration]:
        """Forward hooks on ``modules`` (indexed as given) that watch their tensors' gradients."""
        if not self.actions:
            return []
        return [r for i, m in enumerate(modules) for r in self._module(i, m, recording)]

    def _module(
        self, index: int, module: nn.Module, recording: Callable[[], bool]
    ) -> list[Registration]:
        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if recording():  # before the module runs: its inputs as they are called
                self._watch(index, "input", (args, kwargs))

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if recording():
                self._watch(index, "output", out)

        return [
            partial(module.register_forward_pre_hook, ProbeHook(pre), with_kwargs=True),
            partial(module.register_forward_hook, ProbeHook(post)),
        ]

    def _watch(self, index: int, side: Side, tensors: Any) -> None:
        forward, actions = self._forward, self.actions

        def hook(grad: torch.Tensor) -> None:
            if forward.live:
                for action in actions:
                    action(index, side, grad)

        watched: set[int] = set()  # a tensor passed twice (attention's query, key and value)
        for _, t in iter_tensors(tensors):
            if t.grad_fn is not None and t.is_floating_point() and id(t) not in watched:
                watched.add(id(t))
                t.register_hook(hook)  # type: ignore[no-untyped-call]
