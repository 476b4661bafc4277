"""Find the modules that compute attention in a traced forward."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .graph import Graph
from .model_map import AttentionImpl
from .ops import ADD_OPS, EXACT_VIEW_OPS, MATMUL_OPS, SCALE_OPS, SOFTMAX_OPS

# Between a q·k product and its softmax, any op that keeps the logits' layout carries them on
# (`carries_logits`): elementwise ops (nan_to_num, clamp, soft-capping, casts, a mask or bias
# added or filled in, a scale) and the ops below, which view, slice, broadcast or extend them.
LOGIT_LAYOUT_OPS = EXACT_VIEW_OPS | frozenset(
    {
        "__getitem__",
        "narrow",
        "expand",
        "expand_as",
        "unflatten",
        "movedim",
        "swapaxes",
        "cat",  # an attention sink's logit joined to them (GPT-OSS)
        "concat",
        "concatenate",
        "pad",
    }
)
# Ops where the logits meet another tensor (a mask, a bias, a sink): what the model formed from
# q and k is read before. An op with any other tensor of more than one element counts too.
LOGIT_MASK_OPS = ADD_OPS | frozenset(
    {"sub", "sub_", "__sub__", "__isub__", "masked_fill", "masked_fill_", "where", "cat"}
    | {"concat", "concatenate", "pad"}
)
LOGIT_SCALE_OPS = SCALE_OPS | frozenset({"div_", "__itruediv__"})


def carries_logits(
    op: str, out: tuple[int, ...], inputs: list[tuple[int, ...]], broadcast: bool = False
) -> bool:
    """Whether an op (no weight op, softmax or product) of output shape ``out``, reading the
    logits among activations of shapes ``inputs``, carries them on toward a softmax: a view,
    slice or extension of them (`LOGIT_LAYOUT_OPS`), or an elementwise op, whose output has
    the shape of one input (of every input broadcast up, with ``broadcast``) and to which every
    input broadcasts. Constants, buffers and parameters it reads may broadcast too."""
    if op in LOGIT_LAYOUT_OPS:
        return True
    if out not in inputs and not broadcast:
        return False
    return all(_broadcasts(shape, out) for shape in inputs)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` unchanged in ``to``'s shape."""
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to), strict=False))


def find_attention(g: Graph) -> dict[str, tuple[AttentionImpl, int]]:
    """Attention modules by path, in execution order, with how each computes its logits and
    its number of query heads.

    ``eager``: a softmax (however called) reads the product of a matmul of two activations
    (q·k) through ops that carry logits (`carries_logits`: elementwise ops, views, slices); the
    module is the innermost call holding both, so a softmax run by an ``nn.Softmax`` child
    counts for its parent. A router's softmax over a linear layer's output (or over ``x @ w``,
    ``w`` a parameter) does not count, nor a ``log_softmax`` (the log-probabilities of a loss
    or a sampler, not weights for values). ``sdpa``: the module calls
    ``scaled_dot_product_attention``. ``mha``: the module calls
    ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, fairseq's own), which forms
    its logits inside one op.
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
    # F.multi_head_attention_forward, from nn.MultiheadAttention or a module of its own
    # (fairseq's MultiheadAttention in ESM-1): the innermost module calling it
    heads_of = {cid: heads for cid, heads in g.mha_calls}
    for cid, call in enumerate(g.calls):  # its fast path calls another op
        if isinstance(call.module, nn.MultiheadAttention):
            heads_of.setdefault(cid, call.module.num_heads)
    events += [(g.calls[c].first_node, c, "mha", ()) for c in heads_of]
    found: dict[str, tuple[AttentionImpl, int]] = {}
    for _, cid, impl, shape in sorted(events, key=lambda e: e[:2]):
        module = g.calls[cid].module
        heads = heads_of[cid] if impl == "mha" else _heads(impl, shape, module)
        found.setdefault(g.calls[cid].path, (impl, heads))
    return found


# where attention modules keep their number of heads (torch, timm, nanoGPT, Hugging Face)
_HEADS_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")


def _heads(impl: AttentionImpl, shape: tuple[int, ...], module: nn.Module) -> int:
    """Query heads from the shape of the queries or logits (..., heads, tokens, last): read off
    a 4-D one, unless the module's own count stands first (heads first: no per-head values); a
    3-D one may be (heads, ...) or (batch * heads, ...), so the module's own count decides."""
    declared = _declared_heads(module)
    if len(shape) >= 4:
        if declared and shape[-3] != declared and shape[0] == declared:
            return 1  # heads first (ESM's MSA Transformer: h, n, i, j): one value, the module's
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
    """The q·k product of ``softmax``: the latest matmul of two activations it reads through
    `_logit_chain` (an earlier one reaches it only through logits carried over from another
    layer's attention, as residual attention adds them)."""
    products = [n for n in _logit_chain(g, softmax) if _is_product(g, n)]
    return max(products, default=None)


def logit_nodes(g: Graph) -> set[int]:
    """Every node between a q·k product and the softmax reading it: an add among them (a
    bias, the previous layer's logits, talking heads' mix) is attention's, no residual add."""
    nodes: set[int] = set()
    for s in g.softmaxes:
        chain = _logit_chain(g, s)
        first = min((n for n in chain if _is_product(g, n)), default=None)
        if first is not None:
            nodes |= {n for n in chain if n > first}
    return nodes


def _is_product(g: Graph, n: int) -> bool:
    return g.op[n] in MATMUL_OPS and len(g.inputs[n]) >= 2 and not g.weight[n]


def _logit_chain(g: Graph, softmax: int) -> set[int]:
    """The nodes ``softmax`` reads through ops that carry logits (`carries_logits`) or mix
    heads (`_mixes_heads`), back to and including the matmuls of two activations that end
    it; another weight op (a router's Linear) or softmax ends a path unvisited."""
    todo, seen = list(g.inputs[softmax]), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if _is_product(g, n):
            seen.add(n)
            continue
        if g.op[n] in SOFTMAX_OPS or (g.weight[n] and not _mixes_heads(g, n)):
            continue
        acts = [i for i in g.inputs[n] if g.floating[i]]
        if acts and (
            g.weight[n] or carries_logits(g.op[n], g.shape[n], [g.shape[i] for i in acts])
        ):
            seen.add(n)
            todo.extend(acts)
    return seen


def _mixes_heads(g: Graph, n: int) -> bool:
    acts = g.inputs[n]
    return len(acts) == 1 and mixes_heads(g.shape[n], g.shape[acts[0]], g.weight_shapes.get(n, ()))


def mixes_heads(
    out: tuple[int, ...], logits: tuple[int, ...], weights: Sequence[tuple[int, ...]]
) -> bool:
    """Whether a weight op maps ``logits`` (..., heads, queries, keys) to ``out`` of the same
    shape through ``weights`` over heads only (talking heads: an (heads, heads) matrix in an
    einsum, a 1x1 convolution over heads)."""
    if out != logits or len(out) < 4:
        return False
    return bool(weights) and all(d in (1, out[-3]) for shape in weights for d in shape)
