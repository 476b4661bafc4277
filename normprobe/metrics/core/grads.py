"""Every trainable parameter's squared gradient norm, taken once per logged step where the
gradients are complete and not clipped yet (`Plan.on_gradients`), for the families that read
gradients (``grad_norm``: per block, the rest and the total; ``nonfinite``: which parameters'
gradients are not finite)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ... import probes
from .base import Plan
from .params import BlockParams

# `GradSquares.sampled_total` reads a gradient of more than this many entries from a fixed sample
# of about this many (`probes.SquareSums`, as the spike detector does by default)
CLIP_SAMPLE = 4096


def unscaled(squares: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Sums of squares of gradients carrying a loss ``scale`` (None: none), with it divided out."""
    return squares if scale is None else squares / scale.to(squares) ** 2


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
        self._samplers: list[tuple[list[int], probes.SquareSums]] | None = None
        # the positions of `params` in `Plan.grad_squares_read` (None: not all there), by the
        # mapping they were found in
        self._read_at: tuple[Mapping[int, int], torch.Tensor | None] | None = None
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

    def sampled_total(self) -> torch.Tensor:
        """The sum of squares of every gradient present now (each parameter once, the loss
        scale divided out), estimated from a fixed sample of each large one: read before
        clipping and at the optimizer step, the ratio of the two is the clip factor, exact when
        clipping scales every gradient by one factor (``clip_grad_norm_``), within the sample's
        error otherwise."""
        grads = self.holdings.grads(self.params)
        device = self.params[0].device
        sums = [sample([grads[i] for i in at]).sum().to(device) for at, sample in self._sampled()]
        return unscaled(torch.stack(sums).sum(), self._plan.grad_scale)

    @property
    def sample_is_whole(self) -> bool:
        """Whether `sampled_total` reads every gradient whole (none past `CLIP_SAMPLE` entries):
        then it equals the total of `squares` taken at the same moment."""
        return not any(sample.runs for _, sample in self._sampled())

    def _sampled(self) -> list[tuple[list[int], probes.SquareSums]]:
        """The samplers of `sampled_total`, one per device, each with its positions in `params`
        (each parameter once); made on first use."""
        if self._samplers is None:
            grads = self.holdings.grads(self.params)
            weights = self.holdings.weights(self.params)
            on: dict[torch.device, list[int]] = {}
            seen: set[int] = set()
            for i, p in enumerate(self.params):
                if id(p) not in seen:
                    seen.add(id(p))
                    on.setdefault(weights[i].device, []).append(i)
            # a sparse gradient (a sparse embedding's) is read whole
            whole = [g is not None and g.layout != torch.strided for g in grads]
            self._samplers = [
                (
                    at,
                    probes.SquareSums(
                        [weights[i] for i in at], CLIP_SAMPLE, [whole[i] for i in at]
                    ),
                )
                for at in on.values()
            ]
        return self._samplers

    def versions(self) -> list[tuple[torch.Tensor, int]] | None:
        """The gradients present now, each with its version counter (`unchanged` compares), or
        None where one is not a plain tensor (a subclass's changes may not count there)."""
        grads = [g for g in self.holdings.grads(self.params) if g is not None]
        if any(type(g) is not torch.Tensor for g in grads):
            return None
        return [(g, g._version) for g in grads]

    def unchanged(self, versions: list[tuple[torch.Tensor, int]] | None) -> bool:
        """Whether the gradients present now are those of `versions`, neither replaced nor
        changed in place (clipped, unscaled) since."""
        if versions is None:
            return False
        now = [g for g in self.holdings.grads(self.params) if g is not None]
        return len(now) == len(versions) and all(
            g is held and g._version == version
            for g, (held, version) in zip(now, versions, strict=True)
        )

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
        squares = self._already_read()
        if squares is None:
            squares = self.squared_norms()
        self.squares = unscaled(squares, self._plan.grad_scale)

    def _already_read(self) -> torch.Tensor | None:
        """`squared_norms` from `Plan.grad_squares_read` when it holds every parameter's (each
        gradient read whole, as here) and this rank holds whole gradients, else None."""
        read = self._plan.grad_squares_read
        if read is None or self.holdings.partitioned or self.by_shape.dtype != torch.float32:
            return None
        positions, squares = read
        if squares.device != self.params[0].device:
            return None
        if self._read_at is None or self._read_at[0] is not positions:
            at = [positions.get(id(p)) for p in self.params]
            index = None
            if all(i is not None for i in at):
                index = torch.tensor(at, dtype=torch.long, device=squares.device)
            self._read_at = (positions, index)
        index = self._read_at[1]
        return None if index is None else squares.index_select(0, index)

    def unscale_late(self) -> None:
        """Divide a loss scale found at the step (`Plan.late_scale`) out of `squares`."""
        if self.squares is not None:
            self.squares = unscaled(self.squares, self._plan.late_scale)

    def group_sums(self) -> torch.Tensor | None:
        """Each block's sum of squares, then the rest's, of the last `take`."""
        if self.squares is None:
            return None
        device = self.squares.device
        if device not in self._index:
            self._index[device] = torch.tensor(self.groups, dtype=torch.long, device=device)
        return probes.group_sums(self.squares, self._index[device], self.blocks.count + 1)
