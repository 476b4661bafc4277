"""Parameters held in shards (DTensor, FSDP): a rank's local part and its share of the whole."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def dtensor_type() -> type[DTensor] | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return getattr(module, "DTensor", None)


def any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), else ``t``: no collective."""
    dtensor = dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def held_part(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding this rank's part of DTensor ``t`` (no op runs: none is traced), or
    None for any other tensor."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return None
    part: torch.Tensor = t._local_tensor
    return part


def local_part(t: torch.Tensor) -> torch.Tensor:
    """`held_part` of a DTensor (an activation sequence parallelism shards), else ``t``."""
    held = held_part(t)
    return t if held is None else held


def shard_share(t: torch.Tensor) -> float:
    """The weight of this rank's shard of ``t`` in a sum over all ranks: 1 / the number of
    ranks holding the same shard (HSDP's replicas) for a DTensor, 1 for a plain tensor."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return 1.0
    mesh = t.device_mesh
    if any(place.is_partial() for place in t.placements):
        raise RuntimeError(
            f"normprobe: a DTensor with placements {t.placements} holds partial sums on each "
            "rank, whose squares do not add up; redistribute it to Shard or Replicate"
        )
    # Shard, and the _StridedShard of FSDP2 over tensor parallelism: each rank a different part
    held = (d for d, place in enumerate(t.placements) if not place.is_replicate())
    return math.prod(mesh.size(d) for d in held) / torch.distributed.get_world_size()


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded across ranks: DTensors (FSDP2), or FSDP1
    modules inside it that shard (any strategy but ``NO_SHARD``)."""
    dtensor = dtensor_type()
    if dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters()):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(
        isinstance(m, fsdp.FullyShardedDataParallel)
        and m.sharding_strategy != fsdp.ShardingStrategy.NO_SHARD
        for m in model.modules()
    )
