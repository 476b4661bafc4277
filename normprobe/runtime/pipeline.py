"""Pipeline parallelism: a stage of ``torch.distributed.pipelining`` handed to ``attach`` as
``pipeline=``, the layouts refused, and each stage's place in its stacks.

A stage probes its own blocks under their global numbers: at attach, one collective over the
stage's group tells each stage how many blocks of each stack the stages before it hold. A
stage's module found without ``pipeline=`` is refused: at attach (the module of a
``PipelineStage``), on the first forward (run by a pipelining schedule), and where
``torch.distributed.pipelining`` is imported, at the first logged step by one collective
comparing the modules every rank probes.
"""

from __future__ import annotations

import gc
import sys
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

from ..common import world_size
from ..discovery import ModelMap

PIPELINING = "torch.distributed.pipelining"
PASS_STAGE = (
    "normprobe probes a pipeline stage when attach() is given it: "
    "attach(stage_module, opt, pipeline=stage, example_inputs=(stage_input,))"
)
SUPPORTED = (
    "normprobe reads the other families on each stage's micro-batches under pipeline "
    "parallelism (one stage a rank, no data parallelism)"
)
# the families whose values of a stage's micro-batches do not combine into the whole batch's
REFUSED = {
    "outliers": "a micro-batch's largest channel and kurtosis do not combine into the batch's",
    "bn_stats": "a micro-batch's variance does not combine into the batch's",
    "nonfinite": "the first module in execution order spans the stages' schedules",
}


@dataclass(frozen=True)
class Stage:
    """This rank's stage: its index, the stages' count, their process group, and per stack
    (by path) the global number of its first block and the stack's depth over every stage."""

    index: int
    count: int
    group: Any
    device: torch.device
    blocks: Mapping[str, tuple[int, int]]


def held(plan: Any, stage: Stage) -> dict[str, tuple[int, bool]]:
    """Per stack (as tags name it): the global number of this stage's first block, and whether
    every forward of the step handed the stack's last stream on as its output."""
    streams = plan.made("streams")
    handed = {} if streams is None else streams.hands_on
    return {
        plan.stack_name(path): (first, handed.get(path, False))
        for path, (first, _) in stage.blocks.items()
    }


def checked(model: nn.Module, pipeline: Any, persistent_hooks: bool) -> None:
    """Refuse a stage's module attached without its stage (``pipeline`` None), else a layout
    that cannot be combined (`stage_of`)."""
    if pipeline is None:
        refuse_stage(model)
    elif persistent_hooks:
        raise ValueError(
            "normprobe cannot keep persistent hooks (a compiled model's) on a pipeline stage: "
            "each micro-batch's values are taken at its forward's end; attach without them"
        )
    else:
        stage_of(model, pipeline)


def stage_of(model: nn.Module, pipeline: Any) -> None:
    """Check that ``pipeline`` is a ``torch.distributed.pipelining`` stage that holds ``model``
    and is the only stage of its rank, in a world of stages only; a RuntimeError naming the
    layout refused otherwise."""
    refuse_deepspeed(model)
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None or not isinstance(pipeline, base):
        raise TypeError(
            "pipeline= takes the torch.distributed.pipelining stage (PipelineStage) that runs "
            f"the model, got {type(pipeline).__qualname__}"
        )
    if pipeline.submod is not model:
        raise ValueError(
            f"pipeline= is the stage of a {type(pipeline.submod).__name__}, not of the "
            f"{type(model).__name__} given to attach(): attach the stage's own module"
        )
    if pipeline.group_size != pipeline.num_stages:
        raise RuntimeError(
            f"normprobe cannot probe {pipeline.num_stages} stages on {pipeline.group_size} "
            "ranks (an interleaved or looped schedule): each rank must hold one stage"
        )
    if world_size() != pipeline.group_size:
        raise RuntimeError(
            f"normprobe cannot combine pipeline parallelism ({pipeline.group_size} stages) with "
            f"data parallelism ({world_size()} ranks): ranks would be combined both as stages "
            "and as copies; probe one pipeline (its stages in the default process group)"
        )


def numbered(model_map: ModelMap, pipeline: Any) -> Stage:
    """This stage's place in each stack: one collective over the stages' group, at attach."""
    import torch.distributed as dist

    mine = (pipeline.stage_index, [(s.path, s.depth) for s in model_map.stacks])
    every: list[Any] = [None] * pipeline.group_size
    dist.all_gather_object(every, mine, group=pipeline.group)
    every.sort(key=lambda stage: stage[0])
    paths = [[path for path, _ in stacks] for _, stacks in every]
    if any(p != paths[0] for p in paths) or not paths[0]:
        found = "; ".join(
            f"stage {i}: {', '.join(f'{p} ({d} blocks)' for p, d in s) or 'no stack'}"
            for i, s in every
        )
        raise RuntimeError(
            "normprobe numbers a stack's blocks across pipeline stages when every stage holds "
            f"part of the same stacks (at least 2 blocks of each), and found {found}"
        )
    blocks = {}
    for k, (path, _) in enumerate(every[0][1]):
        depths = [stacks[k][1] for _, stacks in every]
        blocks[path] = (sum(depths[: pipeline.stage_index]), sum(depths))
    device = torch.device(pipeline.device)
    return Stage(pipeline.stage_index, pipeline.num_stages, pipeline.group, device, blocks)


def refuse_deepspeed(model: nn.Module) -> None:
    """Raise a RuntimeError when ``model`` is a DeepSpeed ``PipelineModule``."""
    deepspeed = sys.modules.get("deepspeed.runtime.pipe.module")
    kind = getattr(deepspeed, "PipelineModule", None)
    if kind is not None and isinstance(model, kind):
        raise RuntimeError(
            f"normprobe does not support DeepSpeed's pipeline parallelism: "
            f"{type(model).__name__} is a PipelineModule, whose engine runs the micro-batches "
            "of a step inside train_batch() and holds the stages' process groups; run the "
            "stages with torch.distributed.pipelining and attach(..., pipeline=stage)"
        )


def refuse_stage(model: nn.Module) -> None:
    """Raise a RuntimeError when ``model`` is the module of a ``torch.distributed.pipelining``
    stage not handed to attach (or a DeepSpeed ``PipelineModule``)."""
    refuse_deepspeed(model)
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:  # not imported: no stage exists
        return
    for holder in _holders(model):
        if isinstance(holder, base):
            raise RuntimeError(
                f"{type(model).__name__} is the module of a torch.distributed.pipelining "
                f"{type(holder).__name__}: {PASS_STAGE}"
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
            raise RuntimeError(f"the model runs in a pipelining schedule: {PASS_STAGE}")
        frame = frame.f_back  # type: ignore[assignment]


def inferring() -> bool:
    """Whether the running forward is the one a pipelining stage runs on its first step to find
    its output's shapes (on an empty tensor after the first stage): not a micro-batch."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference":
            return frame.f_globals.get("__name__", "").startswith(PIPELINING)
        frame = frame.f_back
    return False


def micro_batch_size(args: tuple[Any, ...]) -> float:
    """A stage's micro-batch by its size: the elements of its first input tensor."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return 1.0 if first is None else float(first.numel())


def same_blocks_everywhere(names: Sequence[str], device: torch.device) -> None:
    """Raise a RuntimeError on every rank unless all ranks probe the same blocks (``names``):
    one collective, at the first logged step, where ``torch.distributed.pipelining`` is in use
    and no stage was handed to attach."""
    import torch.distributed as dist

    crc = zlib.crc32("\n".join(names).encode())
    mine = torch.tensor([len(names), crc >> 16, crc & 0xFFFF], device=device).float()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if any(not torch.equal(other, mine) for other in every):
        raise RuntimeError(
            f"the ranks probe different blocks, as pipeline stages would: {PASS_STAGE}"
        )
