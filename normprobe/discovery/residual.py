"""Tell residual adds (`x + F(x)`) apart from every other tensor add in a traced forward.

An add ``a + b`` of two activations of the same shape is residual when

* ``identity``: the root of one operand (seen through views, dropout and scaling by a constant,
  the DeepNorm ``alpha * x``) is an ancestor of the other operand, and the other side computes
  with a parameter on the way (this excludes GELU's internal ``x + 0.044715 x**3``); or
* ``projection``: neither is an ancestor of the other, both descend from a common input of the
  enclosing module call, both sides use parameters, and one side runs inside a single child
  module and is shallower than the other (ResNet's downsample; this excludes GPT-NeoX's
  ``attn_out + mlp_out`` and sums of parallel experts).

Ancestry runs through activations only, so mask, bias, position and rotary adds, whose one side
is computed from buffers, parameters or other inputs, never qualify.
"""

from __future__ import annotations

from dataclasses import dataclass

from .trace import Graph


@dataclass
class FoundAdd:
    """A residual add located in the graph."""

    out: int  # node of the sum
    skip: int  # node of the skip operand
    branch: int  # node of the branch operand
    kind: str  # "identity" | "projection"
    call: int  # call performing the add
    region: set[int]  # nodes computed by the branch only
    layers: tuple[str, ...]  # weight layers on the branch, in execution order
    skip_scale: float


def find_residual_adds(g: Graph, weight_layers: set[str]) -> list[FoundAdd]:
    """Every residual add in ``g``, in execution order.

    ``weight_layers`` are the paths of modules holding a matrix or kernel (ndim >= 2) parameter.
    """
    found = []
    for out, a, b in g.adds:
        if not (g.act[a] and g.act[b]) or g.shape[a] != g.shape[b]:
            continue
        if g.alias[a] == g.alias[b]:
            continue
        cid = g.call[out]
        if cid is None:
            continue
        hit = _identity(g, a, b) or _identity(g, b, a)
        if hit is not None:
            skip, branch, region, reached = hit
            kind, scale = "identity", _skip_factor(g, skip, reached)
        else:
            proj = _projection(g, a, b, cid, weight_layers)
            if proj is None:
                continue
            skip, branch, region = proj
            kind, scale = "projection", 1.0
        found.append(
            FoundAdd(out, skip, branch, kind, cid, region, _layers(g, region, weight_layers), scale)
        )
    return found


def _identity(g: Graph, skip: int, branch: int) -> tuple[int, int, set[int], set[int]] | None:
    root = g.alias[skip]
    region, frontier = g.region(branch, root)
    if root in frontier and any(g.uses_param[n] for n in region):
        # views of the stream itself (a permute or scale the branch read through) are not branch
        branch_only = {n for n in region if g.alias[n] != root}
        return skip, branch, branch_only, region | frontier
    return None


def _skip_factor(g: Graph, skip: int, reached: set[int]) -> float:
    """The constant the skip is multiplied by after the branch read it (DeepNorm's alpha).

    Scaling that happened before the branch read the stream (Gemma's embedding scale) is part
    of the stream, not of the skip.
    """
    factor, n = 1.0, skip
    while n not in reached and g.alias_parent[n] != n:
        factor *= g.factor[n]
        n = g.alias_parent[n]
    return factor


def _projection(
    g: Graph, a: int, b: int, cid: int, weight_layers: set[str]
) -> tuple[int, int, set[int]] | None:
    floor = g.calls[cid].first_node - 1
    reg_a, front_a = g.region(a, floor)
    reg_b, front_b = g.region(b, floor)
    if not (reg_a | front_a) & (reg_b | front_b):
        return None
    only_a = reg_a - reg_b
    only_b = reg_b - reg_a
    if not any(g.uses_param[n] for n in only_a) or not any(g.uses_param[n] for n in only_b):
        return None
    # The shortcut is one child module (the downsample) and shallower than the branch; parallel
    # branches of equal depth (experts, GPT-NeoX's attn_out + mlp_out) are not a skip.
    depth_a, depth_b = _depth(g, only_a, weight_layers), _depth(g, only_b, weight_layers)
    if depth_a < depth_b and _single_child(g, only_a, cid):
        return a, b, only_b
    if depth_b < depth_a and _single_child(g, only_b, cid):
        return b, a, only_a
    return None


def _depth(g: Graph, region: set[int], weight_layers: set[str]) -> int:
    """The most weight layers on one dataflow path through ``region``."""
    depth: dict[int, int] = {}
    for n in sorted(region):
        here = int(g.uses_param[n] and g.owner[n] in weight_layers)
        depth[n] = here + max((depth.get(i, 0) for i in g.inputs[n]), default=0)
    return max(depth.values(), default=0)


def _single_child(g: Graph, nodes: set[int], cid: int) -> bool:
    """Whether all ``nodes`` were computed inside one direct child call of call ``cid``."""
    child = None
    for n in nodes:
        c = g.call[n]
        while c is not None and g.calls[c].parent != cid:
            c = g.calls[c].parent
        if c is None or (child is not None and c != child):
            return False
        child = c
    return child is not None


def _layers(g: Graph, region: set[int], weight_layers: set[str]) -> tuple[str, ...]:
    layers: dict[str, None] = {}
    for n in sorted(region):
        owner = g.owner[n]
        if g.uses_param[n] and owner is not None and owner in weight_layers:
            layers[owner] = None
    return tuple(layers)
