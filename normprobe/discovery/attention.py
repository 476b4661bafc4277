"""Find the modules that compute attention in a traced forward."""

from __future__ import annotations

from .model_map import AttentionImpl
from .trace import MATMUL_OPS, Graph


def find_attention(g: Graph) -> dict[str, AttentionImpl]:
    """Attention modules by path, in execution order, with how each computes its logits."""
    found: dict[str, AttentionImpl] = {}
    events: list[tuple[int, int, AttentionImpl]] = [
        (g.calls[c].first_node, c, "sdpa") for c in g.sdpa_calls if c is not None
    ]
    for s in g.softmaxes:
        cid = g.call[s]
        if cid is None:
            continue
        seen, _ = g.region(s, g.calls[cid].first_node - 1)
        if any(g.op[n] in MATMUL_OPS and len(g.inputs[n]) >= 2 for n in seen):
            events.append((s, cid, "eager"))
    for _, cid, impl in sorted(events):
        found.setdefault(g.calls[cid].path, impl)
    return found
