"""The spike rule: a value above its history's mean + sigma standard deviations is a spike
(OLMo's rule), on device tensors (`check`) or, on a CPU, in float64 running sums (`HostRule`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
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
    """`check`'s rule on a CPU, in float64 numpy arrays: per column, running sums of the
    history's values and squares, a value added as it enters and the one ``window`` steps
    older taken off. The sums are redone from the history every ``window`` steps, and for a
    column at once when the value taken off was so large against what remains (`RESUM`) that
    the subtraction left too few exact digits.
    """

    def __init__(self, spikes: Spikes, columns: int) -> None:
        self.sigma = spikes.sigma
        self.warmup = min(WARMUP, spikes.window)
        # the values that entered (NaN: none did, a NaN or Inf), ``window`` rows of columns
        self.history = np.full((spikes.window, columns), math.nan)
        self.counts = np.zeros(columns)
        self.sums = np.zeros(columns)
        self.squares = np.zeros(columns)

    def __call__(self, row: np.ndarray[Any, Any], position: int) -> None:
        """The rule on the step whose values ``row`` holds (laid out as `check`'s), written
        into it; the values enter the history at ``position``."""
        columns = len(self.counts)
        values = row[2 + columns : 2 + 2 * columns].astype(np.float64)
        counts = self.counts.copy()
        with np.errstate(divide="ignore", invalid="ignore"):
            means = self.sums / counts
            std = np.sqrt(np.maximum(self.squares / counts - means * means, 0.0))
            z = (values - means) / np.maximum(std, np.abs(means) * STD_FLOOR)
        old = self.history[position]
        new = np.where(np.isfinite(values), values, math.nan)
        left, entered = ~np.isnan(old), ~np.isnan(new)
        old_or_0, new_or_0 = np.where(left, old, 0.0), np.where(entered, new, 0.0)
        self.counts += entered.astype(np.float64) - left
        self.sums = self.sums - old_or_0 + new_or_0
        self.squares = self.squares - old_or_0 * old_or_0 + new_or_0 * new_or_0
        self.history[position] = new
        if position == len(self.history) - 1:  # rounding kept from adding up for good
            self._resum(range(columns))
        else:
            self._resum(np.flatnonzero(left & (old_or_0 * old_or_0 > RESUM * self.squares)))
        flags = (z[:2] > self.sigma) & (counts[:2] >= self.warmup) & entered[:2]
        row[:2] = flags
        row[2 : 2 + columns] = z
        row[2 + 2 * columns : 2 + 3 * columns] = means
        row[2 + 3 * columns :] = counts

    def _resum(self, columns: Iterable[int]) -> None:
        for c in columns:
            entered = self.history[:, c][~np.isnan(self.history[:, c])].tolist()
            self.counts[c] = len(entered)
            self.sums[c] = math.fsum(entered)
            self.squares[c] = math.fsum(v * v for v in entered)
