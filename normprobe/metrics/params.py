"""Every block's parameters in one list, for the families that reduce them per block
(``grad_norm``, ``update_ratio``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import probes
from .base import Out, Plan, Slot, Values


class BlockParams:
    """The parameters of every block of the stacks with weights of their own, each with the
    index of its block over all those stacks; ``blocks[stack]`` is a stack's slice of that
    numbering. Get it with ``BlockParams.of(plan)``."""

    def __init__(self, plan: Plan) -> None:
        self.params: list[nn.Parameter] = []
        self.param_block: list[int] = []
        self.blocks: dict[str, slice] = {}
        self.count = 0
        for s in plan.stacks():
            for members in s.members or tuple((b,) for b in s.blocks):
                params = [p for m in members for p in plan.modules[m].parameters()]
                self.params += params
                self.param_block += [self.count] * len(params)
                self.count += 1
            self.blocks[s.path] = slice(self.count - len(s.blocks), self.count)
        self._index: dict[torch.device, torch.Tensor] = {}
        self.by_shape = probes.ByShape(self.params)

    @staticmethod
    def of(plan: Plan) -> BlockParams:
        params: BlockParams = plan.shared("block_params", lambda: BlockParams(plan))
        return params

    def index(self, device: torch.device) -> torch.Tensor:
        """The block of each parameter, as an int64 tensor on ``device`` (made once)."""
        if device not in self._index:
            self._index[device] = torch.tensor(self.param_block, dtype=torch.long, device=device)
        return self._index[device]


def write_root_ratios(
    values: Values,
    out: Out,
    series: str,
    numerators: dict[str, Slot],
    denominators: dict[str, Slot],
) -> None:
    """Per stack and block, ``sqrt(numerator / denominator)`` of two per-block slots (blocks
    whose denominator is 0 have no value)."""
    for stack, slot in numerators.items():
        top, bottom = values.get(slot), values.get(denominators[stack])
        if top is None or bottom is None:
            continue
        ratios = {
            b: math.sqrt(t / d) for b, (t, d) in enumerate(zip(top, bottom, strict=True)) if d > 0
        }
        out.per_block(series, stack, ratios)
