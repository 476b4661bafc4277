"""Tensor parallelism (``torch.distributed.tensor.parallel``, alone or with FSDP2/HSDP on a 2-D
or 3-D DeviceMesh): what the probe reads under it, and what it refuses by name.

Parameter statistics are the whole tensors' (each rank's shard counted once,
`normprobe.probes.shard_share`). Where every parallelized module hands back a local tensor whole
on each rank of its group (``ColwiseParallel`` inside a block, ``RowwiseParallel`` replicated)
the activations read are the ones one process reads; under sequence parallelism each rank reads
its part of the sequence (a DTensor's local part), and RMS, cosines, maxima and sums over equal
parts combine across ranks as over the whole. The heads ``ColwiseParallel`` splits over the
ranks of its mesh are put in their places in each per-head vector (`head_splits`). Per-channel
outlier statistics under sequence parallelism, activations split otherwise (DTensors made by
hand), heads split by something else and a split output head are refused by name.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from ..common import is_writer

# each value is a head's: wrong where heads are split in a way the probe does not follow
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
    *HEAD_FAMILIES,
)
SUPPORTED = (
    "normprobe supports tensor parallelism by parallelize_module with ColwiseParallel, "
    "RowwiseParallel and SequenceParallel (outliers: without sequence parallelism), alone or "
    "with FSDP2/HSDP over the data-parallel mesh dimensions"
)
_STYLES = "torch.distributed.tensor.parallel"


class Style(NamedTuple):
    """A parallel style ``parallelize_module`` applied to a module, found in its hooks."""

    name: str  # ColwiseParallel, RowwiseParallel, SequenceParallel...
    # its output on each rank: "whole" (replicated, or ColwiseParallel's feature shard inside a
    # block), "sequence" (split along a dimension but the last: sequence parallelism), "other"
    output: str
    replicated: bool  # that output is the module's whole output (not a column shard)
    mesh: Any  # the DeviceMesh it splits over


def _styles(model: nn.Module) -> dict[str, Style]:
    """Per module path, the parallel style applied to it (none when no style was imported)."""
    if _STYLES not in sys.modules:
        return {}
    found: dict[str, Style] = {}
    for path, module in model.named_modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        for hook in hooks:
            cells = _cells(hook)
            mesh = next((c for c in cells if type(c).__name__ == "DeviceMesh"), None)
            for fn in cells:
                func: Any = getattr(fn, "func", None)
                if not str(getattr(func, "__module__", "")).startswith("torch.distributed.tensor"):
                    continue
                name = func.__qualname__.partition(".")[0]
                style = found.get(path, Style(name, "whole", False, mesh))
                if func.__name__ == "_prepare_output_fn":
                    style = _with_output(style, fn.args)
                found[path] = style
    return found


def _cells(hook: Any) -> list[Any]:
    """What a hook's closure holds (parallelize_module's hooks: its style's functions and mesh)."""
    held = []
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return held


def _with_output(style: Style, args: tuple[Any, ...]) -> Style:
    """``style`` as its output function (its partial's ``args``: SequenceParallel's whether a
    local tensor is handed back; ColwiseParallel's and RowwiseParallel's output layouts before
    that) leaves its output (`Style.output`)."""
    if style.name == "SequenceParallel":
        return style._replace(output="sequence")
    if style.name not in ("ColwiseParallel", "RowwiseParallel") or len(args) != 2:
        return style._replace(output="other")
    layout = args[0][0] if isinstance(args[0], tuple | list) else args[0]
    if layout.is_replicate():
        return style._replace(output="whole", replicated=True)
    last = layout.is_shard() and layout.dim == -1  # features: a block's inner activations
    return style._replace(output="whole" if last else "sequence")


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
    plain_shard = type(placements[-1]).__name__ == "Shard"
    return plain_shard and all(p.is_replicate() for p in placements[:-1]) and len(placements) <= 2


def layout(model: nn.Module) -> str | None:
    """``model``'s tensor-parallel layout in words (its first parameter laid out past data
    parallelism), or None when there is none."""
    fsdp = _fsdp_held(model)
    for name, p in _dtensor_params(model):
        if not (id(p) in fsdp and _data_parallel(tuple(p.placements))):
            return f"tensor parallelism ({name}: {tuple(p.placements)})"
    return None


def refused_at_attach(model: nn.Module, found: str) -> dict[str, str]:
    """The families ``model``'s tensor-parallel layout (``found``, `layout`) keeps from being
    read, each with the reason: those of activations, unless they are whole on every rank."""
    styles = _styles(model)
    if not styles:
        why = "no parallelize_module style found: activations may be sharded"
        return dict.fromkeys(ACTIVATION_FAMILIES, f"{found}: {why}")
    for kind in ("other", "sequence"):
        split = sorted(path for path, style in styles.items() if style.output == kind)
        if not split:
            continue
        where = f"{split[0]}: {styles[split[0]].name}"
        if kind == "other":
            why = f"{found}: activations split across ranks in a way normprobe does not follow"
            return dict.fromkeys(ACTIVATION_FAMILIES, f"{why} ({where})")
        why = (
            f"{found} with sequence parallelism ({where}): each rank holds part of the "
            "sequence, and per-channel statistics over tokens do not add up across ranks"
        )
        return {"outliers": why}
    return {}


def refused_at_install(
    model: nn.Module, found: str, head: str | None, attention: Sequence[str]
) -> dict[str, str]:
    """The families a mapped model's layout keeps from being read: ``logits`` when the output
    ``head`` is parallelized (its logits split over the vocabulary), the per-head families when
    an attention module is parallelized without ColwiseParallel splitting its heads."""
    styles = _styles(model)
    refused = {}
    if head is not None and head in styles and not styles[head].replicated:
        refused["logits"] = (
            f"{found}: the output head ({head}) is {styles[head].name}, its logits split"
        )
    splits = head_splits(model, attention)
    for path in attention:
        inside = any(p == path or p.startswith(f"{path}.") for p in styles)
        if inside and path not in splits:
            why = f"{found}: {path}'s heads are not split by ColwiseParallel"
            refused |= dict.fromkeys(HEAD_FAMILIES, why)
    return refused


def head_splits(model: nn.Module, attention: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per attention module whose query heads ColwiseParallel splits evenly: (ranks of its
    mesh, this rank's place); each rank computes a contiguous run of the heads."""
    splits = {}
    for path, style in _styles(model).items():
        owner = next((a for a in attention if path.startswith(f"{a}.")), None)
        if owner is not None and style.name == "ColwiseParallel" and style.mesh is not None:
            splits[owner] = (style.mesh.size(), style.mesh.get_local_rank())
    return splits


def checked(
    model: nn.Module,
    metrics: tuple[str, ...],
    explicit: bool,
    refused: dict[str, str],
    supported: str = SUPPORTED,
) -> tuple[str, ...]:
    """``metrics`` less the ``refused`` ones: a ValueError naming them when the user chose
    them (``explicit``), else a warning; ``supported``: what the layout supports."""
    dropped = {m: why for m, why in refused.items() if m in metrics}
    if not dropped:
        return metrics
    lines = "; ".join(f"{m} ({why})" for m, why in dropped.items())
    text = (
        f"normprobe cannot read {', '.join(dropped)} on {type(model).__name__}: {lines}. "
        f"{supported}; leave them out of metrics=[...]"
    )
    if explicit:
        raise ValueError(text)
    if is_writer():
        warnings.warn(text, RuntimeWarning, stacklevel=5)  # attach's caller, via Probe._chosen
    return tuple(m for m in metrics if m not in dropped)
