"""``attn_logits``: how large attention logits get."""

from __future__ import annotations

from functools import partial

from .. import tags
from .attn_logits_head import SAMPLED_ERROR
from .core.attention import AttentionInputs
from .core.base import NOTE, PROBLEM, Family, Flag, Out, Plan, Run, RunTag, Series, Slot, Values
from .logits import past

# MuonClip (Kimi K2) rescales a head's queries and keys once its max logit passes tau = 100:
# a problem past it. Gemma 2 soft-caps attention logits at 50: a note past that. Absolute
# bounds only: at init the logits are near 0.1 whatever the model's health, so a rise from
# init is no sign (the healthy runs of benchmarks/calibration.py rise 50-400x, to 6-63 at the
# end: notes past 50 for make demo's Pre-LN and a Llama; a head whose queries equal its keys
# reads 1400, the learning rate 10x too high 640).
TAU = 100.0
SOFT_CAP = 50.0


def _put_max(plan: Plan, slot: Slot, inputs: AttentionInputs) -> None:
    plan.measured.put_max(slot, inputs.logit_max.amax())


class AttnLogits(Family):
    name = "attn_logits"
    requires = "no attention modules"
    optional = True
    description = (
        "per attention module, max |q.k| * scale as the model forms it from q and k "
        "(soft-capping included, masks and biases left out: every product counts), also when "
        "attention is fused (scaled_dot_product_attention) or an nn.MultiheadAttention; those "
        "two recompute q.k for a sample: every product of sequences up to 128 tokens, else of "
        "1 query in 8 (those whose logits can be largest) with every key and of every query "
        "with 1 key in 8 (those farthest from the mean key): a lower bound, within "
        f"{SAMPLED_ERROR:.0%} of the exact max on the models measured"
    )
    series = (Series("attn_logit_max", "module", "max"),)  # the worst module of the stack

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, Slot]] = []
        for a in plan.attention:
            slot = plan.slot(1, "max")
            plan.read_attention(a.path, partial(_put_max, plan, slot), logit_max=True)
            slots.append((plan.module_tag(a.path), slot))

        def record(values: Values, out: Out) -> None:
            for subject, slot in slots:
                vals = values.get(slot)
                if vals is not None:
                    out.scalar("attn_logit_max", subject, vals[0])

        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        found = []
        # per stack, the worst module: past tau before past the soft cap, then the largest
        worst: dict[str, tuple[bool, float, RunTag, tuple[int, float, str]]] = {}
        for t in run.tags:
            if t.parsed.series != "attn_logit_max":
                continue
            points = run.scalars[t.tag]
            over_tau = past(points, TAU)
            hit = over_tau or past(points, SOFT_CAP)
            if hit is None:
                continue
            problem = over_tau is not None
            if t.stack not in worst or (problem, hit[1]) > worst[t.stack][:2]:
                worst[t.stack] = (problem, hit[1], t, hit)
        for stack in sorted(worst):
            problem, _, t, (step, value, why) = worst[stack]
            heads = dict(run.scalars.get(tags.prefix("attn_head_argmax") + t.module, []))
            head = f" (head {heads[step]:.0f})" if step in heads else ""
            found.append(
                Flag(
                    "logit blow-up",
                    stack,
                    step,
                    value,
                    TAU if problem else SOFT_CAP,
                    f"attention logits max |q.k|*scale of {t.module}{head} is {why}: attention "
                    "saturates toward one-hot; normalize queries and keys in the model's "
                    "attention (QK-norm: a LayerNorm or RMSNorm over each head's q and k), "
                    "soft-cap the logits, or lower the learning rate",
                    PROBLEM if problem else NOTE,
                )
            )
        return found
