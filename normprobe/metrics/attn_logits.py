"""``attn_logits``: how large attention logits get."""

from __future__ import annotations

from functools import partial

import torch

from .. import tags
from .base import Family, Flag, Out, Plan, Run, RunTag, Series, Slot, Values
from .logits import blow_up

# Gemma 2 soft-caps attention logits at 50: beyond it, softmax is close to one-hot.
LIMIT = 50.0


def _put_max(plan: Plan, slot: Slot, per_head: torch.Tensor) -> None:
    plan.measured.put_max(slot, per_head.amax())


class AttnLogits(Family):
    name = "attn_logits"
    requires = "no attention modules"
    optional = True
    description = (
        "per attention module, max |q.k| * scale as the model forms it from q and k "
        "(soft-capping included, masks and biases left out: every product counts), also when "
        "attention is fused (scaled_dot_product_attention) or an nn.MultiheadAttention"
    )
    series = (Series("attn_logit_max", "module", "max"),)  # the worst module of the stack

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, Slot]] = []
        for a in plan.attention:
            slot = plan.slot(1, "max")
            plan.read_attention(a.path, partial(_put_max, plan, slot))
            slots.append((plan.module_tag(a.path), slot))

        def record(values: Values, out: Out) -> None:
            for subject, slot in slots:
                vals = values.get(slot)
                if vals is not None:
                    out.scalar("attn_logit_max", subject, vals[0])

        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        worst: dict[str, tuple[float, RunTag, tuple[int, float, str]]] = {}
        for t in run.tags:
            if t.parsed.series != "attn_logit_max":
                continue
            hit = blow_up(run.scalars[t.tag], LIMIT)
            if hit is not None and (t.stack not in worst or hit[1] > worst[t.stack][0]):
                worst[t.stack] = (hit[1], t, hit)
        for stack in sorted(worst):
            _, t, (step, value, why) = worst[stack]
            heads = dict(run.scalars.get(tags.prefix("attn_head_argmax") + t.module, []))
            head = f" (head {heads[step]:.0f})" if step in heads else ""
            found.append(
                Flag(
                    "logit blow-up",
                    stack,
                    step,
                    value,
                    LIMIT,
                    f"attention logits max |q.k|*scale of {t.module}{head} is {why}: attention "
                    "saturates toward one-hot; normalize queries and keys in the model's "
                    "attention (QK-norm: a LayerNorm or RMSNorm over each head's q and k), "
                    "soft-cap the logits, or lower the learning rate",
                )
            )
        return found
