"""``logits``: the size of the output head's logits."""

from __future__ import annotations

import torch

from .. import probes, tags
from .core.base import (
    MODEL,
    NOTE,
    SUSTAIN,
    Family,
    Flag,
    Out,
    Plan,
    Points,
    Run,
    Series,
    Values,
    sustained,
)

# Gemma 2 soft-caps final logits at 30: past it, softmax is saturated enough that that model
# chose to clip them. Only an absolute bound: a head starts near 0.1-1 whatever its health, so a
# rise from init says nothing (the healthy runs of benchmarks/calibration.py rise 10-30x, to
# 6-17 at the end, 27.5 at most). A note, not a problem: trained language models pass 30 and
# train on.
LIMIT = 30.0
STATS = ("max_abs", "rms", "z")


class Logits(Family):
    name = "logits"
    description = "the output head's logits: max |logit|, RMS and mean log-sum-exp (z)"
    series = (Series("logits", "model"),)

    def plan(self, plan: Plan) -> None:
        head = plan.model_map.head
        if head is None:
            return
        slots = [plan.slot(1, reduce) for reduce in ("max", "rms", "mean")]
        chunks: list[torch.Tensor] = []  # this forward's head calls: a head applied in chunks
        plan.at_forward_start(chunks.clear)

        def read(t: torch.Tensor) -> None:
            chunks.append(probes.logit_sums(t))
            sums = chunks[0] if len(chunks) == 1 else torch.stack(chunks)
            for slot, value in zip(slots, probes.logit_stats_from_sums(sums), strict=True):
                plan.measured.put(slot, value)

        def record(values: Values, out: Out) -> None:
            for stat, slot in zip(STATS, slots, strict=True):
                vals = values.get(slot)
                if vals is not None:
                    out.scalar("logits", stat, vals[0])

        plan.read(head, "post", read, call=None)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        hit = past(run.scalars.get(tags.format("logits", "max_abs"), []), LIMIT)
        if hit is None:
            return []
        step, value, why = hit
        return [
            Flag(
                "logit blow-up",
                MODEL,
                step,
                value,
                LIMIT,
                f"the head's max |logit| is {why}: softmax saturates; lower the learning rate, "
                "add weight decay or z-loss on the head, or soft-cap the logits (a cap the "
                "model applies after its head is not seen here: these are the head's outputs)",
                NOTE,
            )
        ]


def past(points: Points, limit: float) -> tuple[int, float, str] | None:
    """(step, value, why) of the last logged step when the value is at or past ``limit`` at
    the last `SUSTAIN` logged steps or more."""
    hits = sustained(points, lambda v: v >= limit)
    if len(hits) < SUSTAIN:
        return None
    step, value = hits[-1]
    return step, value, f"{value:.3g} >= {limit:g} ({len(hits)} logged steps past it)"
