"""``attn_logits_head``: the max attention logit of each head, and MuonClip's per-head factors."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from .core.attention import AttentionInputs
from .core.base import Family, Out, Plan, Series, Slot, Values

if TYPE_CHECKING:
    from ..runtime.probe import Probe

# Kimi K2's MuonClip rescales a head's W_q and W_k once its max logit passes tau = 100.
TAU = 100.0
# Fused and nn.MultiheadAttention logits are recomputed for a sample of the products
# (`probes.logit_sample`): a module's max reads at most this share below the exact one (it
# equalled it on GPT-2-, Llama- and ViT-style models and nn.TransformerEncoder, at init and
# trained, 128 tokens; a head's max was within 8% at init, 0.3% trained).
SAMPLED_ERROR = 0.05


def _put_max(plan: Plan, slot: Slot, inputs: AttentionInputs) -> None:
    plan.measured.put_max(slot, inputs.logit_max)


class AttnLogitsHead(Family):
    name = "attn_logits_head"
    requires = "no attention modules"
    optional = True
    description = (
        "per attention module and query head, max |q.k| * scale over every product the head "
        "forms (as attn_logits: soft-capping included, masks left out; grouped-query heads "
        "counted as the query's; fused or nn.MultiheadAttention, from a sample of the products "
        "that never reads above the exact max); tags: the max over heads and its head, the "
        f"per-head vector, and per stack the heads past tau = {TAU:g} (what MuonClip would "
        "rescale)"
    )
    series = (
        Series("attn_heads_over_tau", "stack"),
        Series("attn_head_max", "module", "none"),  # the row attn_logit_max[max] shows it
        Series("attn_head_argmax", "module", "none"),
        Series("attn_logits_head", "module", "none", heads=True),
    )

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, str | None, Slot]] = []
        for a in plan.attention:
            slot, here = plan.head_slots(a.path, "max")
            plan.read_attention(a.path, partial(_put_max, plan, here), logit_max=True)
            stack = plan.stack_name(a.stack) if a.stack is not None else None
            slots.append((plan.module_tag(a.path), stack, slot))

        def record(values: Values, out: Out) -> None:
            over: dict[str, int] = {}
            for subject, stack, slot in slots:
                heads = values.get(slot)
                if heads is None:
                    continue
                top = max(range(len(heads)), key=heads.__getitem__)
                out.scalar("attn_head_max", subject, heads[top])
                out.scalar("attn_head_argmax", subject, float(top))
                out.vector("attn_logits_head", subject, heads)
                if stack is not None:
                    over[stack] = over.get(stack, 0) + sum(v > TAU for v in heads)
            for stack, count in over.items():
                out.scalar("attn_heads_over_tau", stack, float(count))

        plan.on_record(record)


def qk_clip_factors(probe: Probe, tau: float = TAU) -> dict[str, torch.Tensor]:
    """The factors Kimi K2's MuonClip would apply to each head, from the probe's last logged
    step: ``min(1, tau / max_logit)`` per query head, by attention module path.

    MuonClip multiplies a head's query and key projections by the square root of its factor
    each (for multi-head latent attention, only the parts not shared across heads), which
    scales that head's logits by the factor. Heads at or below ``tau`` get 1.

    Raises:
        ValueError: ``tau`` is not positive, or the probe does not log ``attn_logits_head``.
        RuntimeError: the probe has not logged a step yet.
    """
    if not tau > 0:
        raise ValueError(f"tau must be a positive logit, got {tau!r} (MuonClip uses 100.0)")
    if AttnLogitsHead.name not in probe.metrics:
        raise ValueError(
            f"the probe does not log {AttnLogitsHead.name!r} (metrics={list(probe.metrics)}): "
            f"attach with metrics including {AttnLogitsHead.name!r}, or the default metrics=None"
        )
    record = probe.latest
    if record is None or probe.model_map is None:
        raise RuntimeError("the probe has not logged a step yet: train one step first")
    factors = {}
    for a in probe.model_map.attention:
        heads = record.profiles.get(probe.tag(AttnLogitsHead.name, a.path))
        if heads is not None:
            factors[a.path] = (tau / torch.tensor(heads, dtype=torch.float32)).clamp(max=1.0)
    return factors
