"""Which modules are stacks of blocks: containers of repeated blocks the traced residual adds
confirm, sublayers told apart from blocks, stretches of adds no container holds, and how the
norms of each stack sit around its adds."""

from __future__ import annotations

import itertools
from functools import partial

from torch import nn

from .model_map import (
    Doubt,
    ModelMap,
    NormLayer,
    NormPlacement,
    NormRole,
    Placement,
    ResidualAdd,
    Stack,
)
from .residual import FoundAdd
from .scene import Scene, within
from .stacks import (
    FoundStack,
    common_path,
    executed_stacks,
    grouped_sublayers,
    structural_stacks,
    unpacked_stacks,
)

_CONTAINERS = nn.ModuleList | nn.Sequential | nn.ModuleDict


def find_stacks(scene: Scene) -> list[FoundStack]:
    """The model's stacks in execution order; without a traced forward, the containers of
    one class that the module tree alone shows."""
    if scene.g is None:
        return [s for s in structural_stacks(scene.model) if s.generic]
    sums = sorted(a.out for a in scene.adds)
    found = executed_stacks(
        structural_stacks(scene.model),
        scene.g,
        partial(_holds_add, scene),
        sums,
        partial(_sublayers, scene),
    )
    found = _off_stream(scene, found)
    found = [
        grouped_sublayers(s, scene.model, [_adds_in_block(scene, b) for b in s.blocks])
        for s in _without_lone_sublayers(scene, found)
        if not _inside_one_branch(scene, s)
    ]
    return _with_unpacked(scene, found)


def _off_stream(scene: Scene, found: list[FoundStack]) -> list[FoundStack]:
    """``found`` without the runs of blocks no list of one class holds (a plain module's
    children, a stretch of a mixed Sequential) whose adds stand on separate streams: where
    consecutive blocks both make residual adds of their own, no run of adds goes from one
    into the next (YOLO's C3k2 modules across its neck, joined by an upsampling and a
    concatenation, each adding inside its Bottleneck). One such step suffices: a projection
    shortcut starts a run at each stage of a flat list of blocks (DPN's). Adds inside a block
    of another stack within them are not their own: stages (RegNet's) stay stacks."""
    at = {i: (r, k) for r, run in enumerate(scene.runs) for k, i in enumerate(run)}
    inner = {b for s in found for b in s.blocks}

    def own(block: str) -> list[int]:
        nested = [b for b in inner if b.startswith(block + ".")]
        return [
            i
            for i, a in enumerate(scene.adds)
            if add_within(scene, a, block) and not any(add_within(scene, a, b) for b in nested)
        ]

    def continues(first: list[int], then: list[int]) -> bool:
        return any(at[i][0] == at[j][0] and at[i][1] < at[j][1] for i in first for j in then)

    kept = []
    for s in found:
        if not (s.generic or s.mixed or s.repeated):
            adds = [own(b) for b in s.blocks]
            steps = [continues(a, b) for a, b in itertools.pairwise(adds) if a and b]
            if steps and not any(steps):
                continue
        kept.append(s)
    return kept


def _inside_one_branch(scene: Scene, s: FoundStack) -> bool:
    """Whether the blocks of candidate ``s`` perform no add and every weight layer in them is
    on one residual add's branch: the sublayers of that branch (MONAI's ResidualUnit runs its
    conv units as an ``nn.Sequential``), not a stack of their own."""
    calls = scene.graph.calls
    if s.repeated or any(within(calls[a.call].path, b) for a in scene.adds for b in s.blocks):
        return False  # a module run N times (ALBERT) spans N adds' branches
    layers = {w for w in scene.weight_layers if any(within(w, b) for b in s.blocks)}
    return bool(layers) and any(layers <= set(a.layers) for a in scene.adds)


def _holds_add(scene: Scene, block: str) -> bool:
    """Whether a residual add happens inside ``block``, or wraps exactly it (the stream
    enters the block and every writer is inside: ``x = x + block(x)`` in a parent's loop)."""
    g = scene.graph
    calls = [c for c in g.calls if c.path == block]
    inputs = {g.alias[n] for c in calls for n in c.in_nodes}
    for a in scene.adds:
        if within(g.calls[a.call].path, block):
            return True
        writers = [g.owner[n] or "" for n in a.writes.writers]
        inside = bool(writers) and all(within(w, block) for w in writers)
        if inside and g.alias[a.stream] in inputs:
            return True
    return False


def _adds_in_block(scene: Scene, block: str) -> int:
    """How many residual adds ``block`` performs or holds every writer of."""
    return sum(add_within(scene, a, block) for a in scene.adds)


def add_within(scene: Scene, a: FoundAdd, block: str) -> bool:
    """Whether ``block`` performs add ``a`` or holds every one of its writers."""
    g = scene.graph
    writers = [g.owner[n] or "" for n in a.writes.writers]
    return within(g.calls[a.call].path, block) or (
        bool(writers) and all(within(w, block) for w in writers)
    )


def _sublayers(scene: Scene, s: FoundStack, nested: bool) -> bool:
    """Whether the blocks of candidate ``s`` are a block's sublayers: a run of residual
    adds goes on past the last of them, into the next entry of the list whose entry holds
    them, and they are of several classes, or of one class beside another inside another
    stack's block (MaxViT's MBConv, window and grid attention; or on within that block:
    ``nn.TransformerDecoderLayer``'s two attentions, then its feed-forward); or into
    another entry, never called, of a list holding the run (``for attn, ff in
    self.layers``)."""
    inside = {i for i, a in enumerate(scene.adds) if any(add_within(scene, a, b) for b in s.blocks)}
    following: list[tuple[list[int], int]] = []  # (run, the add after the last inside)
    for run in scene.runs:
        last = max((k for k, i in enumerate(run) if i in inside), default=len(run))
        if last + 1 < len(run):
            following.append((run, run[last + 1]))
    beside = not s.generic and nested and "[" in s.path  # beside a block of another class
    if s.mixed or beside:
        return _runs_past_entry(scene, s, [j for _, j in following], beside)
    return _runs_into_uncalled_entry(scene, s, [run for run, _ in following])


def _runs_past_entry(scene: Scene, s: FoundStack, following: list[int], beside: bool) -> bool:
    """Whether one of the adds ``following`` the candidate's is made in the entry's parent
    but outside the list entry holding the candidate's blocks (or, ``beside`` another
    block's class, within that entry)."""
    entry = _entry(common_path(s.blocks), dict(scene.model.named_modules()))
    if entry is None:
        return False
    parent = entry.rpartition(".")[0]
    return any(
        (
            (not parent or add_within(scene, scene.adds[j], parent))
            and not add_within(scene, scene.adds[j], entry)
        )
        # or on within the same block: torch's TransformerDecoderLayer's self- and
        # cross-attention, then its feed-forward add
        or (beside and add_within(scene, scene.adds[j], entry))
        for j in following
    )


def _runs_into_uncalled_entry(scene: Scene, s: FoundStack, runs: list[list[int]]) -> bool:
    """Whether one of ``runs`` goes on in a ModuleList holding the candidate's blocks whose
    entry holding them was never called (``for attn, ff in self.layers``)."""
    modules = dict(scene.model.named_modules())
    held = common_path(s.blocks)
    for run in runs:
        homes = [home(scene, scene.adds[i]) for i in run]
        container = common_path([h for h in homes if h is not None])
        if not isinstance(modules[container], nn.ModuleList) or not within(held, container):
            continue
        entry = ".".join(held.split(".")[: len(container.split(".")) + 1])
        if held != container and entry not in scene.first_call:
            return True
    return False


def _without_lone_sublayers(scene: Scene, found: list[FoundStack]) -> list[FoundStack]:
    """Drop the mixed containers and plain modules' runs held by a block that is no
    stack's block but of a class other stacks have as blocks: the sublayers of a block
    alone in its stage (a MaxViT stage of one layer), not a stack of their own."""
    modules = dict(scene.model.named_modules())
    blocks = {b for s in found for b in s.blocks}
    classes = {type(modules[b]) for s in found if s.generic and not s.repeated for b in s.blocks}

    def lone(s: FoundStack) -> bool:
        holder = s.path.rpartition(".")[0] if s.mixed else s.path.partition("[")[0]
        module = modules.get(holder)
        return (
            holder not in blocks and type(module) in classes and not isinstance(module, _CONTAINERS)
        )

    return [s for s in found if s.generic or not lone(s)]


def _with_unpacked(scene: Scene, found: list[FoundStack]) -> list[FoundStack]:
    """``found`` and the stacks of the stretches of runs no block of them holds, in
    execution order."""
    g = scene.graph
    blocks = [b for s in found for members in s.members or [s.blocks] for b in members]
    held = [any(add_within(scene, a, b) for b in blocks) for a in scene.adds]
    stretches: list[list[int]] = []
    for run in scene.runs:
        for i, previous in zip(run, [None, *run], strict=False):
            if held[i]:
                continue
            if previous is None or held[previous]:
                stretches.append([])
            stretches[-1].append(i)
    homes = [home(scene, a) for a in scene.adds]
    keyed = [(g.calls[scene.first_call[s.blocks[0]]].first_node, s) for s in found]
    keyed += unpacked_stacks(scene.model, scene.adds, stretches, homes)
    return [s for _, s in sorted(keyed, key=lambda item: item[0])]


def home(scene: Scene, a: FoundAdd) -> str | None:
    """The innermost module holding every writer of ``a`` (its weight layers, without)."""
    g = scene.graph
    paths = [g.owner[n] or "" for n in a.writes.writers] or list(a.layers)
    return common_path(paths) if paths else None


def _entry(path: str, modules: dict[str, nn.Module]) -> str | None:
    """The innermost module holding ``path`` (or ``path`` itself) that a list holds."""
    while path:
        parent = path.rpartition(".")[0]
        if isinstance(modules[parent], _CONTAINERS):
            return path
        path = parent
    return None


def map_stack(
    scene: Scene, s: FoundStack, norms: list[NormLayer], adds: list[ResidualAdd]
) -> Stack:
    """The `Stack` of ``s``: its placement from the roles of the norms around its adds."""
    mine = [a for a in adds if a.stack == s.path or scene.inside(a.module, s.path)]
    by_path = {n.path: n for n in norms}
    roles = {n.role for n in norms if scene.inside(n.path, s.path)}
    for a in mine:
        for p in (a.pre_norm, a.post_norm, a.sandwich_norm):
            if p is not None:
                roles.add(by_path[p].role)
    norm_placement = _norm_placement(roles, mine)
    own = [a for a in adds if a.stack == s.path]
    placement: Placement = "parallel" if any(a.parallel for a in own) else norm_placement
    parent = next((stack for stack, _ in scene.blocks_of(s.blocks[0]) if stack != s.path), None)
    return Stack(
        s.path,
        tuple(s.blocks),
        s.block_type,
        placement,
        "qk" in roles,
        parent,
        norm_placement=norm_placement,
        repeated=s.repeated,
        members=tuple(tuple(m) for m in s.members or ()),
    )


def _norm_placement(roles: set[NormRole], adds: list[ResidualAdd]) -> NormPlacement:
    """How the norms of these ``roles`` sit around a stack's ``adds``."""
    if not adds and roles <= {"other"}:  # no add, and no norm of another stack's adds
        return "no-residual"
    if "post" in roles and "pre" in roles:
        return "mixed"
    if "post" in roles:
        return "deepnorm" if any(a.skip_scale > 1 + 1e-6 for a in adds) else "post-ln"
    if "pre" in roles:
        return "sandwich" if "sandwich-post" in roles else "pre-ln"
    if roles & {"branch", "sandwich-post"}:
        return "in-branch"
    return "no-norm"


def nested_doubts(scene: Scene, m: ModelMap) -> list[Doubt]:
    """Stacks holding stacks whose blocks one run of adds crosses (the outer blocks stand
    along the same stream as the inner ones, so either count could be the depth), or some
    of whose blocks make adds of their own beside blocks holding stacks (a stage of one
    block, whose N would be the number of stages)."""
    found = []
    inner = {s.parent for s in m.stacks if s.parent is not None}
    anchors = [a.writers[-1] if a.writers else a.module for a in m.residual_adds]
    for outer in (s for s in m.stacks if s.path in inner):
        index = [next((i for s, i in scene.blocks_of(p) if s == outer.path), None) for p in anchors]
        crossed = any(len({index[i] for i in run} - {None}) > 1 for run in scene.runs)
        # a stage of one block (DaViT's depths 1, 1, 3, 1): its adds fall to the outer stack
        # and would count its blocks as N, where the other stages count their own blocks
        direct = not outer.repeated and any(a.stack == outer.path for a in m.residual_adds)
        if not (crossed or direct):
            continue
        held = [a for a, i in zip(m.residual_adds, index, strict=True) if i is not None]
        name = outer.path or "<root>"
        reason = (
            f"one run of residual adds crosses the blocks of stack {name} and of the stacks "
            "inside them: the depth N is either count; pass n_layers="
            if crossed
            else f"some blocks of stack {name} make residual adds of their own while others "
            "hold stacks (a stage of one block?): their depth N would be the number of "
            f"{name}'s blocks; pass n_layers="
        )
        found.append(
            Doubt(
                "nested-stacks",
                outer.path,
                reason,
                ("reinit", "insert_branch_scale"),  # N, and CaiT's init of LayerScale
                (outer.path, *_doubt_paths(held)),
            )
        )
    return found


def _doubt_paths(adds: list[ResidualAdd]) -> tuple[str, ...]:
    """The modules performing ``adds`` and the layers writing through them."""
    return tuple(dict.fromkeys(p for a in adds for p in (a.module, *a.writers)))
