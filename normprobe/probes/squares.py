"""Sums of squared entries of many tensors at once (gradients, weights): exact, batched by shape,
or from a fixed sample of runs of entries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import large_on_cpu, square_sums
from .shards import dtensor_type, local, shard_share


def squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries of each tensor, as one vector (float32, or float64 if a tensor is),
    on the first tensor's device. The square root of a block's sum is its L2 norm; squares,
    unlike norms, add up across shards.

    Of a DTensor (FSDP2), its local shard's, weighted by `shard_share`: summed over ranks,
    the whole tensor's; of a sparse tensor (an ``nn.Embedding(sparse=True)`` gradient), its
    values'.
    """
    tensors = [_real(t.coalesce().values() if t.is_sparse else t) for t in tensors]
    shares = None
    dtensor = dtensor_type()
    if dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
        shares = [shard_share(t) for t in tensors]
        tensors = [local(t) for t in tensors]
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    # a CPU's running sum loses precision on large tensors: those row by row (`square_sums`)
    is_large = [shares is None and large_on_cpu(t) for t in tensors]
    large = [i for i, flag in enumerate(is_large) if flag]
    rest = [i for i, flag in enumerate(is_large) if not flag]
    found: dict[int, torch.Tensor] = {}
    if large:
        squares = square_sums([tensors[i] for i in large], wide)
        if not rest:
            return squares
        found = dict(zip(large, squares.unbind(0), strict=True))
    if rest:
        norms = torch._foreach_norm([tensors[i] for i in rest], 2, dtype=wide)
        if shares is not None and any(share != 1.0 for share in shares):
            norms = torch._foreach_mul(norms, [math.sqrt(shares[i]) for i in rest])
        found |= {i: n.square() for i, n in zip(rest, norms, strict=True)}
    device = found[0].device
    return torch.stack(
        [v if v.device == device else v.to(device) for _, v in sorted(found.items())]
    )


# Tensors of at most this many entries are reduced by shape (`ByShape`): a CPU spends a few
# microseconds on each call, most of a small tensor's cost, and a large one's arithmetic outweighs
# its call. The stacked copy of a group is as large as the group's tensors.
SMALL_NUMEL = 1 << 14


class ByShape:
    """A fixed list of tensors (a model's parameters, or their gradients, in the same order)
    reduced by shape: the small plain tensors of one shape, dtype and device in one call on
    their stacked copy, every other one (large, float64, a DTensor) as `squared_norms` does.

    Host work then grows with the number of shapes, not of tensors: a 48-block stack's 194
    parameters are 2 groups. Results come in the list's order.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.count = len(tensors)
        self.groups = _repeated_shapes(
            tensors,
            [
                i
                for i, t in enumerate(tensors)
                if t.numel() <= SMALL_NUMEL
                and type(t) in (torch.Tensor, torch.nn.Parameter)  # no DTensor, no subclass
            ],
        )
        grouped = {i for group in self.groups for i in group}
        self.alone = [i for i in range(self.count) if i not in grouped]
        wide = any(tensors[i].dtype == torch.float64 for i in self.alone)
        self.dtype = torch.float64 if wide else torch.float32
        self._positions: dict[torch.device, list[torch.Tensor]] = {}

    @torch.no_grad()
    def squared_norms(
        self, tensors: Sequence[torch.Tensor | None], device: torch.device
    ) -> torch.Tensor:
        """`squared_norms` of ``tensors`` (None: 0), one value each on ``device``."""
        out = torch.zeros(self.count, dtype=self.dtype, device=device)
        positions = self._positions_on(device)
        for group, where in zip(self.groups, positions, strict=False):
            members = [tensors[i] for i in group]
            present = [t for t in members if t is not None]
            if len(present) < len(members):  # gradients not made yet: 0
                if not present:
                    continue
                where = torch.tensor([i for i in group if tensors[i] is not None], device=device)
            try:
                squares = _row_squares(torch.stack(present))
            except RuntimeError:  # a tensor changed shape since (FSDP1 swaps shards and wholes)
                squares = squared_norms(present)
            out.index_copy_(0, where, squares.to(device, self.dtype))
        alone = [(i, t) for i in self.alone if (t := tensors[i]) is not None]
        if alone:
            if len(alone) < len(self.alone):
                where = torch.tensor([i for i, _ in alone], device=device)
            else:
                where = positions[-1]
            squares = squared_norms([t for _, t in alone])
            out.index_copy_(0, where, squares.to(device, self.dtype))
        return out

    @torch.no_grad()
    def copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What `change_squares` compares against once ``tensors`` changed: a stacked copy of
        each group, then a copy of each other tensor (a DTensor's local shard)."""
        groups = [torch.stack([tensors[i] for i in group]) for group in self.groups]
        return groups + [local(tensors[i]).detach().clone() for i in self.alone]

    @torch.no_grad()
    def copy_squares(self, copies: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per tensor, in float32, the sum of squares of its copy in `copies`."""
        device = copies[0].device
        squares = torch.zeros(self.count, device=device)
        positions = self._positions_on(device)
        for before, where in zip(copies[: len(self.groups)], positions, strict=False):
            squares.index_copy_(0, where, _row_squares(before).to(device))
        if self.alone:
            alone = squared_norms(list(copies[len(self.groups) :]))
            squares.index_copy_(0, positions[-1], alone.to(device, torch.float32))
        return squares

    @torch.no_grad()
    def change_squares(
        self, tensors: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Per tensor, in float32, the sum of squares of its change since `copies` was taken."""
        device = copies[0].device
        change = torch.zeros(self.count, device=device)
        positions = self._positions_on(device)
        for group, before, where in zip(self.groups, copies, positions, strict=False):
            now = torch.stack([tensors[i] for i in group])
            change.index_copy_(0, where, _row_squares(now.sub_(before)).to(device))
        if self.alone:
            now_alone = [local(tensors[i]).detach() for i in self.alone]
            moved = squared_norms(torch._foreach_sub(now_alone, list(copies[len(self.groups) :])))
            change.index_copy_(0, positions[-1], moved.to(device, torch.float32))
        return change

    def _positions_on(self, device: torch.device) -> list[torch.Tensor]:
        """Each group's positions as an index tensor on ``device``, then the others' (made
        once per device)."""
        if device not in self._positions:
            lists = [*self.groups, self.alone]
            self._positions[device] = [torch.tensor(p, device=device) for p in lists]
        return self._positions[device]


def _repeated_shapes(tensors: Sequence[torch.Tensor], candidates: list[int]) -> list[list[int]]:
    """The positions among ``candidates`` of the tensors whose shape, dtype and device repeat,
    a group for each (float64 ones left out): each group is stacked and reduced in one call."""
    by_key: dict[tuple[object, ...], list[int]] = {}
    for i in candidates:
        t = tensors[i]
        if t.dtype != torch.float64:
            by_key.setdefault((t.shape, t.dtype, t.device), []).append(i)
    return [group for group in by_key.values() if len(group) > 1]


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real tensor of its real and imaginary parts (the same sum of
    squares: |z|^2 = re^2 + im^2); any other as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def _row_squares(stacked: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each tensor stacked along the first axis, in float32."""
    rows = _real(stacked).reshape(len(stacked), -1)
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).pow_(2)


# `SquareSums` reads a sampled tensor in runs of this many consecutive entries: 64 bytes of
# float32, one cache line. Single entries at a stride of 16 floats or more would each cost a
# whole line: as much memory traffic as reading the tensor whole.
CHUNK = 16


class SquareSums:
    """Sums of squared entries of a fixed list of tensors on one device (a model's gradients,
    new tensors each step, given in the same order; None counts 0), each read whole or, past
    ``sample`` entries, estimated from a fixed sample of about ``sample`` of them.

    The sample of a tensor is a run of `CHUNK` consecutive entries (in memory order) every
    ``CHUNK * q`` entries, ``q`` prime to a row's length (the entries past the first axis) so
    that the runs walk through all columns rather than repeat a few; its sum of squares times
    numel / entries read estimates the tensor's. The positions are the same at every step.
    The plain tensors read whole of at most `SMALL_NUMEL` entries are stacked a shape at a
    time where a shape repeats, the rest concatenated, each reduced in one call (a CPU spends
    microseconds on each call); the others (larger, a DTensor, a
    subclass) are read as `squared_norms` does. Results come in float32, in the order of
    `order` (positions in the list).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        sample: int | None,
        whole: Sequence[bool] | None = None,
    ) -> None:
        """``whole``: which tensors to read whole whatever their size, as `squared_norms` does
        (the gradient of an embedding table: a few rows, which a sample would mostly miss, or
        a sparse tensor)."""
        # complex tensors (FEDformer's Fourier weights) are read whole, as their real views
        plain = [
            type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_complex() for t in tensors
        ]
        runs = []
        for i, t in enumerate(tensors):
            if plain[i] and sample is not None and t.numel() > sample and not (whole and whole[i]):
                period = run_period(t.numel(), t.numel() // len(t), sample)
                runs.append((i, (1 + (t.numel() - CHUNK) // period, CHUNK), (period, 1)))
        sampled = {i for i, _, _ in runs}
        joined = [
            i
            for i, t in enumerate(tensors)
            if plain[i]
            and i not in sampled
            and t.numel() <= SMALL_NUMEL
            and not (whole and whole[i])
        ]
        self.alone = [i for i in range(len(tensors)) if i not in sampled and i not in joined]
        # of those, the tensors whose shape repeats are stacked a shape at a time (no reshape
        # call each); the others concatenated
        self.groups = [
            (group, tensors[group[0]].shape) for group in _repeated_shapes(tensors, joined)
        ]
        grouped = {i for group, _ in self.groups for i in group}
        joined = [i for i in joined if i not in grouped]
        self.order = [i for group, _ in self.groups for i in group]
        self.order += joined + [i for i, _, _ in runs] + self.alone
        self.joined = [(i, tensors[i].dim() != 1, tensors[i].numel()) for i in joined]
        self.runs = runs
        self.sampled = [i for i, _, _ in runs]  # the positions of the tensors sampled
        device = tensors[0].device
        self._lengths = torch.tensor([n for _, _, n in self.joined], device=device)
        self._rows = torch.tensor([size[0] for _, size, _ in runs], device=device)
        self._scales = torch.tensor(
            [tensors[i].numel() / (size[0] * CHUNK) for i, size, _ in runs], device=device
        )
        self._zeros: dict[int, torch.Tensor] = {}
        self._device = device

    def __call__(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The sums (estimates of the sampled ones) of ``tensors`` in the order `order`; under
        ``torch.no_grad()`` for gradients made with ``create_graph``."""
        parts = []
        for group, shape in self.groups:
            members = [
                self._zero(shape.numel()).view(shape) if (t := tensors[i]) is None else t
                for i in group
            ]
            parts.append(_row_squares(torch.stack(members)))
        if self.joined:
            flat = torch.cat(
                [
                    self._zero(n) if (t := tensors[i]) is None else t.reshape(-1) if nd else t
                    for i, nd, n in self.joined
                ]
            )
            flat = flat if flat.dtype == torch.float64 else flat.float()
            # unsafe: the lengths are right by construction; checking them reads them back
            parts.append(
                torch.segment_reduce(flat * flat, "sum", lengths=self._lengths, unsafe=True).float()
            )
        if self.runs:
            runs = torch.cat(
                [
                    self._zero(size[0] * CHUNK).view(size)
                    if (t := tensors[i]) is None
                    else t.as_strided(size, stride, t.storage_offset())
                    if t.is_contiguous()
                    else _runs(t, size, stride)
                    for i, size, stride in self.runs
                ]
            )
            runs = runs if runs.dtype == torch.float64 else runs.float()
            rows = torch.linalg.vecdot(runs, runs)
            squares = torch.segment_reduce(rows, "sum", lengths=self._rows, unsafe=True).float()
            parts.append(squares.mul_(self._scales))
        if self.alone:  # a missing gradient as a one-entry zero
            none = self._zero(1)
            alone = [none if (t := tensors[i]) is None else t for i in self.alone]
            parts.append(squared_norms(alone).float())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _zero(self, numel: int) -> torch.Tensor:
        if numel not in self._zeros:
            self._zeros[numel] = torch.zeros(numel, device=self._device)
        return self._zeros[numel]


def run_period(numel: int, row: int, sample: int) -> int:
    """The entries from one run of `CHUNK` to the next in a sample of at most ``sample``
    entries of a tensor of ``numel`` entries in rows of ``row``: ``CHUNK * q``, ``q`` at least
    numel / ``sample`` and prime to ``row``, so that the runs walk through all columns rather
    than repeat a few."""
    q = max(2, math.ceil(numel / sample))
    while math.gcd(q, row) != 1:
        q += 1
    return CHUNK * q


def _runs(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The runs of entries `SquareSums` reads of a tensor that is not contiguous, in memory
    order: a view when it fills its memory in a permuted order (channels_last), else runs of
    a contiguous copy."""
    by_stride = sorted(range(t.dim()), key=lambda d: -t.stride()[d])
    if not t.permute(by_stride).is_contiguous():
        t = t.contiguous()
    return t.as_strided(size, stride, t.storage_offset())
