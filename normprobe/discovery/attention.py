"""Find the modules that compute attention in a traced forward."""

from __future__ import annotations

from torch import nn

from .model_map import AttentionImpl
from .trace import ADD_OPS, EXACT_VIEW_OPS, MATMUL_OPS, PASS_OPS, SCALE_OPS, Graph

# Ops between the q·k product and the softmax that add to the logits or overwrite some of them:
# an additive mask or bias, a filled mask. The logits as the model forms them are read before.
LOGIT_MASK_OPS = ADD_OPS | frozenset(
    {"sub", "sub_", "__sub__", "__isub__", "masked_fill", "masked_fill_", "where"}
)
LOGIT_SCALE_OPS = SCALE_OPS | frozenset({"div_", "__itruediv__"})
# Ops that carry the logits on unchanged in kind: views, casts, dropout, tanh soft-capping.
LOGIT_PASS_OPS = (
    EXACT_VIEW_OPS | PASS_OPS | frozenset({"tanh", "tanh_", "__getitem__", "expand", "expand_as"})
)
LOGIT_OPS = LOGIT_MASK_OPS | LOGIT_SCALE_OPS | LOGIT_PASS_OPS


def find_attention(g: Graph) -> dict[str, AttentionImpl]:
    """Attention modules by path, in execution order, with how each computes its logits.

    ``eager``: a softmax reads, through `LOGIT_OPS` only, the product of a matmul of two
    activations (q·k); the module is the innermost call holding both, so a softmax run by an
    ``nn.Softmax`` child counts for its parent. A router's softmax over a linear layer's output
    does not count. ``sdpa``: the module calls ``scaled_dot_product_attention``. ``mha``: an
    ``nn.MultiheadAttention``, whose ops torch dispatches as one.
    """
    events: list[tuple[int, int, AttentionImpl]] = [
        (g.calls[c].first_node, c, "sdpa") for c in g.sdpa_calls if c is not None
    ]
    for s in g.softmaxes:
        product = _logits_product(g, s)
        cid = g.call[s]
        while product is not None and cid is not None and g.calls[cid].first_node > product:
            cid = g.calls[cid].parent
        if product is not None and cid is not None:
            events.append((s, cid, "eager"))
    events += [
        (call.first_node, cid, "mha")
        for cid, call in enumerate(g.calls)
        if isinstance(call.module, nn.MultiheadAttention)
    ]
    found: dict[str, AttentionImpl] = {}
    for _, cid, impl in sorted(events):
        found.setdefault(g.calls[cid].path, impl)
    return found


def _logits_product(g: Graph, softmax: int) -> int | None:
    """The matmul of two activations whose product ``softmax`` reads through `LOGIT_OPS`."""
    todo, seen = list(g.inputs[softmax]), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if g.op[n] in MATMUL_OPS and len(g.inputs[n]) >= 2:
            return n
        if g.op[n] in LOGIT_OPS:
            todo.extend(g.inputs[n])
    return None
