"""Parallel layouts past data parallelism, checked at attach: tensor parallelism
(``torch.distributed.tensor.parallel``, alone or with FSDP2/HSDP on a 2-D or 3-D DeviceMesh)
and pipeline parallelism (``torch.distributed.pipelining``).

Under tensor parallelism the parameter families read whole tensors (each rank's shard counted
once, `normprobe.probes.shard_share`), and while every parallelized module hands back a local
tensor whole on each rank of its group (``ColwiseParallel`` inside a block, ``RowwiseParallel``
with its default replicated output: no sequence parallelism) the block outputs, norms and
attention maxima read are the ones one process reads. Per-head vectors are not (each rank holds
some of the heads), nor is any activation under sequence parallelism or an unknown DTensor
layout: those families are refused by name. Pipeline stages are refused: each rank holds other
blocks, which ranks cannot combine as copies of one model.
"""

from __future__ import annotations

import gc
import sys
import warnings
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..common import is_writer

# each rank holds some of the heads: per-head vectors would mix different heads
HEAD_FAMILIES = ("attn_logits_head", "attn_entropy")
# read from activations: right only where those are whole on every rank
ACTIVATION_FAMILIES = (
    "resid_rms",
    "resid_cos",
    "outliers",
    "norm_rms",
    "attn_logits",
    "logits",
    "bn_stats",
    "nonfinite",
)
# the parallel styles whose local outputs stay whole between blocks (with default layouts)
_WHOLE_STYLES = ("ColwiseParallel", "RowwiseParallel")
SUPPORTED = (
    "normprobe supports tensor parallelism with ColwiseParallel / RowwiseParallel (replicated "
    "outputs, no sequence parallelism), alone or with FSDP2/HSDP over the data-parallel mesh "
    "dimensions"
)


def _dtensor_params(model: nn.Module) -> list[tuple[str, Any]]:
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return []
    return [(n, p) for n, p in model.named_parameters() if isinstance(p, dtensor)]


def _fsdp_held(model: nn.Module) -> set[int]:
    """The parameters FSDP2 (``fully_shard``) manages: those of its modules."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    if kind is None:
        return set()
    return {id(p) for m in model.modules() if isinstance(m, kind) for p in m.parameters()}


def _data_parallel(placements: tuple[Any, ...]) -> bool:
    """FSDP2's placements on a 1-D mesh (Shard), HSDP's on a 2-D one (Replicate, Shard)."""
    last = placements[-1]
    plain_shard = type(last).__name__ == "Shard"
    return plain_shard and all(p.is_replicate() for p in placements[:-1]) and len(placements) <= 2


def _styles(model: nn.Module) -> dict[str, str]:
    """Per module path, the parallel style ``parallelize_module`` applied to it (found in its
    hooks), with ``+sharded`` when its output is no local tensor whole on each rank."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        for hook in hooks:
            for cell in getattr(hook, "__closure__", None) or ():
                try:
                    fn = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                func: Any = getattr(fn, "func", None)
                if not str(getattr(func, "__module__", "")).startswith("torch.distributed.tensor"):
                    continue
                style = func.__qualname__.partition(".")[0]
                found[path] = found.get(path, style)
                if func.__name__ == "_prepare_output_fn" and not _whole_output(style, fn.args):
                    found[path] = f"{style}+sharded"
    return found


def _whole_output(style: str, args: tuple[Any, ...]) -> bool:
    """Whether a style's output function (its partial's ``args``) hands back a local tensor
    whole on each rank: ColwiseParallel's local shard (inside a block) or a replicated one."""
    if style not in _WHOLE_STYLES or len(args) != 2:
        return False
    layouts, local = args
    layout = layouts[0] if isinstance(layouts, tuple | list) else layouts
    return bool(local) and (style == "ColwiseParallel" or layout.is_replicate())


def tensor_parallel(model: nn.Module) -> dict[str, str] | None:
    """None when no parameter is laid out past data parallelism; else the families that cannot
    be read under ``model``'s tensor-parallel layout, each with the reason."""
    fsdp = _fsdp_held(model)
    params = [
        (n, p)
        for n, p in _dtensor_params(model)
        if not (id(p) in fsdp and _data_parallel(tuple(p.placements)))
    ]
    if not params:
        return None
    name, first = params[0]
    layout = f"tensor parallelism ({name}: {tuple(first.placements)})"
    refused = dict.fromkeys(HEAD_FAMILIES, f"{layout}: each rank holds some of the heads")
    styles = _styles(model)
    sharded = sorted(path for path, style in styles.items() if style not in _WHOLE_STYLES)
    if sharded or not styles:
        why = (
            f"activations sharded across ranks ({sharded[0]}: {styles[sharded[0]]})"
            if sharded
            else "no parallelize_module style found: activations may be sharded"
        )
        refused |= dict.fromkeys(ACTIVATION_FAMILIES, f"{layout}: {why}")
    return refused


def parallelized_head(model: nn.Module, head: str | None) -> str | None:
    """Why ``logits`` cannot be read: the output head ``head`` is tensor-parallel (its logits
    split over the vocabulary), or None."""
    if head is None:
        return None
    style = _styles(model).get(head)
    return None if style is None else f"the output head {head} is parallelized ({style})"


def checked(
    model: nn.Module, metrics: tuple[str, ...], explicit: bool, refused: dict[str, str] | None
) -> tuple[str, ...]:
    """``metrics`` less the ``refused`` ones: a ValueError naming them when the user chose
    them (``explicit``), else a warning."""
    dropped = {m: why for m, why in (refused or {}).items() if m in metrics}
    if not dropped:
        return metrics
    lines = "; ".join(f"{m} ({why})" for m, why in dropped.items())
    text = (
        f"normprobe cannot read {', '.join(dropped)} on {type(model).__name__}: {lines}. "
        f"{SUPPORTED}; leave them out of metrics=[...]"
    )
    if explicit:
        raise ValueError(text)
    if is_writer():
        warnings.warn(text, RuntimeWarning, stacklevel=5)  # attach's caller, via Probe._chosen
    return tuple(m for m in metrics if m not in dropped)


# pipeline parallelism -------------------------------------------------------------------------
PIPELINING = "torch.distributed.pipelining"
PIPELINE = (
    "normprobe does not support pipeline parallelism: each stage holds other blocks, and the "
    "ranks' statistics would be combined as copies of one model. Probe a model that every rank "
    "holds whole or sharded (DDP, FSDP, HSDP, DeepSpeed ZeRO, tensor parallelism)"
)


def refuse_pipeline_stage(model: nn.Module) -> None:
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


def refuse_pipeline_call() -> None:
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
