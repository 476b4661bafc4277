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


def find_attention(g: Graph) -> dict[str, tuple[AttentionImpl, int]]:
    """Attention modules by path, in execution order, with how each computes its logits and
    its number of query heads.

    ``eager``: a softmax reads, through `LOGIT_OPS` only, the product of a matmul of two
    activations (q·k); the module is the innermost call holding both, so a softmax run by an
    ``nn.Softmax`` child counts for its parent. A router's softmax over a linear layer's output
    does not count. ``sdpa``: the module calls ``scaled_dot_product_attention``. ``mha``: an
    ``nn.MultiheadAttention``, whose ops torch dispatches as one.
    """
    events: list[tuple[int, int, AttentionImpl, tuple[int, ...]]] = [
        (g.calls[c].first_node, c, "sdpa", query)
        for c, query in zip(g.sdpa_calls, g.sdpa_queries, strict=True)
        if c is not None
    ]
    for s in g.softmaxes:
        product = _logits_product(g, s)
        cid = g.call[s]
        while product is not None and cid is not None and g.calls[cid].first_node > product:
            cid = g.calls[cid].parent
        if product is not None and cid is not None:
            events.append((s, cid, "eager", g.shape[s]))  # logits: (..., heads, queries, keys)
    events += [
        (call.first_node, cid, "mha", ())
        for cid, call in enumerate(g.calls)
        if isinstance(call.module, nn.MultiheadAttention)
    ]
    found: dict[str, tuple[AttentionImpl, int]] = {}
    for _, cid, impl, shape in sorted(events, key=lambda e: e[:2]):
        module = g.calls[cid].module
        found.setdefault(g.calls[cid].path, (impl, _heads(impl, shape, module)))
    return found


# where attention modules keep their number of heads (torch, timm, nanoGPT, Hugging Face)
_HEADS_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")


def _heads(impl: AttentionImpl, shape: tuple[int, ...], module: nn.Module) -> int:
    """Query heads from the shape of the queries or logits (..., heads, tokens, last): read off
    a 4-D one; a 3-D one may be (heads, ...) or (batch * heads, ...), so the module's own count
    decides; an ``nn.MultiheadAttention`` says it."""
    declared = _declared_heads(module)
    if impl == "mha":
        return declared or 1
    if len(shape) >= 4:
        return shape[-3]
    if len(shape) == 3 and declared and shape[0] % declared == 0:
        return declared
    return 1


def _declared_heads(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for value in (
        *(getattr(module, a, None) for a in _HEADS_ATTRIBUTES),
        getattr(config, "num_attention_heads", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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
