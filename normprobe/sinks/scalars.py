"""A step's scalars as one TensorBoard ``Summary``, filled into a template of the run's tags: a
few hundred tags cost one numpy scatter where a protobuf call each cost a third of a
millisecond. The summary's own series (`companion_tag`) are computed here too, vectorized."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from .. import tags

# the summary draws these ratios as log2 (``normprobe/summary/<series>_log2/<stack>``): a run at
# 100 and one at 0.5 both read on one axis
LOG2 = ("grad_ratio", "resid_growth")
# and these per-module series as each stack's largest (``normprobe/summary/<series>/<stack>``)
STACK_MAX = ("attn_logit_max",)
LAYOUTS = 8  # tag lists kept (a record of spike events between the logged steps' has its own)

K = TypeVar("K")
V = TypeVar("V")


@functools.lru_cache(maxsize=1 << 14)
def companion_tag(tag: str) -> tuple[str, str] | None:
    """The summary tag ``tag``'s value goes to, and how: ``log2`` or ``max`` (over a stack)."""
    t = tags.parse(tag)
    if t is None:
        return None
    if t.series in LOG2 and t.block is None:
        return tags.format("summary", f"{t.series}_log2/{t.subject}"), "log2"
    if t.series in STACK_MAX:
        return tags.format("summary", f"{t.series}/{t.subject}"), "max"
    return None


def varint(n: int) -> bytes:
    """``n`` (0 or more) as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Layout:
    """The template of one list of scalar tags, with their companions after them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        log2: dict[str, int] = {}
        highest: dict[str, list[int]] = {}
        for i, tag in enumerate(names):
            found = companion_tag(tag)
            if found is not None and found[1] == "log2":
                log2[found[0]] = i
            elif found is not None:
                highest.setdefault(found[0], []).append(i)
        self.count = len(names)
        self.log2_from = np.array(list(log2.values()), dtype=np.int64)
        self.max_from = np.array([i for group in highest.values() for i in group], dtype=np.int64)
        sizes = [len(group) for group in highest.values()]
        self.max_starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        # Summary.value (field 1) holding Value.tag (field 1) and Value.simple_value (field 2,
        # a little-endian float32), one after the other
        parts, offsets, at = [], [], 0
        for tag in names + tuple(log2) + tuple(highest):
            name = tag.encode()
            value = b"\x0a" + varint(len(name)) + name + b"\x15"
            head = b"\x0a" + varint(len(value) + 4)
            parts.append(head + value + bytes(4))
            offsets.append(at + len(head) + len(value))
            at += len(parts[-1])
        self.template = np.frombuffer(b"".join(parts), dtype=np.uint8).copy()
        self.positions = (np.array(offsets)[:, None] + np.arange(4)).reshape(-1)

    def fill(self, values: np.ndarray) -> bytes:
        """The serialized Summary of ``values`` (float64, in the tags' order)."""
        # past float32's range: inf, as protobuf rounds it; no log2 of 0, a negative or NaN
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratios = values[self.log2_from]
            log2 = np.where((ratios > 0) & np.isfinite(ratios), np.log2(ratios), math.nan)
            # np.maximum keeps a NaN: NaN and Inf win, they are the news
            highest = (
                np.maximum.reduceat(values[self.max_from], self.max_starts)
                if len(self.max_from)
                else values[:0]
            )
            row = np.concatenate([values, log2, highest]).astype("<f4")
        self.template[self.positions] = row.view(np.uint8)
        return self.template.tobytes()


def kept(layouts: dict[K, V], key: K, make: Callable[[K], V]) -> V:
    """The template ``layouts`` holds for ``key``, made (and kept) if it holds none; at most
    `LAYOUTS` are kept."""
    found = layouts.get(key)
    if found is None:
        if len(layouts) >= LAYOUTS:
            layouts.clear()
        found = layouts[key] = make(key)
    return found


class ScalarSummaries:
    """Makes the Summary of each step's scalars and their companions, keeping the templates
    of the last few tag lists it saw."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    def serialized(self, scalars: dict[str, float]) -> bytes:
        """The serialized ``Summary`` of ``scalars`` and their companions."""
        layout = kept(self._layouts, tuple(scalars), _Layout)
        values = np.fromiter(scalars.values(), np.float64, count=layout.count)
        return layout.fill(values)
