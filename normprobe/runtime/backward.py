"""Each module's gradients in the backward of a recorded forward.

A recorded forward registers tensor hooks on the tensors each module is called with and returns,
from the forward hooks armed with the probe's other reads (`normprobe.runtime.hooks`): no hook on
unlogged steps, and no module backward hook (``register_full_backward_hook`` wraps outputs in a
function that in-place changes made afterwards break, as ``ReLU(inplace=True)`` after a BatchNorm
does). A tensor that is one module's output and the next one's input carries one hook. The
tensor hooks live on that forward's autograd graph and go with it; a later recorded forward, or
the end of the step, silences them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from ..metrics.core.base import GradientReader, Side
from ..nested import iter_tensors

Watchers = list[tuple[int, Side]]  # (module index, side) of the modules a tensor belongs to


class Forward:
    """One recorded forward: its tensor hooks act while it is ``live``."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


class Gradients:
    """Hands ``actions`` each watched tensor's gradient in the backward of the last recorded
    forward, with the modules it belongs to.

    ``input``: once complete, the gradient of each floating-point tensor a module was called
    with that autograd made (not a leaf), summed over every reader of that tensor; ``output``:
    the gradient reaching each tensor it returned. A tensor changed in place after the
    hook was registered gives the gradient of its value at that time (torch's rule for tensor
    hooks): of a module's output before a later ``relu_``, of its input before its own.
    """

    def __init__(self) -> None:
        self.actions: list[GradientReader] = []
        self._forward = Forward()
        # by id of the tensor: (the tensor, weakly; its watchers), for this forward
        self._watched: dict[int, tuple[weakref.ref[torch.Tensor], Watchers]] = {}

    def start(self) -> None:
        """A recorded forward starts: the hooks of earlier ones stop acting."""
        self.stop()
        self._forward = Forward()

    def stop(self) -> None:
        """The step's values are dropped: its hooks stop acting."""
        self._forward.live = False
        self._watched = {}

    def watch(self, index: int, side: Side, tensors: Any) -> None:
        """Hand module ``index``'s gradients w.r.t. ``tensors`` (its inputs or its output) on."""
        for t in _tensors(tensors):
            if t.grad_fn is None or not t.is_floating_point():
                continue
            seen = self._watched.get(id(t))
            if seen is not None and seen[0]() is t:
                if (index, side) not in seen[1]:  # query, key and value: one tensor thrice
                    seen[1].append((index, side))
                continue
            watchers: Watchers = [(index, side)]
            self._watched[id(t)] = (weakref.ref(t), watchers)
            # a pre-hook on the node that made ``t`` (what ``t.register_hook`` does, without
            # the handle it makes: a third of the cost)
            t.grad_fn.register_prehook(
                partial(_gradient, self._forward, watchers, self.actions, t.output_nr)
            )


def _tensors(tensors: Any) -> Iterable[torch.Tensor]:
    """The tensors in a module's (args, kwargs) or output; at once in the common cases, a
    tensor or positional tensors alone."""
    if isinstance(tensors, torch.Tensor):
        return (tensors,)
    if isinstance(tensors, tuple) and len(tensors) == 2 and isinstance(tensors[1], dict):
        args = tensors[0]
        if (
            not tensors[1]
            and isinstance(args, tuple)
            and all(isinstance(a, torch.Tensor) for a in args)
        ):
            return args
    return (t for _, t in iter_tensors(tensors))


def _gradient(
    forward: Forward,
    watchers: Watchers,
    actions: list[GradientReader],
    output: int,
    grads: tuple[torch.Tensor | None, ...],
) -> None:
    grad = grads[output]
    if forward.live and grad is not None:
        for action in actions:
            action(watchers, grad)
