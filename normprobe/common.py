"""Small helpers several parts of normprobe share."""

from __future__ import annotations

from torch import nn


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_writer() -> bool:
    """Whether this process writes: the only one, or global rank zero."""
    import torch.distributed as dist

    return world_size() == 1 or dist.get_rank() == 0


def spread(n: int, cap: int) -> list[int]:
    """Indices ``0..n-1``: all of them up to ``cap``, else ``cap`` spread evenly (first and
    last included)."""
    if n <= cap:
        return list(range(n))
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns, or was compiled in place
    (``module.compile()``, or by Lightning)."""
    return (
        hasattr(module, "_orig_mod")
        or getattr(module, "_compiled_call_impl", None) is not None
        or getattr(module, "_compiler_ctx", None) is not None
    )
