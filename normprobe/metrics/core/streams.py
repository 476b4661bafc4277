"""The residual stream after each block, read once for the families that use it
(``resid_rms``, ``resid_cos``, ``outliers``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ... import probes
from .base import Plan


@dataclass
class StreamRead:
    """One block's stream on a logged forward, reduced to its per-position norms (and for
    cosines, its dot products with the previous block's stream)."""

    block: int
    numel: int
    norms: torch.Tensor
    dots: torch.Tensor | None = None
    prev_norms: torch.Tensor | None = None


class Streams:
    """Reads the stream each block's last residual add leaves (after a Post-LN norm).

    Get it with ``Streams.of(plan)``; ``reads[stack]`` holds a logged forward's reads, and
    each of ``watchers`` is called with (stack, block, stream) when a block's stream is read,
    to reduce it there and then.
    """

    def __init__(self, plan: Plan) -> None:
        self.cosines = False
        self.watchers: list[Callable[[str, int, torch.Tensor], None]] = []
        self.reads: dict[str, list[StreamRead]] = {}
        self.blocks: dict[str, list[int]] = {}  # the blocks read, per stack
        # per stack: the last block read; its stream as held (or a copy), as read, and its
        # version then (-1: none); its row norms
        self._prev: dict[str, tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor]] = {}
        self._copied: set[str] = set()  # stacks whose streams change in place after the read
        self._compiled = plan.compiled
        self._learned = plan.compiled
        # a pipeline stage that hands its output on: per stack, whether every forward's output
        # was the stream its last block left (the next stage's first cosine needs it)
        self.hands_on: dict[str, bool] = {}
        plan.at_forward_start(self._clear)
        plan.on_clear(self._clear)
        plan.on_clear(self.hands_on.clear)
        plan.at_forward_end(self._end)
        model_map = plan.model_map
        self._pipeline(plan)
        for stack in model_map.stacks:
            last = {a.block: a for a in model_map.adds_in(stack.path) if a.block is not None}
            for block, add in sorted(last.items()):
                action = self._reader(stack.path, block)
                self.blocks.setdefault(stack.path, []).append(block)
                if add.post_norm is not None:
                    plan.read(add.post_norm, "post", action)
                elif add.anchor is None:
                    continue
                elif add.anchor.hook == "inside":
                    plan.read_add(
                        add.anchor.module, add.anchor.call, int(add.anchor.key[0]), action
                    )
                else:
                    hook: Literal["pre", "post"] = "pre" if add.anchor.hook == "pre" else "post"
                    plan.read(
                        add.anchor.module, hook, action, call=add.anchor.call, key=add.anchor.key
                    )

    def _pipeline(self, plan: Plan) -> None:
        """On a pipeline's stage, the stream of the block before its first (its input, on a
        later stage of a one-stack model) and the one it hands on (its output)."""
        stacks = [s.path for s in plan.model_map.stacks]
        if plan.pipeline is None or len(stacks) != 1:
            return
        index, count = plan.pipeline
        if index > 0:
            plan.read("", "pre", partial(self._received, stacks[0]))
        if index < count - 1:
            plan.read("", "post", partial(self._handed, stacks[0]))

    def _received(self, stack: str, t: torch.Tensor) -> None:
        if self.cosines:
            self._keep(stack, -1, probes.plain(t), probes.row_norms(t))

    def _handed(self, stack: str, t: torch.Tensor) -> None:
        last = self.blocks.get(stack, [None])[-1]
        prev = self._prev.get(stack)
        same = prev is not None and prev[0] == last and probes.same_values(prev[2], probes.plain(t))
        self.hands_on[stack] = self.hands_on.get(stack, True) and same

    @staticmethod
    def of(plan: Plan) -> Streams:
        streams: Streams = plan.shared("streams", lambda: Streams(plan))
        return streams

    def _clear(self) -> None:
        # in place: a compiled graph's guards see the same objects at every forward
        for reads in self.reads.values():
            reads.clear()
        self._prev.clear()

    def _end(self) -> None:
        self._prev.clear()
        self._learned = True

    def _held(self, stack: str, t: torch.Tensor) -> torch.Tensor:
        """What to keep of a block's stream ``t`` for the next block's cosines: ``t`` itself,
        or a copy where the stack's streams change in place after their read (``x += f(x)``
        without autograd) or where that is not known: on the first logged forward, for an
        inference tensor (which counts no versions), in a compiled graph (which runs the
        model's in-place operations and cannot look at versions)."""
        if self._compiled or t.is_inference() or not self._learned or stack in self._copied:
            return t.clone()
        return t

    def _keep(self, stack: str, block: int, t: torch.Tensor, norms: torch.Tensor) -> None:
        """Keep block ``block``'s stream ``t`` for the next block's cosine."""
        version = -1 if self._compiled or t.is_inference() else t._version
        self._prev[stack] = (block, self._held(stack, t), t, version, norms)

    def _reader(self, stack: str, block: int) -> Callable[[torch.Tensor], None]:
        reads = self.reads.setdefault(stack, [])

        def read(t: torch.Tensor) -> None:
            t = probes.plain(t)
            here = StreamRead(block, t.numel(), probes.row_norms(t))
            reads.append(here)
            for watch in self.watchers:
                watch(stack, block, t)
            if not self.cosines:
                return
            prev = self._prev.get(stack)
            if prev is not None:
                before, held, original, version, prev_norms = prev
                changed = version >= 0 and original._version != version
                if changed:
                    self._copied.add(stack)
                fresh = not (changed and held is original)
                if fresh and before == block - 1 and held.shape == t.shape:
                    here.dots, here.prev_norms = probes.row_dots(held, t), prev_norms
            self._keep(stack, block, t, here.norms)

        return read


def rowwise(
    fn: Callable[..., torch.Tensor], rows: Sequence[Sequence[torch.Tensor]]
) -> torch.Tensor:
    """``fn`` of the rows' columns stacked (one result per row), or row by row when the rows'
    shapes differ."""
    if len({tuple(t.shape for t in row) for row in rows}) == 1:
        return fn(*(torch.stack(column) for column in zip(*rows, strict=True)))
    return torch.stack([fn(*row) for row in rows])


def stream_rms(reads: Sequence[StreamRead]) -> torch.Tensor:
    """Each read stream's RMS, from its per-position norms."""
    if len({(r.numel, r.norms.shape) for r in reads}) == 1:
        return probes.rms_from_row_norms(torch.stack([r.norms for r in reads]), reads[0].numel)
    return torch.stack([probes.rms_from_row_norms(r.norms, r.numel) for r in reads])
