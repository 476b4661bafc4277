"""The modules and blocks `nonfinite` reads on a logged step (`Watched`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from ...discovery import ResidualAdd, inside
from .base import Plan

JOIN = " + "  # between the paths of a block's modules, where it is several


class Watched:
    """The modules a logged step reads: those outside the stacks' blocks, each block as one
    unit, and the modules inside the blocks where the last logged step found its first NaN/Inf
    (`suspect`). A block that is one module holding all its residual branches' layers and
    norms is read as that module. Another block (ResidualStack's ``lins.3``, whose norm
    ``lns.3`` lies in another list; x-transformers' entries side by side) whose stream is read,
    as is the one before it, is read from those streams: its output is the stream it leaves,
    its input the one it was handed (a unit numbered past the modules, named by its modules'
    paths joined by `JOIN`), and its modules are those of the block, its branches' layers and
    norms (but those of several blocks). On compiled models, whose hooks must not change:
    every module."""

    def __init__(self, plan: Plan, streamed: Mapping[str, Sequence[int]]) -> None:
        self.plan = plan
        paths = plan.modules_in_order
        index = {id(plan.modules[p]): i for i, p in enumerate(paths)}
        self.inside: dict[int, list[int]] = {}  # by block: the modules inside it
        self.units: dict[tuple[str, int], int] = {}  # by (stack, block): the unit read for it
        self.names: dict[int, str] = {}  # by unit: its modules' paths, joined
        segments = _segments(plan, streamed)
        for stack in [] if plan.compiled else plan.stacks():
            for b, members in enumerate(stack.members or tuple((m,) for m in stack.blocks)):
                segment = segments.get((stack.path, b))
                if segment is not None:
                    unit = len(paths) + len(self.units)
                    self.units[stack.path, b] = unit
                    self.names[unit] = JOIN.join(segment)
                    held = {index[id(m)] for p in segment for m in plan.modules[p].modules()}
                    self.inside[unit] = sorted(held)
                    continue
                for path in members:
                    module = plan.modules[path]
                    inner = [index[id(m)] for m in module.modules() if m is not module]
                    if inner:
                        self.inside[index[id(module)]] = inner
        self.size = len(paths) + len(self.units)  # of the modules and the units
        self.block_of: dict[int, int] = {}  # a module inside blocks: the outermost
        for block, inner in sorted(self.inside.items(), key=lambda item: len(item[1])):
            self.block_of.update(dict.fromkeys(inner, block))
        self.base = frozenset(range(len(paths))).difference(self.block_of)
        self.suspects: dict[str, int] = {}  # "forward", "backward": the block read inside
        if self.inside:
            plan.select_modules(self.base)

    def name(self, index: int) -> str:
        return self.names.get(index) or self.plan.modules_in_order[index] or "<root>"

    def localized(self, index: int, measured: Mapping[int, float]) -> bool:
        """Whether ``index`` is no block, or a block whose modules were read."""
        inner = self.inside.get(index)
        return inner is None or any(i in measured for i in inner)

    def suspect(self, side: str, first: int | None) -> None:
        """From the next logged step on, read inside the (outermost) block that holds or is
        ``first`` (``side``'s first NaN/Inf; None: none), no longer inside the last one."""
        if not self.inside:
            return
        block = None if first is None else self.block_of.get(first)
        if block is None and first in self.inside:
            block = first
        if block is None:
            self.suspects.pop(side, None)
        else:
            self.suspects[side] = block
        read = [self.inside[b] for b in self.suspects.values()]
        self.plan.select_modules(self.base.union(*read))


def _segments(
    plan: Plan, streamed: Mapping[str, Sequence[int]]
) -> dict[tuple[str, int], list[str]]:
    """By (stack, block), the modules of each block read as a unit from its streams (`Watched`):
    the block's, its residual branches' layers and norms, in ``modules()`` order; for the blocks
    whose stream and the one before are read, and whose block is not one module holding all
    of them. A module of several blocks' is left out of each (it is read on its own)."""
    found: dict[tuple[str, int], list[str]] = {}
    for stack in plan.stacks():
        read = set(streamed.get(stack.path, ()))
        adds: dict[int, list[ResidualAdd]] = {}
        for add in plan.model_map.adds_in(stack.path):
            if add.block is not None:
                adds.setdefault(add.block, []).append(add)
        for b, members in enumerate(stack.members or tuple((m,) for m in stack.blocks)):
            if b not in read or b - 1 not in read:
                continue
            around = {
                path
                for add in adds.get(b, [])
                for path in (
                    *add.branch_layers,
                    *add.writers,
                    add.pre_norm,
                    add.sandwich_norm,
                    add.post_norm,
                )
                if path is not None
            }
            outside = {p for p in around if not any(inside(p, m) for m in members)}
            if len(members) > 1 or outside:
                found[stack.path, b] = [*members, *sorted(outside)]
    owners = Counter(path for paths in found.values() for path in paths)
    order = {path: i for i, path in enumerate(plan.modules_in_order)}
    own = {key: [p for p in paths if owners[p] == 1] for key, paths in found.items()}
    return {key: sorted(paths, key=order.__getitem__) for key, paths in own.items() if paths}


def watch_units(
    plan: Plan, units: Mapping[tuple[str, int], int], stack: str, block: int, stream: torch.Tensor
) -> None:
    """A block's stream: the gradient its unit's output received, and the next unit's input
    gradient."""
    unit = units.get((stack, block))
    if unit is not None:
        plan.watch_gradient(unit, "output", stream)
    after = units.get((stack, block + 1))
    if after is not None:
        plan.watch_gradient(after, "input", stream)
