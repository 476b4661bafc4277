"""The spike rule: a value above its history's mean + sigma standard deviations is a spike
(OLMo's rule), on device tensors (`check`) or, on a CPU, in float64 running sums (`HostRule`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .spikes import Spikes

# no spike before a series has this many steps of history (the window, if it is shorter)
WARMUP = 16
# the std is at least this fraction of |mean|: a flat history does not turn a rounding
# difference into a spike
STD_FLOOR = 1e-3
# `HostRule` sums a column's history again once the square of a value leaving it is this many
# times the remaining sum of squares: that subtraction left float64 about 10 exact digits
RESUM = 1e6


def check(
    row: torch.Tensor,
    history: torch.Tensor,
    present: torch.Tensor,
    position: int,
    spikes: Spikes,
) -> None:
    """The rule on one step, on device tensors (two passes over the history, in float32).

    ``row`` holds the step's values (after two flags and the z-scores); the flags, z-scores,
    means and history counts are written into it, and the values into the history (flat
    ``window x columns`` buffers, ``present`` 1 where a value entered) at ``position``.
    """
    columns = (len(row) - 2) // 4
    z, x, mean, count = (row[2 + i * columns : 2 + (i + 1) * columns] for i in range(4))
    history = history.reshape(spikes.window, columns)
    present = present.reshape(spikes.window, columns)
    count[:] = present.sum(0)
    mean[:] = history.sum(0) / count
    std = ((((history - mean) * present) ** 2).sum(0) / count) ** 0.5
    z[:] = (x - mean) / torch.maximum(std, abs(mean) * STD_FLOOR)
    finite = torch.isfinite(x)
    row[:2] = ((z > spikes.sigma) & (count >= min(WARMUP, spikes.window)) & finite)[:2]
    history[position] = torch.where(finite, x, 0.0)
    present[position] = finite


class HostRule:
    """`check`'s rule on a CPU, in Python floats: per column, float64 running sums of the
    history's values and squares, a value added as it enters and the one ``window`` steps
    older taken off. The sums are redone from the history every ``window`` steps, and for a
    column at once when the value taken off was so large against what remains (`RESUM`) that
    the subtraction left too few exact digits.
    """

    def __init__(self, spikes: Spikes, columns: int) -> None:
        self.sigma = spikes.sigma
        self.warmup = min(WARMUP, spikes.window)
        # the values that entered (None: none did, NaN or Inf), ``window`` rows of columns
        self.history: list[list[float | None]] = [[None] * columns for _ in range(spikes.window)]
        self.counts = [0] * columns
        self.sums = [0.0] * columns
        self.squares = [0.0] * columns

    def __call__(self, row: np.ndarray[Any, Any], position: int) -> None:
        """The rule on the step whose values ``row`` holds (laid out as `check`'s), written
        into it; the values enter the history at ``position``."""
        columns = len(self.counts)
        values = row[2 + columns : 2 + 2 * columns].tolist()
        leaving = self.history[position]
        z, means, counts = [], [], [float(n) for n in self.counts]
        for c, x in enumerate(values):
            n, total, squares = self.counts[c], self.sums[c], self.squares[c]
            mean = total / n if n else math.nan
            std = math.sqrt(max(squares / n - mean * mean, 0.0)) if n else math.nan
            z.append(_quotient(x - mean, max(std, abs(mean) * STD_FLOOR)))
            means.append(mean)
            old, new = leaving[c], x if math.isfinite(x) else None
            if old is not None:
                n, total, squares = n - 1, total - old, squares - old * old
            if new is not None:
                n, total, squares = n + 1, total + new, squares + new * new
            leaving[c] = new
            self.counts[c], self.sums[c], self.squares[c] = n, total, squares
            if old is not None and old * old > RESUM * squares:
                self._resum(c)
        if position == len(self.history) - 1:  # rounding kept from adding up for good
            for c in range(columns):
                self._resum(c)
        flags = [
            float(z[c] > self.sigma and counts[c] >= self.warmup and leaving[c] is not None)
            for c in range(2)
        ]
        row[: 2 + columns] = flags + z
        row[2 + 2 * columns :] = means + counts

    def _resum(self, c: int) -> None:
        entered = [v for step in self.history if (v := step[c]) is not None]
        self.counts[c] = len(entered)
        self.sums[c] = math.fsum(entered)
        self.squares[c] = math.fsum(v * v for v in entered)


def _quotient(a: float, b: float) -> float:
    """``a / b`` as numpy divides: +-inf, or NaN for 0 / 0, when ``b`` is 0."""
    if b:
        return a / b
    return a * math.inf if a else math.nan
