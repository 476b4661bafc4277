"""Tensor-parallel training on CPU (gloo) with NormProbe, run by
tests/adapters/test_parallel.py.

    python tests/helpers/parallel_train.py OUT_DIR RANK PORT   # ranks 0..3

Ranks 0..3 first train `Net` with tensor parallelism on a 2x2 mesh (``dp`` x ``tp``:
``ColwiseParallel`` on q, k, v and the first MLP layer, ``RowwiseParallel`` on the output and
the second MLP layer, ``fully_shard`` over ``dp``). Each rank writes rank<r>.json: what
``attach`` and the first steps did under each layout (the record written, or the error
raised), and the collectives normprobe issued. `stages` splits `Net` into the 2 stages of a
pipeline (tests/helpers/pipeline_train.py).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normprobe

WIDTH, HEADS, DEPTH, VOCAB, SEQ, BATCH, STEPS, EVERY = 32, 4, 4, 64, 8, 4, 3, 2
METRICS = [*normprobe.metrics.DEFAULTS, "attn_entropy"]  # every per-head family


class Attention(nn.Module):
    """Causal attention with separate q, k, v projections; heads from the local width (a
    tensor-parallel rank holds some of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class Net(nn.Module):
    """Embedding, ``DEPTH`` blocks, norm and head; a pipeline stage keeps some of them (the
    others None, as torchtitan splits its models)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm: nn.Module | None = nn.LayerNorm(WIDTH)
        self.head: nn.Module | None = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def model() -> Net:
    torch.manual_seed(0)
    return Net()


class Collectives(TorchDispatchMode):
    """Counts the collectives normprobe's code issues: those whose caller (the first frame
    outside torch) is normprobe's, but for the model's own ops (tensor parallelism's
    all-reduces, FSDP's all-gathers) that its torch function modes pass on."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        issued = func.namespace in ("c10d", "_c10d_functional") and "wait" not in str(func)
        if issued and _from_normprobe():
            self.collectives += 1
        return func(*args, **(kwargs or {}))


def _from_normprobe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if not frame.f_globals.get("__name__", "").startswith(("torch", "contextlib", "functools")):
            own = frame.f_code.co_name != "__torch_function__"
            return own and frame.f_globals.get("__name__", "").startswith("normprobe")
        frame = frame.f_back  # type: ignore[assignment]
    return False


def values(probe: normprobe.Probe) -> dict[str, Any]:
    assert probe.latest is not None
    return {"scalars": dict(probe.latest.scalars), "profiles": dict(probe.latest.profiles)}


def train(net: nn.Module, metrics: list[str] | None) -> dict[str, Any]:
    """``STEPS`` steps of ``net`` on the whole batch: each logged step's record and the
    collectives normprobe issued in each step, the warnings of attach, and the hooks on
    ``net`` before attach and after ``remove``."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    seen: dict[str, Any] = {"hooks": hooks(net)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = normprobe.attach(
            net,
            opt,
            sinks=[normprobe.MemorySink()],
            every=EVERY,
            metrics=metrics,
            example_inputs=(batches()[0],),  # mapped here: no step pays for it
        )
    seen["warnings"] = [str(w.message) for w in caught if "normprobe cannot" in str(w.message)]
    seen["metrics"] = list(probe.metrics)
    return recorded_steps(
        net, opt, probe, lambda batch: loss_of(net(batch), batch).backward(), seen
    )


def recorded_steps(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    probe: normprobe.Probe,
    backward: Callable[[torch.Tensor], Any],
    seen: dict[str, Any],
) -> dict[str, Any]:
    """``backward`` and an optimizer step on each of `batches`: into ``seen``, the collectives
    normprobe issued in each step, each logged step's record, and the hooks left on ``net``
    after ``probe`` is removed."""
    counter, seen["collectives"] = Collectives(), []
    for step, batch in enumerate(batches()):
        counter.collectives = 0
        with counter:
            backward(batch)
            opt.step()
        seen["collectives"].append(counter.collectives)
        opt.zero_grad()
        if step % EVERY == 0:
            seen[str(step)] = values(probe)
    probe.remove()
    seen["hooks_left"] = hooks(net)
    return seen


def hooks(net: nn.Module) -> int:
    """The module hooks on ``net`` (FSDP's and tensor parallelism's among them)."""
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        for m in net.modules()
    )


def error_of(call: Any, warned: bool = False) -> str:
    """What ``call()`` raised (``warned``: the normprobe warning it gave), or "none"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except (ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
    said = [str(w.message) for w in caught if str(w.message).startswith("normprobe cannot")]
    return f"RuntimeWarning: {said[0]}" if warned and said else "none"


def tp_plan(sequence: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence:
        col, row = ColwiseParallel, RowwiseParallel
        return {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.out": row(),
                "fc1": col(), "fc2": row()}  # fmt: skip
    return {
        "ln_1": SequenceParallel(),
        "ln_2": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def OUTER_SEQUENCE_PLAN() -> dict[str, Any]:
    """Outside the blocks, under sequence parallelism: the embedding's output split along the
    sequence, the final norm on its part, the head's logits whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def tensor_parallel(sequence: bool, head: bool = False) -> nn.Module:
    """`Net` on a 2x2 mesh: tensor parallel over ``tp`` (with sequence parallelism or
    not; ``head``: the output head too, its logits split), ``fully_shard`` over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = model()
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], tp_plan(sequence))
        fully_shard(block, mesh=mesh["dp"])
    if head:
        parallelize_module(net, mesh["tp"], {"head": ColwiseParallel()})
    if sequence:
        parallelize_module(net, mesh["tp"], OUTER_SEQUENCE_PLAN())
    fully_shard(net, mesh=mesh["dp"])
    return net


def tensor_parallel_checks() -> dict[str, Any]:
    """Every rank trains the same batch: what data parallelism averages is the same on both
    dp ranks, and the values are the single process's."""
    seen = {"tp": train(tensor_parallel(False), METRICS)}
    head = tensor_parallel(False, head=True)
    example = (batches()[0],)
    seen["head"] = error_of(
        lambda: normprobe.attach(head, metrics=["grad_norm", "logits"], example_inputs=example)
    )
    sequence = tensor_parallel(True)
    seen["sp"] = train(sequence, [m for m in METRICS if m != "outliers"])
    seen["sp_defaults"] = error_of(lambda: normprobe.attach(sequence).remove(), warned=True)
    seen["sp_outliers"] = error_of(lambda: normprobe.attach(sequence, metrics=["outliers"]))
    return seen


def stages(rank: int) -> Net:
    """Rank ``rank``'s stage of a 2-stage split of `Net`: two blocks each, the embedding on
    the first, the norm and head on the last."""
    net = model()
    if rank == 0:
        net.blocks = nn.ModuleList(net.blocks[:2])
        net.norm = net.head = None
    else:
        net.blocks = nn.ModuleList(net.blocks[2:])
        net.emb = None
    return net


def main() -> None:
    out, rank, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    seen = tensor_parallel_checks()
    dist.destroy_process_group()
    if rank == 0:
        seen["single"] = train(model(), METRICS)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
