"""Two-process sharded training on CPU (gloo) with NormProbe, run by tests/adapters/test_fsdp.py.

    python tests/helpers/fsdp_train.py fsdp2 OUT_DIR            # Lightning: OUT_DIR/fsdp2
    python tests/helpers/fsdp_train.py plain OUT_DIR RANK PORT  # each rank: OUT_DIR/fsdp1, hsdp

fsdp2: Lightning starts the second rank by running this script again; ``configure_model`` shards
every block and the model with ``fully_shard`` (parameters and gradients become DTensors).
plain: two processes (ranks 0 and 1) train twice: with every block and the model wrapped in
torch's FSDP1 (``use_orig_params``, as Lightning's FSDPStrategy, which runs on GPUs only, sets
it up), then with ``fully_shard`` on a 2-D mesh (HSDP) that replicates every parameter.

Each rank writes rank<r>.json: the whole (unsharded) gradient norm, update ratio and norm gain
of every block, computed here from gathered tensors, and the collectives that normprobe issued
on each step (counted under a dispatch mode, implicit DTensor ones included).
"""

from __future__ import annotations

import json
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normprobe
from normprobe.models import Block

STEPS, EVERY, WIDTH, DEPTH = 4, 2, 32, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, 4) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 96)
        for m in self.modules():  # gains away from 1, so that their spread is measured
            if isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, 0.2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


class Collectives(TorchDispatchMode):
    """Counts collectives whose caller (the first frame outside torch) is normprobe's code, and
    DTensor operations normprobe runs (each may redistribute: an implicit collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0
        self.dtensor_ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        issued = func.namespace in ("c10d", "_c10d_functional") and "wait" not in name
        if (issued or any(t.__name__ == "DTensor" for t in types)) and _from_normprobe():
            if issued:
                self.collectives += 1
            else:
                self.dtensor_ops.append(name)
        return func(*args, **(kwargs or {}))


def _from_normprobe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("torch", "contextlib", "functools")):
            return module.startswith("normprobe") and not module.startswith("normprobe.models")
        frame = frame.f_back
    return False


class Witness:
    """This rank's view of the whole tensors, and normprobe's collectives, step by step.

    The witness gathers whole tensors itself (``full``), with the counting paused.
    """

    def __init__(self, net: nn.Module, full: Any = lambda t: t) -> None:
        self.net = net
        self.full = full
        self.seen: dict[str, Any] = {
            "grads": {}, "updates": {}, "gains": {}, "collectives": {}, "dtensor_ops": [],
        }  # fmt: skip
        self.mode = Collectives()

    def start(self) -> None:
        self.mode.collectives = 0
        self.mode.__enter__()

    def pause(self) -> None:
        self.mode.__exit__(None, None, None)

    def resume(self) -> None:
        self.mode.__enter__()

    def stop(self, step: int) -> None:
        self.pause()
        self.seen["collectives"][step] = self.mode.collectives
        self.seen["dtensor_ops"] += self.mode.dtensor_ops
        self.mode.dtensor_ops = []

    def before_optimizer(self, step: int) -> None:
        blocks = self.net.blocks
        self.seen["grads"][step] = [
            float(torch.cat([self.full(p.grad).flatten() for p in b.parameters()]).norm())
            for b in blocks
        ]
        self.before = [[self.full(p).detach().double() for p in b.parameters()] for b in blocks]
        gains = [self.full(b.ln_1.weight).detach().double() for b in blocks]
        self.seen["gains"][step] = [[float(g.mean()), float(g.std(unbiased=False))] for g in gains]

    def after_optimizer(self, step: int) -> None:
        ratios = []
        for b, old in zip(self.net.blocks, self.before, strict=True):
            new = [self.full(p).detach().double() for p in b.parameters()]
            change = sum(float((n - o).pow(2).sum()) for n, o in zip(new, old, strict=True))
            ratios.append(math.sqrt(change / sum(float(o.pow(2).sum()) for o in old)))
        self.seen["updates"][step] = ratios

    def write(self, out: Path, rank: int, probe: Any, sinks: int, sharded: list[int]) -> None:
        first = next(self.net.blocks[0].parameters())
        placements = [str(p) for p in getattr(first, "placements", ())]
        self.seen.update(
            tags=sorted(probe.latest.scalars), sinks=sinks, sharded=sharded, placements=placements
        )
        (out / f"rank{rank}.json").write_text(json.dumps(self.seen))


def _local_numel(p: torch.Tensor) -> int:
    return int(p.to_local().numel()) if hasattr(p, "to_local") else p.numel()


# --- fsdp2: Lightning's ModelParallelStrategy ------------------------------------------------


def run_fsdp2(out: Path) -> None:
    out.mkdir(exist_ok=True)
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.example_input_array = torch.randint(0, 96, (2, 16))  # mapped before step 0

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.net(idx)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return loss_of(self(batch), batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Witnessing(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.witness = Witness(pl_module.net, lambda t: t.full_tensor())

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.witness.start()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, opt: Any) -> None:
            self.witness.pause()  # after NormProbe's own on_before_optimizer_step
            self.witness.before_optimizer(trainer.global_step)
            self.witness.resume()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.witness.stop(trainer.global_step - 1)
            self.witness.after_optimizer(trainer.global_step - 1)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            probe = next(c for c in trainer.callbacks if isinstance(c, normprobe.NormProbe))
            params = list(pl_module.net.blocks[0].parameters())
            sharded = [sum(_local_numel(p) for p in params), sum(p.numel() for p in params)]
            assert probe.probe is not None
            self.witness.write(out, trainer.global_rank, probe, len(probe.probe.sinks), sharded)

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        logger=TensorBoardLogger(str(out), name="tb", version=0),
        callbacks=[normprobe.NormProbe(), Witnessing()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(torch.randint(0, 96, (8 * STEPS, 16)), batch_size=4)  # type: ignore[arg-type]
    trainer.fit(LM(), data)


# --- fsdp1 and hsdp: torch's own sharding with the plain API ----------------------------------


def train(rank: int, out: Path, model: nn.Module, net: Net, witness: Witness, whole: Any) -> None:
    """Four steps of ``model`` (``net`` sharded); the witness reads inside ``whole()``."""
    out.mkdir(exist_ok=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    probe = normprobe.attach(  # the plain API: rank 0 alone opens an event file
        model,
        opt,
        log_dir=str(out / f"tb{rank}"),
        every=EVERY,
        example_inputs=(torch.randint(0, 96, (2, 16)),),
    )
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        batch = torch.randint(0, 96, (4, 16), generator=gen)
        witness.start()
        loss_of(model(batch), batch).backward()
        witness.pause()
        with whole():
            witness.before_optimizer(step)
        witness.resume()
        opt.step()
        witness.stop(step)
        with whole():
            witness.after_optimizer(step)
        opt.zero_grad()
    params = list(net.blocks[0].parameters())
    local = sum(_local_numel(p) for p in params)
    with whole():
        sharded = [local, sum(p.numel() for p in params)]
    witness.write(out, rank, probe, len(probe.sinks), sharded)
    probe.remove()


def plain_rank(rank: int, root: Path, port: int) -> None:
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # FSDP1, as Lightning's FSDPStrategy sets it up: the witness gathers with summon_full_params
    torch.manual_seed(0)
    net = Net()
    policy = ModuleWrapPolicy({Block})
    model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
    whole = partial(FSDP.summon_full_params, model, with_grads=True)
    train(rank, root / "fsdp1", model, net, Witness(net), whole)
    # HSDP: fully_shard on a 2-D mesh, replicated across the 2 ranks (one shard each): each
    # rank holds whole DTensors, which must count once
    torch.manual_seed(0)
    net = Net()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    witness = Witness(net, lambda t: t.full_tensor())
    train(rank, root / "hsdp", net, net, witness, nullcontext)
    dist.destroy_process_group()


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "fsdp2":
        run_fsdp2(root / "fsdp2")
    else:
        plain_rank(int(sys.argv[3]), root, int(sys.argv[4]))


if __name__ == "__main__":
    main()
