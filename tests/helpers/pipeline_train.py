"""Pipeline-parallel training on CPU (gloo) with NormProbe, run by
tests/adapters/test_pipeline.py.

    python tests/helpers/pipeline_train.py OUT_DIR RANK PORT   # ranks 0 and 1

Ranks 0 and 1 are the 2 stages of `parallel_train.Net` (2 blocks each, the embedding on the
first, the norm and head on the last) run by ``torch.distributed.pipelining`` with GPipe (the
blocks in a sliced ``ModuleList``), then 1F1B (in a ``ModuleDict`` under their global keys), 2
micro-batches; rank 0 then trains the whole model in one process on the same weights
and batches. Each rank writes rank<r>.json: the records, the collectives normprobe issued in
each step, the hooks before attach and after removal, and the errors of the layouts refused.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from parallel_train import (
    BATCH,
    EVERY,
    METRICS,
    SEQ,
    WIDTH,
    Collectives,
    Net,
    batches,
    error_of,
    hooks,
    loss_of,
    model,
    recorded_steps,
    stages,
    train,
)
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import normprobe
from normprobe.runtime.pipeline import REFUSED
from normprobe.runtime.pipeline_records import Exchange

PIPELINE_METRICS = [m for m in METRICS if m not in REFUSED]
CPU = torch.device("cpu")


class KeyedNet(Net):
    """`Net` whose stage keeps its blocks in a ``ModuleDict`` under their global numbers (as
    torchtitan splits its models)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def keyed(rank: int) -> Net:
    """Rank ``rank``'s stage of `KeyedNet`: blocks "0", "1" on the first, "2", "3" on the last."""
    torch.manual_seed(0)
    net = KeyedNet()  # the weights of `model`
    kept = range(2 * rank, 2 * rank + 2)
    net.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(net.blocks) if i in kept})  # type: ignore[assignment]
    if rank == 0:
        net.norm = net.head = None
    else:
        net.emb = None
    return net


def example(rank: int) -> tuple[torch.Tensor]:
    """A micro-batch of the stage's input: token ids on the first, the stream on the last."""
    if rank == 0:
        return (batches()[0][: BATCH // 2],)
    return (torch.zeros(BATCH // 2, SEQ, WIDTH),)


def train_stage(rank: int, schedule: Any, log_dir: Path, split: Any = stages) -> dict[str, Any]:
    """Rank ``rank``'s stage (made by ``split``) trained by ``schedule`` on the batches of
    `train`."""
    net = split(rank)
    stage = PipelineStage(net, rank, 2, CPU)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    seen: dict[str, Any] = {"hooks": hooks(net)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = normprobe.attach(
            net,
            opt,
            log_dir=str(log_dir),
            sinks=[normprobe.MemorySink()],
            every=EVERY,
            metrics=PIPELINE_METRICS,
            example_inputs=example(rank),
            pipeline=stage,
        )
    seen["warnings"] = [str(w.message) for w in caught if "normprobe" in str(w.message)]
    run = schedule(stage, 2, loss_fn=loss_of)

    def backward(batch: torch.Tensor) -> None:  # the schedule's forwards and backwards
        if rank == 0:
            run.step(batch)
        else:
            run.step(target=batch)

    return recorded_steps(net, opt, probe, backward, seen)


def refusals(rank: int) -> dict[str, Any]:
    """The layouts attach refuses, and a stage's module attached without ``pipeline=``."""
    seen: dict[str, Any] = {}
    net = stages(rank)
    stage = PipelineStage(net, rank, 2, CPU)
    seen["stage"] = error_of(lambda: normprobe.attach(net, metrics=["grad_norm"]))
    seen["no_inputs"] = error_of(lambda: normprobe.attach(net, pipeline=stage))
    seen["outliers"] = error_of(
        lambda: normprobe.attach(
            net, metrics=["outliers"], example_inputs=example(rank), pipeline=stage
        )
    )
    looped = PipelineStage(net, rank, 4, CPU)  # 4 stages on 2 ranks
    seen["looped"] = error_of(
        lambda: normprobe.attach(net, example_inputs=example(rank), pipeline=looped)
    )
    # 3 blocks and 1: the last stage holds no stack
    uneven = stages(rank)
    uneven.blocks = nn.ModuleList(model().blocks[:3] if rank == 0 else model().blocks[3:])
    lone = PipelineStage(uneven, rank, 2, CPU)
    seen["uneven"] = error_of(
        lambda: normprobe.attach(uneven, example_inputs=example(rank), pipeline=lone)
    )
    # a stage per rank, each in a group of its own: pipelines side by side, data parallel
    groups = [dist.new_group([0]), dist.new_group([1])]
    alone = PipelineStage(net, 0, 1, CPU, group=groups[rank])
    seen["data_parallel"] = error_of(
        lambda: normprobe.attach(net, example_inputs=example(rank), pipeline=alone)
    )
    # stages run by hand: the ranks probe different blocks, found at the first logged step
    net = stages(rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    probe = normprobe.attach(net, opt, metrics=["grad_norm"], sinks=[normprobe.MemorySink()])

    def step() -> None:
        net(*example(rank)).float().pow(2).mean().backward()
        opt.step()

    seen["blocks"] = error_of(step)
    probe.remove()
    return seen


def exchange(rank: int) -> dict[str, Any]:
    """Records larger than the stages' buffer: the collectives, the buffer, what came back."""
    swap = Exchange(None, CPU)
    swap.capacity = 8
    counter = Collectives()
    with counter:
        got = swap(b"x" * (20 + rank))
    return {"sizes": [len(g) for g in got], "capacity": swap.capacity, "calls": counter.collectives}


def main() -> None:
    out, rank, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seen = {
        "gpipe": train_stage(rank, ScheduleGPipe, out / f"gpipe{rank}"),
        "1f1b": train_stage(rank, Schedule1F1B, out / f"1f1b{rank}", split=keyed),
    }
    seen |= refusals(rank)
    seen["exchange"] = exchange(rank)
    dist.destroy_process_group()
    if rank == 0:
        seen["single"] = train(model(), PIPELINE_METRICS)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
