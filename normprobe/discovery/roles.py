"""Each norm's role (pre, post, sandwich-post, qk, final, branch) from the dataflow around the
residual adds, never from the kind of shortcut or where the norm module sits."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from .graph import Graph
from .model_map import NormLayer, NormRole
from .ops import MATMUL_OPS, SCALE_OPS, SDPA_OPS, SOFTMAX_OPS
from .residual import FoundAdd
from .scene import Scene

# by add: "pre_norm" / "post_norm" / "sandwich_norm" / "end_norm" (the branch's last) -> path
AddNorms = dict[int, dict[str, str]]


@dataclass
class _Flow:
    """Where values stand relative to the adds: by node (the root through views)."""

    stream_of: dict[int, list[int]]  # a stream value -> the adds it enters
    sum_of: dict[int, int]  # an add's output -> the add
    branch_of: dict[int, int]  # a branch output (also before a layer scale) -> its add
    forks_of: dict[int, list[int]]  # a projection add's fork, or what it was activated from


def norm_roles(scene: Scene, norms: dict[str, NormLayer]) -> tuple[dict[str, NormRole], AddNorms]:
    """The role of each norm that has one, and the norms around each add (by add index)."""
    roles: dict[str, NormRole] = {}
    add_norms: AddNorms = {}
    g = scene.g
    if g is None:
        return roles, add_norms
    io = _norm_io(scene, norms)
    flow = _flow(g, scene.adds)
    # pre norms first: sandwich-post needs to know whether the branch has one
    _find_pre_norms(scene, io, flow, roles, add_norms)
    _find_other_roles(scene, io, flow, roles, add_norms)
    _roles_at_every_run(g, scene.adds, flow, roles, add_norms)
    return roles, add_norms


def _norm_io(scene: Scene, norms: dict[str, NormLayer]) -> dict[str, tuple[int, int]]:
    """Each norm's first floating-point input (its root) and output, at its first call."""
    g = scene.graph
    io: dict[str, tuple[int, int]] = {}
    for path in norms:
        cid = scene.first_call.get(path)
        if cid is None:
            continue
        call = g.calls[cid]
        if call.in_nodes and call.out_nodes:
            io[path] = (g.alias[call.in_nodes[0]], call.out_nodes[0])
    return io


def _flow(g: Graph, adds: list[FoundAdd]) -> _Flow:
    stream_of: dict[int, list[int]] = {}
    forks_of: dict[int, list[int]] = {}
    for i, a in enumerate(adds):
        stream_of.setdefault(g.alias[a.stream], []).append(i)
        if a.kind == "projection":
            for n in _activated_from(g, a.stream):
                forks_of.setdefault(n, []).append(i)
    return _Flow(
        stream_of=stream_of,
        sum_of={a.out: i for i, a in enumerate(adds)},
        branch_of={
            n: i for i, a in enumerate(adds) for b in a.branches for n in _before_scales(g, b)
        },
        forks_of=forks_of,
    )


def _find_pre_norms(
    scene: Scene,
    io: dict[str, tuple[int, int]],
    flow: _Flow,
    roles: dict[str, NormRole],
    add_norms: AddNorms,
) -> None:
    """A pre norm reads the stream an add's branch reads and feeds that branch; in front of a
    projection shortcut, in the add's own block, its output (or its activation) may be what
    both sides read, unless it closes an earlier add of that block (Post-LN's LN(x + f(x))
    before TSMixerx's projected feature mixing)."""
    g, adds = scene.graph, scene.adds
    for path, (inp, out) in io.items():
        reading = [i for i, a in enumerate(adds) if out in a.region]
        forked = flow.forks_of.get(g.alias[out], [])
        for i in flow.stream_of.get(inp, []) + forked + reading:
            fork = (
                i in forked
                and scene.where(path) == scene.add_where[i]
                and not _closes_block_add(scene, io, flow, path)
            )
            if fork or (out in adds[i].region and _reads_stream(g, adds[i], inp, flow)):
                roles[path] = "pre"
                add_norms.setdefault(i, {})["pre_norm"] = path
                break


def _reads_stream(g: Graph, a: FoundAdd, inp: int, flow: _Flow) -> bool:
    """Whether a norm reading ``inp`` reads add ``a``'s stream itself, or with other tokens
    joined to it (class attention), not through another add's sum (a Post-LN block nested
    in ``a``'s branch normalizes its own stream: TFT's gated residual networks)."""
    stream = g.alias[a.stream]
    return inp == stream or _plain_path(g, stream, inp, flow.sum_of)


def _closes_block_add(scene: Scene, io: dict[str, tuple[int, int]], flow: _Flow, path: str) -> bool:
    """Whether the norm at ``path`` reads the sum of an add of its own block that no norm
    reads the stream of: a Post-LN norm, not a pre norm of what follows."""
    g = scene.graph
    j = flow.sum_of.get(io[path][0])
    if j is None or scene.add_where[j] != scene.where(path):
        return False
    a = scene.adds[j]
    return not any(out in a.region and _reads_stream(g, a, inp, flow) for inp, out in io.values())


def _find_other_roles(
    scene: Scene,
    io: dict[str, tuple[int, int]],
    flow: _Flow,
    roles: dict[str, NormRole],
    add_norms: AddNorms,
) -> None:
    """The roles of the norms that are not pre norms."""
    g, adds = scene.graph, scene.adds
    readers = {inp: path for path, (inp, _) in io.items() if path not in roles}
    pre_normed = ["pre_norm" in add_norms.get(i, {}) for i in range(len(adds))]
    scores_from = _feeding_scores(g)
    in_branch = set().union(*(a.region for a in adds)) if adds else set()
    for path, (inp, out) in io.items():
        if path in roles:
            continue
        if g.alias[out] in flow.branch_of:
            i = flow.branch_of[g.alias[out]]
            add_norms.setdefault(i, {})["end_norm"] = path
            if "pre_norm" in add_norms[i]:
                roles[path] = "sandwich-post"
                add_norms[i]["sandwich_norm"] = path
            else:
                roles[path] = "branch"
        elif inp in flow.sum_of and (
            role := _after_sum(scene, path, flow.sum_of[inp], readers, pre_normed)
        ):
            roles[path] = role
            if role == "post":
                add_norms.setdefault(flow.sum_of[inp], {})["post_norm"] = path
        elif out in scores_from:
            roles[path] = "qk"
        elif _follows_stack(scene, path, inp):
            roles[path] = "final"
        elif out in in_branch or inp in in_branch:
            roles[path] = "branch"


def _roles_at_every_run(
    g: Graph, adds: list[FoundAdd], flow: _Flow, roles: dict[str, NormRole], add_norms: AddNorms
) -> None:
    """A norm run several times (a block shared across depth) plays its role at every run."""
    for call in g.calls:
        role = roles.get(call.path)
        if role is None or call.index == 0 or not (call.in_nodes and call.out_nodes):
            continue
        inp, out = g.alias[call.in_nodes[0]], call.out_nodes[0]
        if role == "post" and inp in flow.sum_of:
            add_norms.setdefault(flow.sum_of[inp], {}).setdefault("post_norm", call.path)
        elif role in ("sandwich-post", "branch") and g.alias[out] in flow.branch_of:
            norms = add_norms.setdefault(flow.branch_of[g.alias[out]], {})
            norms.setdefault("end_norm", call.path)
            if role == "sandwich-post":
                norms.setdefault("sandwich_norm", call.path)
        elif role == "pre":
            for i in flow.stream_of.get(inp, []):
                if out in adds[i].region:
                    add_norms.setdefault(i, {}).setdefault("pre_norm", call.path)


def _after_sum(
    scene: Scene, norm: str, i: int, readers: dict[int, str], pre_normed: list[bool]
) -> NormRole | None:
    """The role of a norm reading add ``i``'s sum, when nothing else reads it (else the
    stream goes on around the norm): ``post`` wherever it sits, except after
    a stack's last add when the same add of most other blocks has no norm on its sum (one
    block without, as a first sublayer left unnormalized, does not decide): then it closes
    the stack (``final``) if it sits in the stack's last block or in no block the stack is not
    in, and belongs to what follows (a downsample) otherwise."""
    if _bypassed(scene, scene.adds[i].out, norm):
        return None  # the stream goes on around the norm: it does not normalize the sum
    stack, block = scene.add_where[i]
    if stack is None and pre_normed[i]:
        return None  # one Pre-LN block: the norm after it closes the model, not the block
    if stack is None:
        return "post"
    mine = [j for j, (s, _) in enumerate(scene.add_where) if s == stack]
    if mine[-1] != i:
        return "post"
    position = [j for j in mine if scene.add_where[j][1] == block].index(i)
    others = {b for _, b in (scene.add_where[j] for j in mine) if b != block}
    following = 0
    for b in others:
        same = [j for j in mine if scene.add_where[j][1] == b]
        if position < len(same) and scene.adds[same[position]].out in readers:
            following += 1
    if 2 * following > len(others):  # most blocks normalize this sum: the last one too
        return "post"
    if scene.inside(norm, stack):  # the last block's own (timm's SwinV2-CR extra_norm)
        return "final"
    return "final" if scene.around(norm) <= scene.around_stack(stack) else None


def _bypassed(scene: Scene, total: int, norm: str) -> bool:
    """Whether something besides the norm at ``norm`` reads the sum ``total`` (or a view of
    it): then the stream continues around the norm."""
    g = scene.graph
    call = g.calls[scene.first_call[norm]]
    todo, seen = [total], {total}
    while todo:
        for c in scene.readers().get(todo.pop(), []):
            if call.first_node <= c < call.end_node or c in seen:
                continue
            if g.alias[c] != g.alias[total]:
                return True
            seen.add(c)
            todo.append(c)
    return False


def _follows_stack(scene: Scene, norm: str, inp: int) -> bool:
    """A norm downstream of a stack's last sum with no weight op between (a pooled stream,
    not a head's conv), in no block the stack is not in."""
    g = scene.graph
    last: dict[str, int] = {}
    for (stack, _), a in zip(scene.add_where, scene.adds, strict=True):
        if stack is not None:
            last[stack] = max(last.get(stack, -1), a.out)
    outer = scene.around(norm)
    for stack, end in last.items():
        if outer <= scene.around_stack(stack) and inp >= end and _plain_path(g, end, inp):
            return True
    return False


def _feeding_scores(g: Graph) -> set[int]:
    """Nodes that reach an attention score (q·k) without passing a weight op: a norm there
    normalizes queries or keys. Of fused attention, the query and key count; a product of
    attention weights (a softmax's output) and values is no score."""
    todo: list[int] = []
    for n, op in enumerate(g.op):
        inputs = g.inputs[n]
        if op in SDPA_OPS:
            todo += inputs[:2]
        elif op in MATMUL_OPS and not g.weight[n] and len(inputs) >= 2 and not _weighs(g, inputs):
            todo += inputs
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not g.weight[n]:
            todo.extend(g.inputs[n])
    return seen


def _weighs(g: Graph, inputs: tuple[int, ...]) -> bool:
    """Whether a product of ``inputs`` applies attention weights (a softmax's output, through
    views and dropout) to values."""
    return any(g.op[g.alias[i]] in SOFTMAX_OPS for i in inputs)


def _before_scales(g: Graph, node: int) -> list[int]:
    """The roots (through views) of ``node`` and of what it was computed from through layer
    scales (elementwise multiplies by a parameter): a norm there still ends the branch."""
    chain = [g.alias[node]]
    while g.op[chain[-1]] in SCALE_OPS and g.uses_param[chain[-1]]:
        inputs = [i for i in g.inputs[chain[-1]] if g.floating[i]]
        if len(inputs) != 1:
            break
        chain.append(g.alias[inputs[0]])
    return chain


def _activated_from(g: Graph, node: int) -> list[int]:
    """The root (through views) of ``node`` and the roots it was computed from by weightless
    elementwise ops of one input (activations): a norm's output there feeds ``node``."""
    chain = [g.alias[node]]
    while True:
        n = chain[-1]
        inputs = [i for i in g.inputs[n] if g.floating[i]]
        if len(inputs) != 1 or g.weight[n] or g.uses_param[n] or g.shape[n] != g.shape[inputs[0]]:
            return chain
        chain.append(g.alias[inputs[0]])


def _plain_path(g: Graph, start: int, end: int, stops: Container[int] = ()) -> bool:
    """Whether node ``end`` derives from ``start`` on a path through no weight op (and no
    node of ``stops`` but ``start``)."""
    todo, seen = [end], set()
    while todo:
        n = todo.pop()
        if n == start:
            return True
        if n < start or n in seen or g.weight[n] or n in stops:
            continue
        seen.add(n)
        todo.extend(g.inputs[n])
    return False
