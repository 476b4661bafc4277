"""Composite layers: a module whose output sums linear maps of its one input, each through a
weight (LoRA's ``linear(x, W) + s * lora_b(lora_a(x))``, DoRA's rescaled sum, a
reparameterizable sum of convolutions), is one linear layer, ``x -> (W + s B A) x``. Its sum is
neither a residual add nor parallel branches; the tracer records it as one weight op of the
module, which a branch's walk then meets as that branch's one writer."""

from __future__ import annotations

from .graph import Graph
from .ops import ADD_OPS, EXACT_VIEW_OPS, PASS_OPS, SCALE_OPS, WEIGHT_OPS

# Ops linear in their one activation input (a product or quotient only by a constant or a
# parameter; a weight op applying a matrix or kernel, not a table).
_LINEAR_VIEWS = EXACT_VIEW_OPS | PASS_OPS | {"neg", "__neg__", "__getitem__"}
_LINEAR_WEIGHT_OPS = WEIGHT_OPS - {"embedding", "embedding_bag", "bilinear"}
_SUBTRACTIONS = frozenset({"sub", "__sub__", "__rsub__"})


def linear_sum(g: Graph, out: int) -> bool:
    """Whether add ``out`` sums linear maps of one input of the module computing it, each a
    chain of weight ops read through views, dropout and constant factors (`composite`): a
    stream of residual adds of linear layers is no such chain."""
    cid = g.call[out]
    acts = [i for i in g.inputs[out] if g.floating[i]]
    if cid is None or g.op[out] not in ADD_OPS or len(acts) != 2:
        return False
    floor = g.calls[cid].first_node - 1
    read: set[int] = set()
    for operand in acts:
        region, frontier = g.region(operand, floor)
        if not any(g.weight[n] for n in region) or not all(_linear(g, n, floor) for n in region):
            return False
        read |= frontier
    return len(read) == 1 and read <= set(g.calls[cid].in_nodes)


def _linear(g: Graph, n: int, floor: int) -> bool:
    """Whether node ``n`` is linear in its activations; a weight op also reads the module's
    input or another weight op's output, through no sum."""
    acts = [i for i in g.inputs[n] if g.floating[i]]
    op = g.op[n]
    if op in ADD_OPS or op in _SUBTRACTIONS:
        return True  # sums of linear maps (and a composite layer met inside one)
    if len(acts) != 1:
        return False
    if not g.weight[n]:
        return op in _LINEAR_VIEWS or op in SCALE_OPS
    i = acts[0]
    while i > floor and not g.weight[i]:
        inputs = [j for j in g.inputs[i] if g.floating[j]]
        if len(inputs) != 1:
            return False
        i = inputs[0]
    return op in _LINEAR_WEIGHT_OPS


def mark_composite(g: Graph, cid: int) -> None:
    """Record call ``cid``'s output, if a `linear_sum` computed in the call itself, as one
    weight op of its module, applying the weights of the last weight op on each path."""
    call = g.calls[cid]
    s = g.alias[call.out_nodes[0]] if call.out_nodes else -1
    if s < call.first_node or g.call[s] != cid or not linear_sum(g, s):
        return
    last: list[int] = []
    todo, seen = list(g.inputs[s]), set()
    while todo:
        n = todo.pop()
        if n in seen or n < call.first_node:
            continue
        seen.add(n)
        if g.weight[n]:
            last.append(n)
        else:
            todo.extend(g.inputs[n])
    last.sort()
    g.weight[s] = tuple(dict.fromkeys(q for n in last for q in g.weight[n]))
    g.weight_shapes[s] = tuple(shape for n in last for shape in g.weight_shapes.get(n, ()))
    g.owner[s] = call.path
    g.uses_param[s] = True
