"""Activations read during a logged forward and reduced later, a chunk at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import probes
from .base import Plan


class Batch:
    """Tensors read during a logged forward, reduced a chunk at a time by one batched call.

    A chunk of ``size`` tensors is reduced as soon as it is full, so that at most that many
    activations are held; what is left is reduced when the forward ends. Of several forwards
    in a step (gradient accumulation) the last one's values count.

    A tensor held is one the model may still change in place (a BatchNorm's output under
    ``ReLU(inplace=True)``): its version counter says so when its chunk is reduced. Such a
    position is reduced as soon as it is read from then on, and its value held too late is
    dropped. The first logged forward reduces every tensor at once and holds them all to its
    end, to learn which positions change, so that none is lost. In a compiled graph, which
    runs the model's in-place operations and cannot look at versions, and for inference
    tensors, which count none, every tensor is reduced as soon as it is read.
    """

    def __init__(
        self,
        plan: Plan,
        reduce_many: Callable[[list[torch.Tensor]], torch.Tensor],
        publish: Callable[[list[int], torch.Tensor], None] | None = None,
        size: int = 32,
    ) -> None:
        self.reduce_many = reduce_many
        self.publish = plan.measured.put_at if publish is None else publish
        self.size = size
        self.positions: list[int] = []
        self.tensors: list[torch.Tensor] = []
        self.done: list[tuple[list[int], torch.Tensor]] = []
        self.tracked = not plan.compiled
        self.versions: list[int] = []  # each held tensor's version when it was read
        self.at_once: set[int] = set()  # positions whose tensors changed in place after the read
        self.learned = False
        plan.at_forward_start(self.clear)
        plan.at_forward_end(self._end)
        plan.at_flush(self._publish)
        plan.on_clear(self.clear)

    def add(self, position: int, t: torch.Tensor) -> None:
        t = probes.plain(t)
        versioned = self.tracked and not t.is_inference()
        if not versioned or not self.learned or position in self.at_once:
            self.done.append(([position], self.reduce_many([t])))
            if not versioned or self.learned:
                return  # else held too, to learn whether it changes in place
        self.positions.append(position)
        self.tensors.append(t)
        self.versions.append(t._version)
        if len(self.tensors) >= self.size and self.learned:
            self.drain()

    def drain(self) -> None:
        """Reduce the tensors held whose values are still those read; learn the others."""
        held = zip(self.positions, self.tensors, self.versions, strict=True)
        kept = [(p, t) for p, t, version in held if t._version == version]
        self.at_once.update(set(self.positions).difference(p for p, _ in kept))
        if self.learned and kept:  # the first forward reduced them all when it read them
            self.done.append(([p for p, _ in kept], self.reduce_many([t for _, t in kept])))
        self.positions.clear()
        self.tensors.clear()
        self.versions.clear()

    def _end(self) -> None:
        self.drain()
        self.learned = True

    def _publish(self) -> None:
        """Hand the forward's values over: positions and values of every chunk, concatenated."""
        if self.done:
            positions = [p for chunk, _ in self.done for p in chunk]
            values = (
                self.done[0][1] if len(self.done) == 1 else torch.cat([v for _, v in self.done])
            )
            self.publish(positions, values)

    def clear(self) -> None:
        self.positions.clear()
        self.tensors.clear()
        self.versions.clear()
        self.done.clear()
