"""Memory reused by the reductions of one logged forward on a CPU."""

from __future__ import annotations

import torch

from ... import probes

# the fewest entries worth a scratch: smaller temporaries come from memory the allocator keeps
SCRATCH_MIN = 1 << 15


class Scratch:
    """One buffer for the temporaries of a logged forward's large reductions on a CPU (a
    stream's |x| and its squares), reused from one tensor to the next and
    released when the forward ends (`release`).

    A temporary the size of a residual stream made fresh at each block lands on pages the
    allocator took back from the system: a page fault per 4 KB, which costs more than the
    arithmetic. Elsewhere (a GPU's caching allocator, small tensors, a compiled graph) `like`
    gives None and the reductions make their own.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._buffer: torch.Tensor | None = None

    def like(self, t: torch.Tensor) -> torch.Tensor | None:
        """Memory of ``t``'s shape in the type ``t`` is reduced in (contiguous, its values
        undefined), or None where a scratch does not pay."""
        if not self.enabled or t.device.type != "cpu" or t.numel() < SCRATCH_MIN:
            return None
        dtype = probes.wide_dtype(t)
        buffer = self._buffer
        if buffer is None or buffer.dtype != dtype or buffer.numel() < t.numel():
            buffer = self._buffer = torch.empty(t.numel(), dtype=dtype)
        return buffer[: t.numel()].view(t.shape)

    def release(self) -> None:
        self._buffer = None
