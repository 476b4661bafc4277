"""Projection shortcuts: residual adds whose skip has a layer of its own (ResNet's 1x1-conv
downsample), told apart from two parallel branches by depth and by the module computing the
shortcut."""

from __future__ import annotations

from .graph import Graph
from .ops import MHA_OPS


def find_projection(g: Graph, a: int, b: int, cid: int) -> tuple[int, int, set[int], int] | None:
    """The sum of ``a`` and ``b`` made by call ``cid`` as a projection shortcut, if it is one:
    (skip, branch, the branch's own nodes, the node both read the stream from)."""
    floor = g.calls[cid].first_node - 1
    reg_a, front_a = g.region(a, floor)
    reg_b, front_b = g.region(b, floor)
    parent = g.calls[cid].parent
    if parent is not None and not any(g.weight[n] for n in reg_a | reg_b):
        # a helper handed both operands (EDM2's MPAdd(x, res_conv(x))): its caller's sum
        return find_projection(g, a, b, parent)
    shared = (reg_a | front_a) & (reg_b | front_b)
    if not shared:
        return None
    only_a = reg_a - reg_b
    only_b = reg_b - reg_a
    if not any(g.weight[n] for n in only_a) or not any(g.weight[n] for n in only_b):
        return None
    # The shortcut is one child module (the downsample) with one weight op, and the branch is
    # deeper; parallel branches (experts, GPT-NeoX's attn_out + mlp_out, a shared expert
    # beside routed ones) are not a skip.
    fork = max(shared)
    if not reads_input(g, fork, floor):  # EfficientFormerV2's `attn @ v + conv(v)`
        return None
    depth_a, depth_b = _depth(g, only_a), _depth(g, only_b)
    if depth_a == 1 < depth_b and _single_child(g, only_a, cid) and _layer(g, only_a):
        return a, b, only_b, fork
    if depth_b == 1 < depth_a and _single_child(g, only_b, cid) and _layer(g, only_b):
        return b, a, only_a, fork
    return None


def _layer(g: Graph, region: set[int]) -> bool:
    """Whether the shortcut's weight op is a layer's: not attention, whose projections torch
    runs as one op (PyG's GPSConv sums a local conv's and an ``nn.MultiheadAttention``'s
    outputs)."""
    return not any(g.op[n] in MHA_OPS for n in region if g.weight[n])


def reads_input(g: Graph, node: int, floor: int) -> bool:
    """Whether ``node`` is an input of the call (made before ``floor``) or made from one
    without a weight op (a norm, a view): the stream, not a value the call computed."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n <= floor:
            return True
        if n in seen or g.weight[n]:
            continue
        seen.add(n)
        todo.extend(g.inputs[n])
    return False


def _depth(g: Graph, region: set[int]) -> int:
    """The most weight ops on one dataflow path through ``region``."""
    depth: dict[int, int] = {}
    for n in sorted(region):
        here = int(bool(g.weight[n]))
        depth[n] = here + max((depth.get(i, 0) for i in g.inputs[n]), default=0)
    return max(depth.values(), default=0)


def _single_child(g: Graph, nodes: set[int], cid: int) -> bool:
    """Whether the weight ops among ``nodes`` were computed inside one direct child call of
    call ``cid`` (views and pooling around it may be the call's own: Hiera's shortcut is a
    projection, then a max over the pooled positions)."""
    child = None
    for n in nodes:
        if not g.weight[n]:
            continue
        c = g.call[n]
        while c is not None and g.calls[c].parent != cid:
            c = g.calls[c].parent
        if c is None or (child is not None and c != child):
            return False
        child = c
    return child is not None
