"""Each residual add as the map shows it: the stack and block it belongs to, its writers and
gates, the norms around it, and where its output can be read on every step."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .graph import Graph
from .model_map import Anchor, Doubt, NormLayer, ResidualAdd
from .ops import ADD_OPS
from .residual import FoundAdd
from .scene import Scene, Where, within


def add_where(scene: Scene, a: FoundAdd) -> Where:
    """The stack and block of an add: the innermost block holding its last writer (else
    the module performing it) that also holds that module, if one does: not a stack
    inside its own branch (HGNet's aggregation chain); else, for a parent performing its
    blocks' adds (x-transformers), the innermost block holding the last writer whose stack
    holds no other writer in another block: writers across a stack's blocks make a skip
    around that stack (compressai's AttentionBlock), no add of it. A repeated block's index
    is the run it happened in."""
    g = scene.graph
    module = g.calls[a.call].path
    writers = [g.owner[n] or "" for n in a.writes.writers]
    anchor = writers[-1] if writers and scene.blocks_of(writers[-1]) else module
    found = scene.blocks_of(anchor or "")
    # a repeated block's stack lists that one block once per run
    holding = [(s, i) for s, i in found if within(module, scene.stack_blocks(s)[i or 0])]
    single = [(s, i) for s, i in found if _blocks_with(scene, writers, s) <= {i}]
    if not holding and not single:
        return None, None
    stack, index = holding[0] if holding else single[0]
    if index is None:  # a repeated block: count its runs up to this add
        block = scene.stack_blocks(stack)[0]
        start = g.call[a.writes.writers[-1]] if a.writes.writers else a.call
        c: int | None = start
        while c is not None and g.calls[c].path != block:
            c = g.calls[c].parent
        index = g.calls[c].index if c is not None else None
    return stack, index


def _blocks_with(scene: Scene, writers: list[str], stack: str) -> set[int | None]:
    """The blocks of ``stack`` holding one of ``writers``."""
    return {i for w in writers for s, i in scene.blocks_of(w) if s == stack}


def map_add(
    scene: Scene,
    i: int,
    ordinal: int,
    norms: dict[str, str],
    norm_layers: list[NormLayer],
) -> ResidualAdd:
    """The `ResidualAdd` of add ``i``, the ``ordinal``-th of its module's call, with the
    ``norms`` around it (``pre_norm``, ``post_norm``, ``sandwich_norm``, ``end_norm``)."""
    g = scene.graph
    a = scene.adds[i]
    call = g.calls[a.call]
    w = a.writes
    writers = tuple(dict.fromkeys(o for n in w.writers if (o := g.owner[n]) is not None))
    params = tuple(dict.fromkeys(q for n in w.writers for q in g.weight[n]))
    writers, params = _with_unrouted(scene, call.path, writers, params)
    norm_paths = {n.path for n in norm_layers}
    # a norm's own gain is no layer scale, under any of the norm's names
    scales = tuple(
        dict.fromkeys(
            q
            for n in w.scales
            if not any(_parent(q) in norm_paths for q in g.param_src[n])
            for q in _canonical(g, n)
        )
    )
    gates = tuple(
        dict.fromkeys(o for n in w.gates if (o := g.owner[n]) is not None and o not in writers)
    )
    conditions = {o for n in w.conditions if (o := g.owner[n]) is not None}
    stack, block = scene.add_where[i]
    return ResidualAdd(
        module=call.path,
        call=call.index,
        ordinal=ordinal,
        kind="identity" if a.kind == "identity" else "projection",
        stack=stack,
        block=block,
        branch_out=writers[0] if len(writers) == 1 else None,
        branch_layers=a.layers,
        skip_scale=a.skip_scale,
        skip_gain=next((q for n in a.skip_gains for q in _canonical(g, n)), None),
        pre_norm=norms.get("pre_norm"),
        post_norm=norms.get("post_norm"),
        sandwich_norm=norms.get("sandwich_norm"),
        end_norm=norms.get("end_norm"),
        anchor=_anchor(scene, a),
        writers=writers,
        writer_params=params,
        gates=gates,
        condition_gates=tuple(o for o in gates if o in conditions),
        scales=scales,
        parallel=w.parallel,
        open_path=w.open_path,
    )


def unattached_writers(scene: Scene, adds: list[ResidualAdd]) -> list[Doubt]:
    """A doubt for each weight layer whose output is added into a residual stream, with no
    weight op between, by no residual add that names it a writer or a gate."""
    g = scene.graph
    attached = {p for a in adds for p in (*a.writers, *a.gates)}
    streams = {g.alias[n] for a in scene.adds for n in (a.stream, a.out)}
    skips = {a.skip for a in scene.adds}
    shortcuts = {g.alias[n] for n in skips}  # a projection's layer, also scaled (EDM2's MPAdd)
    found: dict[str, None] = {}
    for n, owner in enumerate(g.owner):
        candidate = (
            g.weight[n]
            and owner is not None
            and owner not in attached
            and owner not in found
            and g.alias[n] not in shortcuts
        )
        if candidate and g.alias[n] not in streams and _writes_stream(scene, n, streams, skips):
            found[owner or ""] = None
    return [
        Doubt(
            "unattached-writer",
            path,
            f"{path or '<root>'} adds its output into the residual stream, but no residual "
            "add found names it a writer, so reinit would not scale it as one; "
            "re-initialize it yourself, or leave reinit to a scheme without residual branches",
            ("reinit",),
        )
        for path in found
    ]


def _writes_stream(scene: Scene, node: int, streams: set[int], skips: set[int]) -> bool:
    """Whether ``node``'s value reaches, through no weight op, an add making a stream value
    whose other operand is a stream value, a skip or an input of the module adding. A value
    that becomes the stream itself (a stem, token plus position embeddings) writes nothing
    into it."""
    g = scene.graph
    readers = scene.readers()
    todo, seen = [node], {node}
    while todo:
        n = todo.pop()
        for c in readers.get(n, []):
            if c in seen or g.weight[c]:
                continue
            seen.add(c)
            if g.alias[c] not in streams:
                todo.append(c)
                continue
            call = g.call[c]
            entering = {g.alias[i] for i in g.calls[call].in_nodes} if call is not None else set()
            others = [i for i in g.inputs[c] if i != n]
            if g.op[c] in ADD_OPS and any(
                g.alias[i] in streams | entering or i in skips for i in others
            ):
                return True
    return False


def _with_unrouted(
    scene: Scene, module: str, writers: tuple[str, ...], params: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Writers (and their parameters) with the experts the traced forward routed no token
    to: a writer in one member of a ModuleList or ModuleDict (the innermost holding it)
    inside the add's ``module`` stands for the same layer in each member of its class
    that never ran."""
    names = dict(scene.model.named_modules())
    more: dict[str, None] = {}
    for w in writers:
        container, member, rest = next(
            (split for split in _member_paths(w) if _is_list(names.get(split[0]))),
            ("", "", ""),
        )
        if not container or not within(container, module):
            continue
        kind = type(names[f"{container}.{member}"])
        for key, sibling in names[container].named_children():
            path = f"{container}.{key}"
            if type(sibling) is kind and path not in scene.first_call:
                more[f"{path}{rest}"] = None
    extra = tuple(p for p in more if p in names and p not in writers)
    if not extra:
        return writers, params
    scene.notes.append(
        f"{len(extra)} layers of experts that no token reached in the traced forward "
        f"counted as writers like the ones that ran ({extra[0]}, ...)"
    )
    held = {p: tuple(n for n, _ in names[p].named_parameters()) for p in extra}
    own = [q for q in params if any(q.startswith(f"{w}.") for w in writers)]
    suffixes = dict.fromkeys(q.rpartition(".")[2] for q in own)
    extra_params = tuple(f"{p}.{a}" for p in extra for a in suffixes if a in held[p])
    return writers + extra, params + extra_params


def _anchor(scene: Scene, a: FoundAdd) -> Anchor:
    """The first module boundary that shows the add's output, else the add itself inside
    the forward that computed it."""
    g = scene.graph
    best = None
    for node, event in scene.seen_at(a.out):
        if node >= a.out and (best is None or event < best):
            best = event
    if best is None:  # only the forward that computed it sees it: count adds there
        call = g.calls[a.call]
        return Anchor("inside", call.path, call.index, (g.add_order[a.out],))
    _, hook, cid, key = best
    call = g.calls[cid]
    return Anchor("pre" if hook == "pre" else "post", call.path, call.index, key)


def _member_paths(path: str) -> Iterator[tuple[str, str, str]]:
    """(container, member, rest) for each split of ``path`` at a dot, innermost first:
    ``a.experts.3.w2`` gives ``("a.experts", "3", ".w2")``, then ``("a", "experts", ".3.w2")``."""
    parts = path.split(".")
    for i in range(len(parts) - 2, 0, -1):
        yield ".".join(parts[:i]), parts[i], "".join(f".{p}" for p in parts[i + 1 :])


def _is_list(m: nn.Module | None) -> bool:
    return isinstance(m, nn.ModuleList | nn.ModuleDict)


def _canonical(g: Graph, node: int) -> tuple[str, ...]:
    """The names of the parameters ``node`` reads as the module applying them holds them (a
    block registered under two names goes by its first, as writers do)."""
    names = g.param_src[node]
    held = tuple(q for q in names if _parent(q) == g.owner[node])
    return held or names[:1]


def _parent(qualified: str) -> str:
    return qualified.rpartition(".")[0]


def fused_skips(scene: Scene) -> list[Doubt]:
    """A doubt for each weight layer that adds an activation to its product in one op: its
    output holds a skip, so it is no branch's last layer to scale or zero."""
    g = scene.graph
    owners = dict.fromkeys(g.owner[n] for n in g.fused_skips if g.owner[n] is not None)
    return [
        Doubt(
            "fused-skip",
            path or "",
            f"{path or '<root>'} adds an activation to its weight product in one op "
            "(addmm(h, h, W)): a skip and a branch in one output, which reinit cannot tell "
            "apart; re-initialize it yourself",
            ("reinit",),
        )
        for path in owners
    ]
