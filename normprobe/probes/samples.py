"""A copy of a fixed sample of many tensors (a model's weights before the optimizer step), and
the sums of squares estimated from it: of each tensor, and of its change since."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .shards import local
from .squares import CHUNK, ByShape, run_period


@dataclass
class Runs:
    """The sampled tensors on one device: their positions, and per tensor its number of runs
    and numel / entries read."""

    at: list[int]
    lengths: torch.Tensor
    scales: torch.Tensor


# the copies of the tensors read whole (`ByShape.copies`); the runs on each device copied
# (float32, or float64), concatenated
Copy = tuple[list[torch.Tensor], list[tuple[Runs, torch.Tensor]]]


class SampledCopy:
    """A fixed list of tensors, each in the same shape at every call: `copy` copies a sample
    of them, `copy_squares` estimates each one's sum of squares from it, `change_squares` the
    sum of squares of each one's change since.

    A tensor of at most its ``budget`` entries is read whole (those of a repeated small shape
    stacked, `ByShape`). Of a larger one, runs of `CHUNK` consecutive entries in memory order,
    one every `run_period` entries: about ``budget`` entries, in whole cache lines (single
    entries at a stride would each cost a line: the memory traffic of the whole tensor).
    The runs of every tensor on a device are copied in one call, and an estimate is their sum
    of squares times numel / entries read. A DTensor's local shard is read.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], budgets: Sequence[int]) -> None:
        self.count = len(tensors)
        self.budgets = list(budgets)
        sizes = [local(t).numel() for t in tensors]
        self.sampled = [i for i in range(self.count) if sizes[i] > max(self.budgets[i], CHUNK)]
        taken = set(self.sampled)
        self.whole = [i for i in range(self.count) if i not in taken]
        self._by_shape = ByShape([tensors[i] for i in self.whole])
        self._layouts: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._counts: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._where: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}

    @torch.no_grad()
    def copy(self, tensors: Sequence[torch.Tensor]) -> Copy:
        """A copy of the sample of ``tensors``."""
        whole = self._by_shape.copies([tensors[i] for i in self.whole]) if self.whole else []
        return whole, [(r, _wide(torch.cat(views))) for r, views in self._views(tensors)]

    @torch.no_grad()
    def copy_squares(self, copy: Copy) -> torch.Tensor:
        """Per tensor, in float32, its sum of squares estimated from ``copy``."""
        whole, runs = copy
        parts = [(self.whole, self._by_shape.copy_squares(whole))] if whole else []
        parts += [(r.at, _estimates(r, copied)) for r, copied in runs]
        return self._placed(parts)

    @torch.no_grad()
    def change_squares(self, tensors: Sequence[torch.Tensor], copy: Copy) -> torch.Tensor:
        """Per tensor, in float32, the sum of squares of its change since ``copy`` was taken,
        estimated from the sample."""
        whole, runs = copy
        parts = []
        if whole:
            now = [tensors[i] for i in self.whole]
            parts.append((self.whole, self._by_shape.change_squares(now, whole)))
        for (r, views), (_, before) in zip(self._views(tensors), runs, strict=True):
            moved = _wide(torch.cat(views)).sub_(before)
            parts.append((r.at, _estimates(r, moved)))
        return self._placed(parts)

    def _views(self, tensors: Sequence[torch.Tensor]) -> list[tuple[Runs, list[torch.Tensor]]]:
        """Per device, the sampled tensors' runs, each a (runs, `CHUNK`) view (of a contiguous
        copy where the tensor is not contiguous)."""
        found: dict[torch.device, tuple[list[int], list[torch.Tensor], list[tuple[int, int]]]]
        found = {}
        for i in self.sampled:
            t = local(tensors[i]).detach()
            flat = t.reshape(-1)
            rows, period = self._layout(flat.numel(), t.shape[-1] if t.ndim else 1, i)
            at, views, sizes = found.setdefault(t.device, ([], [], []))
            at.append(i)
            views.append(flat[: rows * period].view(rows, period)[:, :CHUNK])
            sizes.append((rows, flat.numel()))
        return [
            (Runs(at, *self._run_counts(device, sizes)), views)
            for device, (at, views, sizes) in found.items()
        ]

    def _layout(self, numel: int, row: int, i: int) -> tuple[int, int]:
        """(runs, period) of the sample of tensor ``i`` with ``numel`` entries in rows of
        ``row``: whole periods only, so that the view stays inside the tensor."""
        key = (numel, row, self.budgets[i])
        if key not in self._layouts:
            period = run_period(numel, row, self.budgets[i])
            # a budget under a few runs: one run, at the start
            self._layouts[key] = (numel // period, period) if numel >= period else (1, numel)
        return self._layouts[key]

    def _run_counts(
        self, device: torch.device, sizes: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per tensor of (runs, numel) ``sizes``, its runs and numel / entries read, as
        tensors on ``device`` (made once)."""
        key = (device, *sizes)
        if key not in self._counts:
            lengths = torch.tensor([rows for rows, _ in sizes], device=device)
            scales = [numel / (rows * CHUNK) for rows, numel in sizes]
            self._counts[key] = (lengths, torch.tensor(scales, device=device))
        return self._counts[key]

    def _placed(self, parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
        """One vector of `count` values, the parts' values at their positions."""
        if not parts:
            return torch.zeros(0)
        device = parts[0][1].device
        out = torch.zeros(self.count, device=device)
        for at, values in parts:
            key = (device, tuple(at))
            if key not in self._where:
                self._where[key] = torch.tensor(at, device=device)
            out.index_copy_(0, self._where[key], values.to(device, torch.float32))
        return out


def _estimates(runs: Runs, values: torch.Tensor) -> torch.Tensor:
    """Each tensor's sum of squares estimated from ``values``, its runs' entries (or those of
    its change) concatenated, float32 or float64."""
    rows = torch.linalg.vecdot(values, values)
    # unsafe: the lengths are right by construction; checking them reads them back
    sums = torch.segment_reduce(rows, "sum", lengths=runs.lengths, unsafe=True).float()
    return sums.mul_(runs.scales)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 if it is."""
    return t if t.dtype == torch.float64 else t.float()
