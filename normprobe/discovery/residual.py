"""Tell residual adds (`x + F(x)`) apart from every other tensor add in a traced forward, and
find what each branch writes into the stream.

An add ``a + b`` of two activations of the same shape is residual when

* ``identity``: the root of one operand (seen through views, dropout and scaling by a constant,
  the DeepNorm ``alpha * x``), or the tensor that root slices (DPN's ``x[:, :c] + out[:, :c]``),
  is an ancestor of the other operand, and the other side applies a
  weight (a matrix, kernel or table) on the way: this excludes GELU's internal
  ``x + 0.044715 x**3`` and the ``+ x`` of a global response norm, whose branch holds only
  elementwise parameters. The skip may also reach the stream through a learned gain
  (``x * gain``, a parameter) or a weightless transform (pooling, padding, joining zeros: the
  CIFAR ResNet's "option A" shortcut); such a skip counts when it reads an input of the module
  adding it, or a stream that other residual adds run along (Mamba's ``y + u * D`` reads a
  value its own module computed). A branch without a weight (PoolFormer's ``pool(x) - x``)
  counts when it holds a norm module or its sum, itself or normalized, is the stream another
  residual add reads. Neither kind counts on another add's branch; or
* ``projection``: neither is an ancestor of the other, both descend from a common input of the
  enclosing module call (or a value made from one without a weight op, as a norm makes it),
  and one side applies one weight, in a single child module (ResNet's downsample; views and
  pooling around it aside, as Hiera pools its projected shortcut), while the other applies
  more; this excludes GPT-NeoX's ``attn_out + mlp_out``, sums of experts and terms a module
  adds from values it computed itself (EfficientFormerV2's ``attn @ v + conv(v)``).

A further branch added onto a residual sum, reading the stream that sum's skip came from
(Cohere's ``x + attn + mlp``), joins that add: one add, several branches. Ancestry runs through
activations only, so mask, bias, position and rotary adds, whose one side is computed from
buffers, parameters or other inputs, never qualify.

What a branch writes follows its dataflow backwards from the add: the last weight op on each
path is a writer; a factor multiplied into a path (a sigmoid gate, a router's weights, a layer
scale), or into the input of the module applying a writer (a router's weights scaling its
experts' input), is a gate or a scale, never a writer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .attention import logit_nodes
from .composite import linear_sum
from .graph import Graph
from .ops import ADD_OPS, SCALE_OPS
from .projection import find_projection, reads_input

# Ops taking part of a tensor: a skip read through one still reads the tensor's stream.
SLICE_OPS = frozenset({"__getitem__", "narrow"})
# Ops whose output, multiplied into a value, gates it.
GATE_OPS = frozenset({"sigmoid", "sigmoid_", "softmax", "_softmax", "hardsigmoid", "tanh"})
# Elementwise nonlinearities: a sum behind one is a single branch's (an sLSTM cell's input and
# recurrent projections under its tanh), not parallel branches summed into the stream.
_NONLINEAR = ("tanh", "sigmoid", "relu", "relu6", "gelu", "silu", "softplus", "elu", "selu", "celu")
NONLINEAR_OPS = frozenset(
    {*_NONLINEAR, *(f"{n}_" for n in _NONLINEAR), "leaky_relu", "leaky_relu_", "hardtanh"}
    | {"hardtanh_", "hardswish", "hardsigmoid", "mish", "exp", "softsign", "logsigmoid"}
    | {"log", "sqrt", "rsqrt", "abs", "minimum", "maximum", "max", "min", "clamp", "clamp_min"}
)
_DIVISIONS = frozenset({"div", "__truediv__", "div_", "__itruediv__"})
# Ops making a skip from the stream without a weight: pooling it, padding it, joining zeros to
# it (the CIFAR ResNet's "option A" shortcut), resizing it.
SKIP_TRANSFORM_OPS = frozenset(
    {
        "pad",
        "constant_pad_nd",
        *(
            f"{kind}_pool{d}d"
            for kind in ("avg", "max", "adaptive_avg", "adaptive_max")
            for d in (1, 2, 3)
        ),
        "cat",
        "concat",
        "concatenate",
        "interpolate",
        "pixel_shuffle",
        "pixel_unshuffle",
    }
)
# Elementwise products: one by a parameter on the skip is a learned skip gain.
GAIN_OPS = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__"})


@dataclass
class Writes:
    """What one branch writes into the stream: the weight ops reaching the add."""

    writers: list[int] = field(default_factory=list)  # nodes of the last weight op on each path
    gates: list[int] = field(default_factory=list)  # weight ops on gating factors
    # those of them on a factor computed from no residual stream: a condition's gate (the
    # timestep and class embedding's, in adaLN-Zero)
    conditions: list[int] = field(default_factory=list)
    scales: list[int] = field(default_factory=list)  # elementwise-parameter factors on a path
    parallel: bool = False  # several ungated sub-branches summed
    open_path: bool = False  # a path reaches the add from the stream without a weight op


@dataclass
class FoundAdd:
    """A residual add located in the graph."""

    out: int  # node of the sum
    skip: int  # node of the skip operand
    branches: list[int]  # nodes of the branch operands (several for a parallel block)
    kind: str  # "identity" | "projection"
    call: int  # call performing the add
    region: set[int]  # nodes computed by the branches only
    stream: int  # node the branches read the stream from (the fork, for a projection)
    layers: tuple[str, ...]  # weight layers on the branch, in execution order
    skip_scale: float
    writes: Writes
    skip_gains: list[int] = field(default_factory=list)  # nodes multiplying the skip by a parameter


@dataclass
class _Hit:
    """An operand ``branch`` computed from the stream ``skip`` reads."""

    skip: int
    branch: int
    region: set[int]  # nodes computed by the branch only
    reached: set[int]  # every node the walk from the branch visited, and its frontier
    stream: int  # the node the branch reads the stream from
    weighted: bool  # the branch applies a weight
    guarded: bool  # the skip reads the stream through a learned gain or a weightless transform


def find_residual_adds(g: Graph, norm_calls: frozenset[int] = frozenset()) -> list[FoundAdd]:
    """Every residual add in ``g``, in execution order (by the node of its sum).

    ``norm_calls`` are the calls of norm modules: a weightless branch holding one is a branch.
    An add between a q·k product and its softmax (`logit_nodes`) is attention's, none.
    """
    logits = logit_nodes(g)
    found: list[FoundAdd] = []
    by_out: dict[int, FoundAdd] = {}
    weak: list[tuple[int, int, _Hit]] = []  # (sum, call, hit) that `_accept_weak` decides
    for out, a, b in g.adds:
        if not (g.act[a] and g.act[b]) or g.shape[a] != g.shape[b]:
            continue
        if g.alias[a] == g.alias[b] or out in logits or linear_sum(g, out):
            continue  # a composite layer's own sum (LoRA's) is no residual add
        cid = g.call[out]
        if cid is None:
            continue
        hits = [h for h in (_identity(g, a, b), _identity(g, b, a)) if h is not None]
        hit = next((h for h in hits if h.weighted and not h.guarded), None)
        joined = None if hit else _join(g, by_out, out, a, b) or _join(g, by_out, out, b, a)
        if joined is not None:
            by_out[out] = joined
            continue
        if hit is not None:
            add = _identity_add(g, out, cid, hit)
        else:
            proj = find_projection(g, a, b, cid)
            if proj is None:
                if hits:
                    weak.append((out, cid, max(hits, key=lambda h: h.weighted)))
                continue
            skip, branch, region, stream = proj
            add = FoundAdd(
                out, skip, [branch], "projection", cid, region, stream, (), 1.0, Writes()
            )
        found.append(add)
        by_out[out] = add
    found = _carried(
        g, sorted(found + _accept_weak(g, weak, found, norm_calls), key=lambda f: f.out)
    )
    streams = {g.alias[n] for f in found for n in (f.stream, f.out)}
    fed = _fed_by(g, streams)
    for add in found:
        _describe(g, add, streams, fed)
    return found


def _carried(g: Graph, found: list[FoundAdd]) -> list[FoundAdd]:
    """The adds of ``found`` but those on the branch of another add whose stream is one of
    their operands, carried on beside the sum, if the sum is no stream and reaches none, nor
    the output, through no weight op: RT-DETR's ``q = x + pos`` (``pos`` an MLP of boxes the
    previous layer predicted) only feeds the queries and keys of ``x + attn(q, q, x)``."""
    beside = {(g.alias[o.stream], n) for o in found for n in o.region}
    inner = [
        f
        for f in found
        if any((g.alias[i], f.out) in beside for i in (f.stream, f.skip, *f.branches))
    ]
    readers: dict[int, list[int]] = {}
    for n, inputs in enumerate(g.inputs if inner else []):
        for i in inputs:
            readers.setdefault(i, []).append(n)
    outputs = {g.alias[n] for _, n in g.root_outputs}
    side = []
    for f in inner:
        ends = outputs | {g.alias[n] for o in found if o is not f for n in (o.stream, o.skip)}
        todo, seen, carried = [f.out], set(), False
        while todo and not carried:
            n = todo.pop()
            if n not in seen and not g.weight[n]:
                seen.add(n)
                carried = g.alias[n] in ends
                todo += readers.get(n, [])
        if not carried:
            side.append(f)
    return [f for f in found if f not in side]


def _fed_by(g: Graph, sources: set[int]) -> set[int]:
    """The nodes computed from any of ``sources`` (themselves included)."""
    fed: set[int] = set()
    for n in range(len(g)):  # inputs come first
        if g.alias[n] in sources or any(i in fed for i in g.inputs[n]):
            fed.add(n)
    return fed


def _identity_add(g: Graph, out: int, cid: int, hit: _Hit) -> FoundAdd:
    """The identity add of sum ``out``, made by call ``cid``, as ``hit`` found it."""
    scale, gains = _skip_path(g, hit.skip, hit.reached)
    add = FoundAdd(
        out, hit.skip, [hit.branch], "identity", cid, hit.region, hit.stream, (), scale, Writes()
    )
    add.skip_gains = gains
    return add


def _accept_weak(
    g: Graph, weak: list[tuple[int, int, _Hit]], found: list[FoundAdd], norm_calls: frozenset[int]
) -> list[FoundAdd]:
    """The adds of ``weak`` that are plainly residual.

    A skip read through a learned gain or a weightless transform must read an input of the
    module adding it (made from one without a weight) or be chained to other residual adds; a
    branch without a weight must hold a norm module (PoolFormer's ``pool(norm(x)) - norm(x)``)
    or its sum must be the stream a further residual add reads, itself or normalized (FNet's
    Post-LN ``norm(x + fft(x).real)``; not GELU's ``x + c x**3``, whose sum only feeds the
    activation). None may lie on another add's branch (``x + (f(x) + gamma * x)`` is one add).
    """
    normed: dict[int, list[int]] = {}  # a norm's input -> its outputs (by alias)
    for c in norm_calls:
        call = g.calls[c]
        if call.in_nodes and call.out_nodes:
            normed.setdefault(g.alias[call.in_nodes[0]], []).append(g.alias[call.out_nodes[0]])
    accepted: list[FoundAdd] = []
    pending = list(weak)
    while pending:
        done = found + accepted
        sums = {g.alias[f.out] for f in done}
        streams = {g.alias[f.stream] for f in done}
        inner = {n for f in done for n in (*f.region, *f.branches)}
        ready = []
        for out, cid, hit in pending:
            if out in inner:
                continue
            feeds = any(s in streams for s in [g.alias[out], *normed.get(g.alias[out], [])])
            skip_ok = (
                not hit.guarded
                or feeds
                or g.alias[hit.stream] in sums
                or reads_input(g, hit.stream, g.calls[cid].first_node - 1)
            )
            branch_ok = hit.weighted or feeds or _holds_norm(g, hit.region, cid, norm_calls)
            if skip_ok and branch_ok:
                ready.append((out, cid, hit))
        if not ready:
            break
        accepted += [_identity_add(g, out, cid, hit) for out, cid, hit in ready]
        pending = [p for p in pending if p not in ready]
    return accepted


def _holds_norm(g: Graph, region: set[int], cid: int, norm_calls: frozenset[int]) -> bool:
    """Whether a norm module's output lies on a branch (``region``) of an add made by call
    ``cid`` outside any norm module (a global response norm's own ``+ x`` is no residual)."""
    c: int | None = cid
    while c is not None:
        if c in norm_calls:
            return False
        c = g.calls[c].parent
    return any(g.calls[n].out_nodes[:1] and g.calls[n].out_nodes[0] in region for n in norm_calls)


def _identity(g: Graph, skip: int, branch: int) -> _Hit | None:
    """How ``branch`` is computed from what ``skip`` reads: the skip's root, or the tensor it
    slices (DPN adds its branch to the first channels of a stream the branch reads whole), or
    the tensor a learned gain or a weightless transform made the skip from."""
    for root, guarded in _skip_roots(g, skip):
        if root >= branch:
            continue
        region, frontier = g.region(branch, root)
        if root in frontier:
            # views of the stream itself (a permute or scale the branch read through) are not branch
            branch_only = {n for n in region if g.alias[n] != root}
            weighted = any(g.weight[n] for n in region)
            return _Hit(skip, branch, branch_only, region | frontier, root, weighted, guarded)
    return None


_MAX_SKIP_STEPS = 4


def _skip_roots(g: Graph, skip: int) -> Iterator[tuple[int, bool]]:
    """The tensors a skip may read the stream from, nearest first, and whether a learned gain
    or a weightless transform lies between (a slice does not count: DPN's skip)."""
    n, guarded = g.alias[skip], False
    for _ in range(_MAX_SKIP_STEPS):
        if g.op[n] in SLICE_OPS and len(g.inputs[n]) == 1 and g.floating[g.inputs[n][0]]:
            n = g.alias[g.inputs[n][0]]  # a slice of a stream, not rows picked by an index
        yield n, guarded
        source = _skip_source(g, n)
        if source is None:
            return
        n, guarded = g.alias[source], True


def _skip_source(g: Graph, n: int) -> int | None:
    """The one activation ``n`` is made from by a learned gain (a product with parameters only)
    or a weightless transform, if it is."""
    inputs = g.inputs[n]
    if len(inputs) != 1 or not g.floating[inputs[0]]:
        return None
    gain = g.op[n] in GAIN_OPS and g.uses_param[n] and not g.weight[n]
    transform = g.op[n] in SKIP_TRANSFORM_OPS and not g.uses_param[n]
    return inputs[0] if gain or transform else None


def _join(
    g: Graph, by_out: dict[int, FoundAdd], out: int, total: int, other: int
) -> FoundAdd | None:
    """``(x + a) + m`` where ``m`` also reads the stream ``x``: one add with branches a and m."""
    add = by_out.get(g.alias[total])
    if add is None or add.kind != "identity":
        return None
    hit = _identity(g, add.skip, other)
    if hit is None or not hit.weighted or hit.guarded or g.alias[total] in hit.reached:
        return None  # no further branch: it reads the sum (the next block's branch does)
    add.out = out
    add.branches.append(other)
    add.region |= hit.region
    return add


def _skip_path(g: Graph, skip: int, reached: set[int]) -> tuple[float, list[int]]:
    """The constant the skip is multiplied by after the branch read it (DeepNorm's alpha), and
    the nodes multiplying it by parameters there (a learned skip gain).

    Scaling that happened before the branch read the stream (Gemma's embedding scale) is part
    of the stream, not of the skip.
    """
    factor, gains, n = 1.0, [], skip
    while n not in reached:
        if g.alias_parent[n] != n:
            factor *= g.factor[n]
            n = g.alias_parent[n]
            continue
        source = _skip_source(g, n)
        if source is None and g.op[n] in SLICE_OPS and len(g.inputs[n]) == 1:
            source = g.inputs[n][0]
        if source is None:
            break
        if g.op[n] in GAIN_OPS:
            gains.append(n)
        n = source
    return factor, gains


def _describe(g: Graph, add: FoundAdd, streams: set[int], fed: set[int]) -> None:
    """Fill in the add's weight layers (execution order) and what its branches write;
    ``streams`` are the residual streams (roots of skips and sums), where a gate's walk ends,
    ``fed`` the nodes computed from them."""
    layers: dict[str, None] = {}
    for n in sorted(add.region):
        owner = g.owner[n]
        if g.weight[n] and owner is not None:
            layers[owner] = None
    add.layers = tuple(layers)
    add.writes = _Walk(g, add, streams, fed).run()
    # a branch without a weight is all open path (the walk may stop at complex values: FNet)
    add.writes.open_path |= not any(g.weight[n] for n in add.region)


class _Walk:
    """Walks a branch backwards from the add; each path ends at its first weight op. A gate's
    path goes on outside the branch (adaLN-Zero computes every gate of a block before its first
    add) until a weight op or a residual stream."""

    def __init__(self, g: Graph, add: FoundAdd, streams: set[int], fed: set[int]) -> None:
        self.g = g
        self.add = add
        self.streams = streams
        self.fed = fed
        self.writes = Writes()
        self.seen: dict[tuple[int, str], set[int]] = {}
        root = g.alias[add.stream]
        self.from_stream: set[int] = set()  # branch nodes computed from the stream
        for n in sorted(add.region):
            if any(g.alias[i] == root or i in self.from_stream for i in g.inputs[n]):
                self.from_stream.add(n)

    def run(self) -> Writes:
        ungated = [self.visit(b, "value") for b in self.add.branches]
        w = self.writes
        w.parallel = w.parallel or sum(bool(u) for u in ungated) >= 2
        w.writers = sorted(set(w.writers))
        w.gates = sorted(set(w.gates) - set(w.writers))
        w.conditions = sorted(set(w.conditions) & set(w.gates))
        w.scales = sorted(set(w.scales))
        return w

    def visit(self, n: int, mode: str) -> set[int]:
        """Walk from node ``n`` in ``mode`` (value, gated, gate, or inner: value behind a
        nonlinearity, whose sums are one branch's); return the ungated writers."""
        key = (n, mode)
        if key in self.seen:
            return self.seen[key]
        self.seen[key] = set()
        g, w = self.g, self.writes
        if n not in self.add.region:
            if mode != "gate" and g.alias[n] == g.alias[self.add.stream]:
                w.open_path = True
            if mode != "gate" or g.alias[n] in self.streams:
                return set()
        found = self._weight_op(n, mode) if g.weight[n] else self._through(n, mode)
        self.seen[key] = found
        return found

    def _weight_op(self, n: int, mode: str) -> set[int]:
        """A weight op met in ``mode``: a gate, or a writer (ungated unless routed)."""
        if mode == "gate":
            self.writes.gates.append(n)
            return set()
        self.writes.writers.append(n)
        return {n} if mode == "value" and not self._routed_input(n) else set()  # not "inner"

    def _through(self, n: int, mode: str) -> set[int]:
        """The ungated writers behind a weightless op: a gated product, a sum of two branches,
        a layer scale or any other op, walked on into its activation inputs."""
        g, w = self.g, self.writes
        acts = [i for i in g.inputs[n] if g.act[i] and g.floating[i]]  # not index tensors
        found: set[int] = set()
        if g.op[n] in SCALE_OPS and len(acts) == 2 and mode != "gate":
            gate = self._gate_side(n, acts)
            for i in acts:
                side = "gate" if i == gate else ("gated" if gate is not None else mode)
                if side == "value" and g.op[n] in _DIVISIONS and i == acts[1]:
                    side = "inner"  # a divisor: nonlinear in what it is computed from
                before = len(w.gates)
                found |= self.visit(i, side)
                if i == gate and i not in self.fed:
                    w.conditions += w.gates[before:]
        elif g.op[n] in ADD_OPS and len(acts) == 2 and mode != "gate":
            sides = [self.visit(i, mode) for i in acts]
            branches = sum(bool(s) for s in sides) >= 2 and not linear_sum(g, n)
            if branches and not g.skip_inside(*acts):
                w.parallel = True
            found = sides[0] | sides[1]
        else:
            if g.uses_param[n] and g.op[n] in SCALE_OPS and mode != "gate":
                w.scales.append(n)
            inner = "inner" if mode == "value" and g.op[n] in NONLINEAR_OPS else mode
            for i in acts:
                found |= self.visit(i, inner)
        return found

    def _routed_input(self, writer: int) -> bool:
        """Whether the module applying ``writer`` was called on an input scaled per row by a
        factor a weight op computed (Llama 4 scales its experts' input by the router's scores):
        that factor gates the writer as one on its output would."""
        g = self.g
        cid = g.call[writer]
        for i in g.calls[cid].in_nodes if cid is not None else []:
            n = g.alias[i]
            acts = [j for j in g.inputs[n] if g.act[j] and g.floating[j]]
            if n not in self.add.region or g.op[n] not in SCALE_OPS or len(acts) != 2:
                continue
            gate = self._gate_side(n, acts)
            if gate is None or math.prod(g.shape[acts[0]]) == math.prod(g.shape[acts[1]]):
                continue  # equal sizes: a gated linear unit's halves, not a router's weights
            before = len(self.writes.gates)
            self.visit(gate, "gate")
            if len(self.writes.gates) > before:
                return True
        return False

    def _gate_side(self, n: int, acts: list[int]) -> int | None:
        """Of two factors of a product, the one that gates the other, if either does: the one
        not computed from the stream, else the smaller, else a sigmoid's or softmax's output."""
        g = self.g
        root = g.alias[self.add.stream]
        from_stream = [i in self.from_stream or g.alias[i] == root for i in acts]
        if from_stream[0] != from_stream[1]:
            return acts[1] if from_stream[0] else acts[0]
        size = [math.prod(g.shape[i]) for i in acts]
        if size[0] != size[1]:
            return acts[0] if size[0] < size[1] else acts[1]
        gating = [g.op[g.exact[i]] in GATE_OPS or g.op[i] in GATE_OPS for i in acts]
        if gating[0] != gating[1]:
            return acts[0] if gating[0] else acts[1]
        return None
