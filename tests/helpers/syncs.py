"""Counting the calls that copy device values to the host."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode


class CountSyncs(TorchFunctionMode):
    """Counts the calls that copy device values to the host. ``numpy`` is none: it views a CPU
    tensor's memory, and raises on a device tensor not copied with ``cpu`` first (counted)."""

    SYNCS = frozenset({"item", "tolist", "cpu", "__bool__", "__float__", "__int__"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))
