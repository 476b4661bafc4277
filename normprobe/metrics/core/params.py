"""Every block's parameters in one list, for the families that reduce them per block
(``grad_norm``, ``weight_rms``, ``update_ratio``), and the sample of their weights taken just
before the optimizer step that ``weight_rms`` and ``update_ratio`` share."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ... import probes
from .base import Holdings, Out, Plan, Slot, Values

# The weights before the step are kept whole up to SAMPLE_MIN entries per tensor; of larger
# ones a SAMPLE_FRACTION of the entries, in runs of consecutive entries evenly spread
# (`probes.SampledCopy`), whose sum of squares times numel / entries read estimates the whole
# tensor's. On the benchmarks' MLPStack and the GPT-2-style TinyTransformer (at init and after
# 30 AdamW steps), a block's weight RMS so estimated is within 0.8% of the exact one.
SAMPLE_FRACTION = 0.01
SAMPLE_MIN = 8192


class OwnTensors:
    """The default `Holdings`: each parameter's ``.grad`` and the parameter itself, a DTensor's
    local shard weighted by `probes.shard_share`."""

    partitioned = False

    def grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return [p.grad for p in params]

    def weights(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(params)

    def shares(self, params: Sequence[torch.Tensor]) -> list[float]:
        return [probes.shard_share(p) for p in params]


class BlockParams:
    """The parameters of every block of the stacks with weights of their own, each with the
    index of its block over all those stacks; ``blocks[stack]`` is a stack's slice of that
    numbering. Their gradients and weights are read where the plan's `Holdings` keep them.
    Get it with ``BlockParams.of(plan)``."""

    def __init__(self, plan: Plan) -> None:
        self.holdings: Holdings = plan.holdings
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
        self.by_shape = probes.ByShape(self.weights())  # the gradients come in these shapes

    @staticmethod
    def of(plan: Plan) -> BlockParams:
        params: BlockParams = plan.shared("block_params", lambda: BlockParams(plan))
        return params

    def grads(self) -> list[torch.Tensor | None]:
        return self.holdings.grads(self.params)

    def weights(self) -> list[torch.Tensor]:
        return self.holdings.weights(self.params)

    def shares(self) -> list[float]:
        return self.holdings.shares(self.params)

    def index(self, device: torch.device) -> torch.Tensor:
        """The block of each parameter, as an int64 tensor on ``device`` (made once)."""
        if device not in self._index:
            self._index[device] = torch.tensor(self.param_block, dtype=torch.long, device=device)
        return self._index[device]


class WeightSample:
    """A copy of a sample of every block parameter, taken once per logged step just before the
    optimizer step (`take`); get it with ``WeightSample.of(plan)``.

    `old_squares` estimates each block's sum of squares from it, `change_squares` the sum of
    squares of what the step changed (blocks numbered as `BlockParams` numbers them); `clear`
    drops the copy.
    """

    def __init__(self, params: BlockParams) -> None:
        self.params = params
        budgets = [max(SAMPLE_MIN, int(w.numel() * SAMPLE_FRACTION)) for w in params.weights()]
        self._sample = probes.SampledCopy(params.weights(), budgets)
        self._before: probes.Copy | None = None
        self._old: torch.Tensor | None = None
        self._shares: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def of(plan: Plan) -> WeightSample:
        sample: WeightSample = plan.shared(
            "weight_sample", lambda: WeightSample(BlockParams.of(plan))
        )
        return sample

    def take(self) -> None:
        """Copy the sample, unless this step's copy is already taken."""
        if self._before is None:
            self._before = self._sample.copy(self.params.weights())
            self._old = None

    def old_squares(self) -> torch.Tensor:
        """Per block, the estimated sum of squares of the weights copied (float32; made once
        per copy, for every family that asks)."""
        assert self._before is not None, "taken before the optimizer step"
        if self._old is None:
            self._old = self._per_block(self._sample.copy_squares(self._before))
        return self._old

    def change_squares(self) -> torch.Tensor | None:
        """Per block, the estimated sum of squares of the change since `take` (float32), or
        None when no copy was taken this step."""
        if self._before is None:
            return None
        return self._per_block(self._sample.change_squares(self.params.weights(), self._before))

    def clear(self) -> None:
        self._before = None
        self._old = None

    def _per_block(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """Each block's sum of its tensors' estimates, each weighted by its share of a sum over
        ranks (`Holdings.shares`)."""
        device = per_tensor.device
        if device not in self._shares:
            shares = self.params.shares()
            self._shares[device] = torch.tensor(shares, dtype=torch.float32, device=device)
        weighted = per_tensor * self._shares[device]
        return probes.group_sums(weighted, self.params.index(device), self.params.count)


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
