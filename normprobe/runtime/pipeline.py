"""Pipeline parallelism (``torch.distributed.pipelining``, DeepSpeed's ``PipelineModule``),
refused: each stage holds other blocks, which ranks cannot combine as copies of one model.

Found at attach (the module of a stage), on the first forward (run by a pipelining schedule),
and, where ``torch.distributed.pipelining`` is imported, at the first logged step by one
collective comparing the modules every rank probes.
"""

from __future__ import annotations

import gc
import sys
import zlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

PIPELINING = "torch.distributed.pipelining"
PIPELINE = (
    "normprobe does not support pipeline parallelism: each stage holds other blocks, and the "
    "ranks' statistics would be combined as copies of one model. Probe a model that every rank "
    "holds whole or sharded (DDP, FSDP, HSDP, DeepSpeed ZeRO, tensor parallelism)"
)


def refuse_stage(model: nn.Module) -> None:
    """Raise a RuntimeError when ``model`` is the module of a ``torch.distributed.pipelining``
    stage (or a DeepSpeed ``PipelineModule``)."""
    deepspeed = sys.modules.get("deepspeed.runtime.pipe.module")
    kind = getattr(deepspeed, "PipelineModule", None)
    if kind is not None and isinstance(model, kind):
        raise RuntimeError(f"{PIPELINE}; {type(model).__name__} is a DeepSpeed PipelineModule")
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:  # not imported: no stage exists
        return
    for holder in _holders(model):
        if isinstance(holder, base):
            raise RuntimeError(
                f"{PIPELINE}; {type(model).__name__} is the module of a "
                f"torch.distributed.pipelining {type(holder).__name__}"
            )


def _holders(model: nn.Module) -> Iterable[object]:
    """The objects holding ``model`` (directly or through their ``__dict__``)."""
    for ref in gc.get_referrers(model):
        if isinstance(ref, dict):
            yield from (o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref)
        else:
            yield ref


def refuse_call() -> None:
    """Raise a RuntimeError when the running forward is called by a
    ``torch.distributed.pipelining`` schedule (checked on the first forward)."""
    if PIPELINING not in sys.modules:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.pipelining"):
            raise RuntimeError(f"{PIPELINE}; the model runs in a pipelining schedule")
        frame = frame.f_back  # type: ignore[assignment]


def same_blocks_everywhere(names: Sequence[str], device: torch.device) -> None:
    """Raise a RuntimeError on every rank unless all ranks probe the same blocks (``names``):
    one collective, at the first logged step, where ``torch.distributed.pipelining`` is in use."""
    import torch.distributed as dist

    crc = zlib.crc32("\n".join(names).encode())
    mine = torch.tensor([len(names), crc >> 16, crc & 0xFFFF], device=device).float()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if any(not torch.equal(other, mine) for other in every):
        raise RuntimeError(f"{PIPELINE}; the ranks probe different blocks")
