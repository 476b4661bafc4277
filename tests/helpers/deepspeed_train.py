"""Two-process DeepSpeed training on CPU (gloo) with NormProbe, run by
tests/adapters/test_deepspeed.py.

    python tests/helpers/deepspeed_train.py OUT_DIR RANK PORT

Each rank trains the same TinyTransformer (same seed, same batches) four times: with ZeRO
stages 0 to 3, each with two micro-batches per step and ``gradient_clipping`` far below the
gradients' norm. Each carries a probe (``attach(engine.module, engine.optimizer)``); stage 0's
witness is the reference. The witness reads the whole tensors with
DeepSpeed's own accessors (``safe_get_full_grad``: before the step, before any clipping) and
counts the collectives normprobe issues on each step. Each rank writes rank<r>.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from torch import nn

import normprobe
from normprobe import MemorySink, tags
from normprobe.models import TinyTransformer
from normprobe.runtime import ProbeHook

STEPS, EVERY, ACCUMULATE, CLIP, DEPTH = 3, 2, 2, 0.05, 4
METRICS = ["grad_norm", "weight_rms", "update_ratio", "norm_gain", "resid_rms"]


class Collectives:
    """Counts the collectives normprobe issues: calls of ``torch.distributed``'s collectives
    whose nearest normprobe frame is neither the wrapper of the ZeRO optimizer's step (under
    which DeepSpeed's own step runs) nor the model's forward (under which ZeRO-3 gathers the
    parameters). Installed before DeepSpeed keeps references to them."""

    NAMES = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
        "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "gather", "scatter",
    )  # fmt: skip

    def __init__(self) -> None:
        self.count = 0
        for name in self.NAMES:
            setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, collective: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("normprobe"):
                    wrapper = module == "normprobe.runtime.zero" and frame.f_code.co_name == "step"
                    self.count += not wrapper and not module.startswith("normprobe.models")
                    break
                frame = frame.f_back
            return collective(*args, **kwargs)

        return counted


def full_param(p: nn.Parameter) -> torch.Tensor:
    held = safe_get_full_fp32_param(p)
    return (p if held is None else held).detach().double()


def witness(seen: dict[str, Any], step: int, net: nn.Module) -> list[list[torch.Tensor]]:
    """Record the whole gradients (before the step clips them), weights and gains of every
    block; the weights before the step, for the update ratio."""
    grads = [
        torch.cat([safe_get_full_grad(p).flatten() for p in b.parameters()]).double()
        for b in net.blocks
    ]
    seen["grads"][step] = [float(g.norm()) for g in grads]
    seen["totals"][step] = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    before = [[full_param(p) for p in b.parameters()] for b in net.blocks]
    seen["weights"][step] = [
        math.sqrt(sum(float(w.pow(2).sum()) for w in ws) / sum(w.numel() for w in ws))
        for ws in before
    ]
    gains = [full_param(b.ln_1.weight) for b in net.blocks]
    seen["gains"][step] = [[float(g.mean()), float(g.std(unbiased=False))] for g in gains]
    return before


def train(stage: int, rank: int, counter: Collectives) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyTransformer(depth=DEPTH, width=32, context=16)
    for m in model.modules():  # gains away from 1, so that their spread is measured
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ACCUMULATE,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    net = engine.module
    sink = MemorySink()
    example = (torch.zeros(2, 16, dtype=torch.long),)  # mapped now, not in a counted step
    probe = normprobe.attach(
        net, engine.optimizer, sinks=[sink], every=EVERY, metrics=METRICS,
        example_inputs=example,
    )  # fmt: skip
    seen: dict[str, Any] = {"grads": {}, "weights": {}, "updates": {}, "gains": {}}
    seen.update(collectives={}, totals={}, logged={})
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        counter.count = 0
        for _ in range(ACCUMULATE):
            batch = torch.randint(0, 96, (2, 16), generator=gen)
            loss = nn.functional.cross_entropy(engine(batch).flatten(0, 1), batch.flatten())
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():  # the step below updates
                before = witness(seen, step, net)
            engine.step()
        seen["collectives"][step] = counter.count
        seen["updates"][step] = [
            math.sqrt(
                sum(
                    float((full_param(p) - o).pow(2).sum())
                    for p, o in zip(b.parameters(), old, strict=True)
                )
                / sum(float(o.pow(2).sum()) for o in old)
            )
            for b, old in zip(net.blocks, before, strict=True)
        ]
        if probe.latest is not None and probe.latest.step == step:
            record = probe.latest
            seen["logged"][step] = (
                {
                    series: record.profiles[tags.format(series, "blocks")]
                    for series in ("grad_norm", "weight_rms", "update_ratio")
                }
                | {
                    series: [
                        record.scalars[tags.format(series, "blocks", b, "ln_1")]
                        for b in range(DEPTH)
                    ]
                    for series in ("norm_gain_mean", "norm_gain_std")
                }
                | {"resid_rms": record.profiles[tags.format("resid_rms", "blocks")]}
            )
    probe.remove()
    seen["sinks"] = len(sink.records)
    seen["left"] = {
        "step_wrapped": "step" in vars(engine.optimizer) or "_take_model_step" in vars(engine),
        "hooks": sum(
            isinstance(h, ProbeHook)
            for m in net.modules()
            for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        ),
    }
    # without the ZeRO optimizer, the parameter families are refused, by name (stage 0: the
    # engine is found, nothing refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = normprobe.attach(net, sinks=[MemorySink()], metrics=METRICS)
    seen["unpaired"] = [list(probe.metrics), [str(w.message) for w in caught]]
    probe.remove()
    seen["optimizer"] = type(engine.optimizer).__name__
    engine.destroy()
    return seen


def main() -> None:
    out, rank, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    # gloo alone: DeepSpeed would compile its shared-memory collectives on first use (35 s)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    counter = Collectives()
    deepspeed.init_distributed(dist_backend="gloo")
    runs = {stage: train(stage, rank, counter) for stage in range(4)}
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
