"""The residual stream after each block, read once for the families that use it
(``resid_rms``, ``resid_cos``, ``outliers``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from ... import probes
from ...discovery import ModelMap, ResidualAdd
from .base import Plan
from .scratch import Scratch


@dataclass
class StreamRead:
    """One block's stream on a logged forward, reduced to its per-position norms (and for
    cosines, its dot products with the previous block's stream): ``norms`` is None until the
    stream is reduced, which happens by the end of the forward."""

    block: int
    numel: int
    norms: torch.Tensor | None = None
    dots: torch.Tensor | None = None
    prev_norms: torch.Tensor | None = None


# the most entries of a stream held to be reduced with others: larger ones cost more to reduce
# than to call for (on a CPU thread, a call costs about as much as reducing 50,000 entries)
SMALL = 65_536
# a stream read and not reduced yet: its read, the stream (plain), its version then
_Held = tuple[StreamRead, torch.Tensor, int]
# (stack, blocks, their streams, those stacked where they are several)
Reducer = Callable[[str, list[int], list[torch.Tensor], torch.Tensor | None], None]
# what a stack's next read pairs with for its cosine: the last block reduced, its stream (or a
# copy), its row norms, the stream's version then (-1: none)
_Last = tuple[int, torch.Tensor, torch.Tensor, int]


class Streams:
    """Reads the stream each block's last residual add leaves (after a Post-LN norm).

    Get it with ``Streams.of(plan)``; ``reads[stack]`` holds a logged forward's reads. Each of
    ``watchers`` is called with (stack, block, stream) when a block's stream is read (the
    stream as the model holds it: not detached), and each of ``reducers`` with (stack, blocks,
    streams, stacked) when streams are reduced: consecutive reads of one stack (plain), and
    where they are several, stacked along a new first axis (not to be changed).

    A stream is held until ``size`` of its stack's are (then reduced in one batched call per
    statistic) or the forward ends, where it is small (`SMALL`, `_batchable`). Streams that the
    model changes in place after their read (``out += identity`` then ``relu_``) are reduced as
    soon as they are read: the first logged forward reduces every stream at once and holds
    them to its end to learn which stacks' do; so are large streams, those of compiled graphs
    (which run the model's in-place operations and cannot look at versions) and inference
    tensors (which count none). A held stream found changed when it is reduced (the model
    changed its ways) is dropped, and its stack learned. The stream kept for the next block's
    cosine is a copy only in a stack whose streams change in place (or not yet learned).
    Reducers may put a stream's temporaries in ``scratch`` (`Scratch`), released at the end of
    each forward.
    """

    def __init__(self, plan: Plan, size: int = 32) -> None:
        self.cosines = False
        self.size = size
        self.watchers: list[Callable[[str, int, torch.Tensor], None]] = []
        self.reducers: list[Reducer] = []
        self.reads: dict[str, list[StreamRead]] = {}
        self.blocks: dict[str, list[int]] = {}  # the blocks read, per stack
        self._held: dict[str, list[_Held]] = {}  # per stack: read, not reduced yet
        self._last: dict[str, _Last] = {}
        self._latest: dict[str, tuple[int, torch.Tensor]] = {}  # per stack: the last read
        self._at_once: set[str] = set()  # stacks whose streams change in place after the read
        # the first logged forward: each stream read, with its stack and version then
        self._learning: list[tuple[str, torch.Tensor, int]] = []
        self._compiled = plan.compiled
        self._learned = plan.compiled
        self.scratch = Scratch(enabled=not plan.compiled)  # for the reducers
        # a pipeline stage that hands its output on: per stack, whether every forward's output
        # was the stream its last block left (the next stage's first cosine needs it)
        self.hands_on: dict[str, bool] = {}
        plan.at_forward_start(self._clear)
        plan.on_clear(self._clear)
        plan.on_clear(self.hands_on.clear)
        plan.at_forward_end(self._end)
        model_map = plan.model_map
        self._pipeline(plan)
        for stack, last in last_adds(model_map).items():
            for block, add in last.items():
                action = self._reader(stack, block)
                self.blocks.setdefault(stack, []).append(block)
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
            t = probes.plain(t)
            self._last[stack] = (-1, self._kept(stack, t), probes.row_norms(t), _version(t))

    def _handed(self, stack: str, t: torch.Tensor) -> None:
        last = self.blocks.get(stack, [None])[-1]
        latest = self._latest.get(stack)
        same = (
            latest is not None
            and latest[0] == last
            and probes.same_values(latest[1], probes.plain(t))
        )
        self.hands_on[stack] = self.hands_on.get(stack, True) and same

    @staticmethod
    def of(plan: Plan) -> Streams:
        streams: Streams = plan.shared("streams", lambda: Streams(plan))
        return streams

    def _clear(self) -> None:
        # in place: a compiled graph's guards see the same objects at every forward
        for reads in self.reads.values():
            reads.clear()
        self._held.clear()
        self._last.clear()
        self._latest.clear()
        self._learning.clear()

    def _end(self) -> None:
        for stack in list(self._held):
            self._reduce(stack)
        changed = {stack for stack, t, version in self._learning if t._version != version}
        self._at_once.update(changed)
        self._learning.clear()
        self._last.clear()
        self._latest.clear()
        self.scratch.release()
        self._learned = True

    def _stays_as_read(self, stack: str) -> bool:
        """Whether ``stack``'s streams are known to stay as read (the model does not change
        them in place later), which a compiled graph cannot tell."""
        return self._learned and not self._compiled and stack not in self._at_once

    def _deferred(self, stack: str, t: torch.Tensor) -> bool:
        """Whether ``t``, a stream of ``stack``, may be held and reduced later: a small plain
        tensor (where a batched call saves a call's cost per stream, and stacking them costs
        little memory) that is known not to change in place."""
        return self._stays_as_read(stack) and _batchable(t)

    def _kept(self, stack: str, t: torch.Tensor) -> torch.Tensor:
        """What to keep of a reduced stream ``t`` for the next block's cosine: ``t`` itself
        where its stack's streams stay as read (a change after all shows in its version, and
        that cosine is dropped), else a copy."""
        return t if self._stays_as_read(stack) and _version(t) >= 0 else t.clone()

    def _reader(self, stack: str, block: int) -> Callable[[torch.Tensor], None]:
        reads = self.reads.setdefault(stack, [])

        def read(stream: torch.Tensor) -> None:
            t = probes.plain(stream)
            here = StreamRead(block, t.numel())
            reads.append(here)
            self._latest[stack] = (block, t)
            for watch in self.watchers:
                watch(stack, block, stream)
            version = _version(t) if not self._compiled else -1
            held = self._held.setdefault(stack, [])
            held.append((here, t, version))
            if not self._deferred(stack, t):
                learn = not self._learned and version >= 0
                self._reduce(stack, learn=learn)
            elif len(held) >= self.size:
                self._reduce(stack)

        return read

    def _reduce(self, stack: str, learn: bool = False) -> None:
        """Reduce the stack's held streams whose values are still those read (dropping the
        others); ``learn``: on the first logged forward, keep them to its end to see whether
        they change in place."""
        held = self._held.pop(stack, [])
        kept = [(r, t) for r, t, version in held if version < 0 or t._version == version]
        if len(kept) < len(held):  # changed in place since the read: lost, and learned
            self._at_once.add(stack)
            dropped = {id(r) for r, _, _ in held}.difference(id(r) for r, _ in kept)
            self.reads[stack][:] = [r for r in self.reads[stack] if id(r) not in dropped]
        start = 0
        while start < len(kept):  # runs of streams alike in shape, dtype and device
            end = start + 1
            while end < len(kept) and _alike(kept[end][1], kept[start][1]):
                end += 1
            self._reduce_run(stack, kept[start:end])
            start = end
        if learn:
            self._learning.extend((stack, t, version) for _, t, version in held)

    def _reduce_run(self, stack: str, run: list[tuple[StreamRead, torch.Tensor]]) -> None:
        """Reduce streams alike: several (held) in one batched call per statistic."""
        streams = [t for _, t in run]
        stacked = torch.stack(streams) if len(run) > 1 else None
        if stacked is None:
            norms: Sequence[torch.Tensor] = [probes.row_norms(streams[0])]
        else:
            norms = probes.row_norms_many(stacked).unbind(0)
        for r, n in zip(run, norms, strict=True):
            r[0].norms = n
        if self.cosines:
            self._pair(stack, run, stacked, norms)
        blocks = [r.block for r, _ in run]
        for reduce in self.reducers:
            reduce(stack, blocks, streams, stacked)

    def _pair(
        self,
        stack: str,
        run: list[tuple[StreamRead, torch.Tensor]],
        stacked: torch.Tensor | None,
        norms: Sequence[torch.Tensor],
    ) -> None:
        """Each read's dot products with the stream of the block before it, where that was
        read just before: within the run in one call, the first's with the last one reduced."""
        last = self._last.get(stack)
        first, t = run[0]
        if last is not None and 0 <= last[3] != last[1]._version:
            self._at_once.add(stack)  # the stream before changed in place: no cosine
        elif last is not None and last[0] == first.block - 1 and last[1].shape == t.shape:
            first.dots, first.prev_norms = probes.row_dots(last[1], t), last[2]
        if stacked is not None:
            dots = probes.row_dots_many(stacked[:-1], stacked[1:]).unbind(0)
            for k in range(1, len(run)):
                here, before = run[k][0], run[k - 1][0]
                if before.block == here.block - 1:
                    here.dots, here.prev_norms = dots[k - 1], norms[k - 1]
        r, t = run[-1]
        kept = self._kept(stack, t)
        self._last[stack] = (r.block, kept, norms[-1], _version(kept) if kept is t else -1)


def _batchable(t: torch.Tensor) -> bool:
    """Whether a stream may be held to be reduced with others (where the model leaves it as
    read, outside a compiled graph): a small plain tensor that counts versions."""
    return type(t) is torch.Tensor and t.numel() <= SMALL and not t.is_inference()


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter, or -1 for an inference tensor, which counts none."""
    return -1 if t.is_inference() else t._version


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def last_adds(model_map: ModelMap) -> dict[str, dict[int, ResidualAdd]]:
    """Per stack, each block's last residual add, by block in order: `Streams` reads the stream
    it leaves (its output, or its Post-LN norm's) where `readable`."""
    found: dict[str, dict[int, ResidualAdd]] = {}
    for stack in model_map.stacks:
        last = {a.block: a for a in model_map.adds_in(stack.path) if a.block is not None}
        found[stack.path] = dict(sorted(last.items()))
    return found


def readable(add: ResidualAdd) -> bool:
    return add.post_norm is not None or add.anchor is not None


def rowwise(
    fn: Callable[..., torch.Tensor], rows: Sequence[Sequence[torch.Tensor]]
) -> torch.Tensor:
    """``fn`` of the rows' columns stacked (one result per row), or row by row when the rows'
    shapes differ."""
    if len({tuple(t.shape for t in row) for row in rows}) == 1:
        return fn(*(torch.stack(column) for column in zip(*rows, strict=True)))
    return torch.stack([fn(*row) for row in rows])


def stream_rms(reads: Sequence[StreamRead]) -> torch.Tensor:
    """Each read stream's RMS, from its per-position norms (reduced)."""
    norms = [r.norms for r in reads if r.norms is not None]
    assert len(norms) == len(reads), "streams are reduced by the end of the forward"
    if len({(r.numel, n.shape) for r, n in zip(reads, norms, strict=True)}) == 1:
        return probes.rms_from_row_norms(torch.stack(norms), reads[0].numel)
    return torch.stack(
        [probes.rms_from_row_norms(n, r.numel) for r, n in zip(reads, norms, strict=True)]
    )
