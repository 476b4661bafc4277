"""A logged step's statistics as one float32 vector: the slot layout, what was measured on the
device, the one transfer to the host, and the combination across ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..common import world_size
from ..metrics.core.base import Reduce, Slot


class Layout:
    """Each statistic's place in the packed vector, fixed at install, the same on every rank."""

    def __init__(self) -> None:
        self.size = 0
        self.positions: dict[Reduce, list[int]] = {}  # how ranks combine each position
        self._index: tuple[torch.device, dict[Reduce, torch.Tensor]] | None = None

    def slot(self, size: int, reduce: Reduce) -> Slot:
        slot = Slot(self.size, size, reduce)
        self.positions.setdefault(reduce, []).extend(range(self.size, self.size + size))
        self.size += size
        return slot

    def reduce_index(self, device: torch.device) -> dict[Reduce, torch.Tensor]:
        if self._index is None or self._index[0] != device:
            index = {k: torch.tensor(v, device=device) for k, v in self.positions.items()}
            self._index = (device, index)
        return self._index[1]


class Measurements:
    """What the current logged step measured, still on the device."""

    def __init__(self) -> None:
        self.whole: dict[int, tuple[Slot, torch.Tensor]] = {}  # by slot offset
        self.parts: list[tuple[Sequence[int], torch.Tensor]] = []
        # what each earlier forward of the step measured, packed, and its size (`end_forward`)
        self.forwards: list[tuple[list[int], torch.Tensor, float]] = []

    def put(self, slot: Slot, value: torch.Tensor) -> None:
        self.whole[slot.offset] = (slot, value)

    def put_max(self, slot: Slot, value: torch.Tensor) -> None:
        old = self.whole.get(slot.offset)
        self.whole[slot.offset] = (slot, value if old is None else torch.maximum(old[1], value))

    def put_at(self, positions: Sequence[int], values: torch.Tensor) -> None:
        self.parts.append((positions, values))

    def clear(self) -> None:
        self.whole.clear()
        self.parts.clear()
        self.forwards.clear()

    def end_forward(self, size: float) -> None:
        """Keep what this forward measured apart: a micro-batch of ``size`` elements, combined
        with the step's others by `read_micro_batches`."""
        positions, packed = self.pack(torch.device("cpu"))
        if positions:
            self.forwards.append((positions, packed, size))
        self.whole.clear()
        self.parts.clear()

    def pack(self, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """Everything as one float32 vector (on the device of what was measured, else
        ``device``), and each value's position."""
        held = [v for _, v in self.whole.values()] or [v for _, v in self.parts]
        device = held[0].device if held else device
        scalar_positions: list[int] = []
        scalars: list[torch.Tensor] = []
        positions: list[int] = []
        vectors: list[torch.Tensor] = []
        for slot, value in self.whole.values():
            if value.dim() == 0:
                scalar_positions.append(slot.offset)
                scalars.append(value)
            else:
                positions += range(slot.offset, slot.offset + slot.size)
                vectors.append(value.reshape(-1))
        for where, value in self.parts:
            positions += where
            vectors.append(value)
        pieces = ([torch.stack(_moved(scalars, device))] if scalars else []) + vectors
        if not pieces:
            return [], torch.zeros(0, device=device)
        return scalar_positions + positions, torch.cat(_moved(pieces, device)).float()


class HostValues:
    """A logged step's values on the host (`normprobe.metrics.core.base.Values`)."""

    def __init__(self, values: list[float], present: list[float], validation: bool) -> None:
        self.values = values
        self.present = present
        self.validation = validation

    def get(self, slot: Slot) -> list[float] | None:
        if not self.present[slot.offset]:
            return None
        return self.values[slot.offset : slot.offset + slot.size]

    def measured(self, slot: Slot) -> dict[int, float]:
        start = slot.offset
        return {i: self.values[start + i] for i in range(slot.size) if self.present[start + i]}


def read_back(
    measured: Measurements, layout: Layout, device: torch.device, validation: bool
) -> HostValues | None:
    """What the step measured, on the host: one transfer (one collective and one transfer
    under ``torch.distributed``, whose ranks all call it). None when nothing was measured."""
    positions, packed = measured.pack(device)
    if world_size() > 1:
        return HostValues(*combine_ranks(positions, packed, layout), validation)
    if not positions:
        return None
    return HostValues(*to_host(positions, packed, layout.size), validation)


def read_micro_batches(
    measured: Measurements, layout: Layout, device: torch.device, validation: bool
) -> HostValues:
    """What the step measured, on the host, in one transfer and no collective: the values of
    its forwards (micro-batches) combined as ranks' are, means weighted by each one's size,
    then those of the step."""
    positions, packed = measured.pack(device)
    total = layout.size
    values, present = packed.new_zeros(total), packed.new_zeros(total)
    if measured.forwards:
        every = torch.stack(
            [_dense(p, v.to(packed.device), total) for p, v, _ in measured.forwards]
        )
        sizes = torch.tensor([n for _, _, n in measured.forwards], device=packed.device)
        values, count = _combined(every[:, :total], every[:, total:] > 0.5, layout, sizes)
        present = (count > 0).float()
    if positions:
        index = torch.tensor(positions, dtype=torch.long, device=packed.device)
        values = values.index_copy(0, index, packed)
        present = present.index_fill(0, index, 1.0)
    host = torch.cat([values, present]).tolist()  # the one transfer
    return HostValues(host[:total], host[total:], validation)


def _dense(positions: list[int], packed: torch.Tensor, total: int) -> torch.Tensor:
    """``packed`` in the full layout (zeros elsewhere), then a presence flag per value."""
    index = torch.tensor(positions, dtype=torch.long, device=packed.device)
    return torch.cat(
        [
            packed.new_zeros(total).index_copy_(0, index, packed),
            packed.new_zeros(total).index_fill_(0, index, 1.0),
        ]
    )


def to_host(
    positions: list[int], packed: torch.Tensor, total: int
) -> tuple[list[float], list[float]]:
    """(values, present) in the full layout, with the one device-to-host transfer."""
    values, present = [0.0] * total, [0.0] * total
    for position, value in zip(positions, packed.tolist(), strict=True):
        values[position], present[position] = value, 1.0
    return values, present


def combine_ranks(
    positions: list[int], packed: torch.Tensor, layout: Layout
) -> tuple[list[float], list[float]]:
    """Every rank's values in the full layout, each with a presence flag per value (so that a
    measured NaN stays a NaN), combined across ranks in one collective and one transfer."""
    import torch.distributed as dist

    total = layout.size
    full = _dense(positions, packed, total)
    gathered = [torch.empty_like(full) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, full)  # the one collective of a logged step
    ranks = torch.stack(gathered)
    out, count = _combined(ranks[:, :total], ranks[:, total:] > 0.5, layout)
    host = torch.cat([out, (count > 0).float()]).tolist()  # the one transfer
    return host[:total], host[total:]


def _combined(
    values: torch.Tensor, present: torch.Tensor, layout: Layout, sizes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of values (ranks, or a step's micro-batches) combined by each position's
    reduction, means weighted by the rows' ``sizes`` (None: alike), and how many rows hold
    each position."""
    total = layout.size
    count = present.sum(dim=0)
    kept = torch.where(present, values, torch.zeros((), device=values.device))
    weights = torch.ones_like(values) if sizes is None else sizes[:, None].expand_as(values)
    weights = torch.where(present, weights, torch.zeros((), device=values.device))
    mean_of = weights.sum(dim=0).clamp_min(torch.finfo(values.dtype).tiny)
    combined = {
        "mean": (weights * kept).sum(dim=0) / mean_of,
        "rms": ((weights * kept.pow(2)).sum(dim=0) / mean_of).sqrt(),
        "sum": kept.sum(dim=0),
        "max": values.masked_fill(~present, -math.inf).amax(dim=0),
        "min": values.masked_fill(~present, math.inf).amin(dim=0),
    }
    out = torch.zeros(total, device=values.device)
    for kind, where in layout.reduce_index(values.device).items():
        out[where] = combined[kind][where]
    return out, count


def _moved(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t if t.device == device else t.to(device) for t in tensors]
