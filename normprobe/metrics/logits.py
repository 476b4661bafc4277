"""``logits``: the size of the output head's logits."""

from __future__ import annotations

import math

import torch

from .. import probes, tags
from .base import MODEL, SUSTAIN, Family, Flag, Out, Plan, Points, Run, Series, Values, sustained

# Gemma 2 soft-caps final logits at 30 and attention logits at 50: beyond these, softmax is
# saturated enough that those models chose to clip them.
LIMIT = 30.0
# Small-init heads start with logits near 0.1-1 and healthy training takes them to ~10, a rise
# of 10-100x; 100x from the first logged step is past that. A rise from a near-zero start (the
# attention of a block whose input is still tiny) counts only once the logit reaches 10, where
# softmax already favours one entry over another by e^10 = 22,000 to 1.
GROWTH_FACTOR = 100.0
GROWTH_FLOOR = 10.0
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

        def read(t: torch.Tensor) -> None:
            for slot, value in zip(slots, probes.logit_stats(t), strict=True):
                plan.measured.put(slot, value)

        def record(values: Values, out: Out) -> None:
            for stat, slot in zip(STATS, slots, strict=True):
                vals = values.get(slot)
                if vals is not None:
                    out.scalar("logits", stat, vals[0])

        plan.read(head, "post", read)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        hit = blow_up(run.scalars.get(tags.format("logits", "max_abs"), []), LIMIT)
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
                "add weight decay or z-loss on the head, or soft-cap the logits",
            )
        ]


def blow_up(points: Points, limit: float) -> tuple[int, float, str] | None:
    """(step, value, why) of the last logged step at which the value is past ``limit`` or
    rose past the growth factor since the first step, when at least `SUSTAIN` steps are."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    if not finite:
        return None
    s0, v0 = finite[0]

    def rose(v: float) -> bool:
        return v0 > 0 and v / v0 >= GROWTH_FACTOR and v >= GROWTH_FLOOR

    hits = sustained(finite, lambda v: v >= limit or rose(v))
    if len(hits) < SUSTAIN:
        return None
    s1, v1 = hits[-1]
    why = []
    if v1 >= limit:
        why.append(f"{v1:.3g} >= {limit:g}")
    if rose(v1):
        why.append(f"{v1:.3g}, {v1 / v0:.3g}x its value at step {s0}")
    text = why[0] if len(why) == 1 else f"{why[0]} and {why[1].split(', ', 1)[1]}"
    return s1, v1, f"{text} ({len(hits)} logged steps past it)"
