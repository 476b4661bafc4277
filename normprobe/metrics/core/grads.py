"""Every trainable parameter's squared gradient norm, taken once per logged step where the
gradients are complete and not clipped yet (`Plan.on_gradients`), for the families that read
gradients (``grad_norm``: per block, the rest and the total; ``nonfinite``: which parameters'
gradients are not finite)."""

from __future__ import annotations

import torch

from ... import probes
from .base import Plan
from .params import BlockParams


class GradSquares:
    """The parameters of `BlockParams` (block by block), then every other trainable parameter
    (`rest`); `squares` holds the last logged step's squared gradient norms in that order
    (the loss scale divided out; by the step's `before_step` callbacks, one found only there),
    or None before. Get it with ``GradSquares.of(plan)``.
    """

    def __init__(self, plan: Plan) -> None:
        self.blocks = BlockParams.of(plan)
        held = {id(p) for p in self.blocks.params}
        root = plan.modules[""]
        self.rest = [p for p in root.parameters() if p.requires_grad and id(p) not in held]
        self.params = self.blocks.params + self.rest
        self.holdings = plan.holdings  # where this rank holds them (DeepSpeed ZeRO: partitions)
        self.by_shape = probes.ByShape(self.holdings.weights(self.params))
        # each parameter's group: its block, or `blocks.count` for the rest
        self.groups = self.blocks.param_block + [self.blocks.count] * len(self.rest)
        self.squares: torch.Tensor | None = None
        # by id, each parameter's (first) place in `params`
        self.position = {id(p): i for i, p in reversed(list(enumerate(self.params)))}
        self._index: dict[torch.device, torch.Tensor] = {}
        self._plan = plan

    @staticmethod
    def of(plan: Plan) -> GradSquares:
        def make() -> GradSquares:
            squares = GradSquares(plan)
            plan.on_gradients(squares.take)
            plan.before_step(squares.unscale_late)
            return squares

        made: GradSquares = plan.shared("grad_squares", make)
        return made

    def squared_norms(self) -> torch.Tensor:
        """The squared gradient norms present now, in the order of `params` (None: 0)."""
        device = self.params[0].device
        return self.by_shape.squared_norms(self.holdings.grads(self.params), device)

    def total_weights(self) -> torch.Tensor | None:
        """1 for each parameter's first place in `params`, 0 for a repeat (a block nested in
        another stack's block), or None when none repeats."""
        seen: set[int] = set()
        first = []
        for p in self.params:
            first.append(id(p) not in seen)
            seen.add(id(p))
        return None if all(first) else torch.tensor(first, dtype=torch.float32)

    def take(self) -> None:
        """Read the gradients (`Plan.on_gradients`)."""
        if not self.params:
            return
        squares = self.squared_norms()
        scale = self._plan.grad_scale
        self.squares = squares if scale is None else squares / scale.to(squares) ** 2

    def unscale_late(self) -> None:
        """Divide a loss scale found at the step (`Plan.late_scale`) out of `squares`."""
        scale = self._plan.late_scale
        if scale is not None and self.squares is not None:
            self.squares = self.squares / scale.to(self.squares) ** 2

    def group_sums(self) -> torch.Tensor | None:
        """Each block's sum of squares, then the rest's, of the last `take`."""
        if self.squares is None:
            return None
        device = self.squares.device
        if device not in self._index:
            self._index[device] = torch.tensor(self.groups, dtype=torch.long, device=device)
        return probes.group_sums(self.squares, self._index[device], self.blocks.count + 1)
