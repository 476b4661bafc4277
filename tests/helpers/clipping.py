"""Gradient norms before clipping: by hand, as logged, and a clipped SGD loop under a probe
(tests/adapters/test_preclip.py; tests/runtime/test_cuda.py on a GPU)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import normprobe
from normprobe import tags

MAX_NORM = 1.0
TOTAL = tags.format("grad_norm_total", "model")
REST = tags.format("grad_norm_rest", "model")
CLIP = tags.format("grad_clip_factor", "model")


def norms(blocks: nn.ModuleList, model: nn.Module) -> dict[str, float]:
    """The gradients present now, by hand: each block's norm, the rest's and the total."""

    def norm(params: list[nn.Parameter]) -> float:
        return math.sqrt(
            sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None)
        )

    inside = {id(p) for p in blocks.parameters()}
    found = {f"block{b}": norm(list(block.parameters())) for b, block in enumerate(blocks)}
    found["rest"] = norm([p for p in model.parameters() if id(p) not in inside])
    found["total"] = norm(list(model.parameters()))
    return found


def logged(record: normprobe.Record, stack: str, depth: int) -> dict[str, float]:
    found = {
        f"block{b}": record.scalars[tags.format("grad_norm", stack, b, depth=depth)]
        for b in range(depth)
    }
    found["rest"], found["total"] = record.scalars[REST], record.scalars[TOTAL]
    return found


def clipped_loop(
    model: nn.Module,
    batches: list[torch.Tensor],
    *,
    accumulate: int = 1,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    hand_scaler: bool = True,
    own_step: bool = False,
    persistent: bool = False,
    max_norm: float = MAX_NORM,
) -> tuple[list[normprobe.Record], list[dict[str, float]], list[float]]:
    """Train with SGD, clipping to ``max_norm``, ``accumulate`` micro-batches a step; the probe's
    records, the hand norms before clipping and the totals ``clip_grad_norm_`` returned. With a
    ``scaler`` (handed to the probe if ``hand_scaler``), its ``scaler.step(opt)`` steps, or
    ``opt.step()`` after its ``unscale_`` with ``own_step``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = normprobe.MemorySink()
    probe = normprobe.Probe(
        model,
        optimizer=opt,
        sinks=[sink],
        every=1,
        metrics=["grad_norm"],
        persistent_hooks=persistent,
        scaler=scaler if hand_scaler else None,
    )
    probe.discover_now(batches[0][:1])
    run = model if forward is None else forward
    hand, totals = [], []
    for i in range(0, len(batches), accumulate):
        for x in batches[i : i + accumulate]:
            loss = (run(x) ** 2).mean() * 50 / accumulate
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        hand.append(norms(model.blocks, model))
        totals.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        if scaler is None or own_step:
            opt.step()
        else:
            scaler.step(opt)
        if scaler is not None:
            scaler.update()
        opt.zero_grad()
    probe.remove()
    return sink.records, hand, totals


def batches(n: int, rows: int = 8, width: int = 16) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(rows, width) for _ in range(n)]


def check_clipped(
    records: list[normprobe.Record],
    hand: list[dict[str, float]],
    totals: list[float],
    depth: int,
    stack: str = "blocks",
) -> None:
    assert len(records) == len(hand) > 0
    for record, expected, total in zip(records, hand, totals, strict=True):
        assert total > 2 * MAX_NORM  # clipped: values smaller by the clip factor fail
        assert logged(record, stack, depth) == pytest.approx(expected, rel=1e-5)
        assert record.scalars[TOTAL] == pytest.approx(total, rel=1e-5)
        blocks = sum(record.scalars[tags.format("grad_norm", stack, b)] ** 2 for b in range(depth))
        assert blocks + record.scalars[REST] ** 2 == pytest.approx(record.scalars[TOTAL] ** 2)
        assert record.scalars[CLIP] == pytest.approx(MAX_NORM / total, rel=1e-4)
