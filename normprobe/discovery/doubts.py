"""The generic doubts of a finished map: where it may be incomplete in a way that changes an
action's result, read from the map alone (which adds no stack groups, which norms have no kind).

Rules that need the traced graph (a weight layer writing into the stream through no add) live
where the graph is read; this module only reads the `ModelMap`.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

from torch import nn

from .model_map import Action, Doubt, ModelMap, ResidualAdd, Stack

# Doubts about which blocks make a stack, and so about the depth N of schemes scaled by it:
# an explicit ``n_layers=`` answers them.
DEPTH_DOUBTS = frozenset({"add-outside-stack", "no-stack", "nested-stacks"})

# The actions a depth doubt can make wrong: N (reinit's gpt2/deepnorm, LayerScale's CaiT init)
# and the per-block metrics, which read blocks from the stacks.
_DEPTH_AFFECTS: tuple[Action, ...] = ("reinit", "insert_branch_scale", "metrics")

_SET_DEPTH = "give the number of blocks yourself (reinit's n_layers=)"

# Adds from this many on, with no stack to group them, are more than one or two blocks.
NO_STACK_MIN_ADDS = 4


def doubts(model_map: ModelMap, model: nn.Module) -> list[Doubt]:
    """The doubts a finished map carries by its own evidence, in a stable order."""
    return [
        *_outside_stacks(model_map),
        *_nested_stacks(model_map, model),
        *_unknown_norms(model_map),
    ]


def merged(existing: Iterable[Doubt], more: Iterable[Doubt]) -> list[Doubt]:
    """``existing`` and then those of ``more`` of another (kind, path), each once."""
    out: list[Doubt] = []
    seen: set[tuple[str, str]] = set()
    for d in (*existing, *more):
        if (d.kind, d.path) not in seen:
            seen.add((d.kind, d.path))
            out.append(d)
    return out


def _name(path: str) -> str:
    return path or "<root>"


def _outside_stacks(m: ModelMap) -> list[Doubt]:
    """Adds no stack holds: per module performing them when other adds have a stack, else one
    doubt for the whole model when there are enough of them to be several blocks."""
    outside = [a for a in m.residual_adds if a.stack is None]
    if not outside:
        return []
    grouped = sorted({a.stack for a in m.residual_adds if a.stack is not None})
    if not grouped:
        if len(outside) < NO_STACK_MIN_ADDS:
            return []
        return [
            Doubt(
                "no-stack",
                "",
                f"{len(outside)} residual adds and no stack of blocks to count them in, so the "
                f"depth N is a guess (the number of adds); {_SET_DEPTH}",
                _DEPTH_AFFECTS,
                _modules(outside),
            )
        ]
    by_module: dict[str, list[ResidualAdd]] = {}
    for a in outside:
        by_module.setdefault(a.module, []).append(a)
    return [
        Doubt(
            "add-outside-stack",
            module,
            f"{len(adds)} residual add(s) performed in {_name(module)} belong to no stack while "
            f"the other adds belong to {', '.join(map(_name, grouped))}, so their depth N and "
            f"their block are a guess; {_SET_DEPTH}",
            _DEPTH_AFFECTS,
            _modules(adds),
        )
        for module, adds in by_module.items()
    ]


def _modules(adds: list[ResidualAdd]) -> tuple[str, ...]:
    """The modules performing ``adds`` and writing through them, each once."""
    return tuple(dict.fromkeys(p for a in adds for p in (a.module, *a.writers)))


def _nested_stacks(m: ModelMap, model: nn.Module) -> list[Doubt]:
    """Stacks of blocks of several classes, none twice in a row (attention, feed-forward: the
    sublayers of one block, as a ``ModuleList([attn, ff])`` per layer), which repeat: inside a
    block of another stack, or beside stacks of the same classes in one container. Their depth
    may be the sublayers' count or the blocks'. A stack of one class inside a block (ConvNeXt's
    stage holding its blocks), or with a class twice in a row (EdgeNeXt's stage), is the usual
    hierarchy. One doubt per enclosing stack or container."""
    classes = {s.path: [type(model.get_submodule(b)) for b in s.blocks] for s in m.stacks}
    groups: dict[str, list[Stack]] = {}
    for inner in m.stacks:
        kinds = classes[inner.path]
        if len(set(kinds)) < 2 or any(a is b for a, b in pairwise(kinds)):
            continue
        outer = next((s for s in m.stacks if _in_block(inner.path, s)), None)
        parent = inner.path.rpartition(".")[0]
        twins = [
            s
            for s in m.stacks
            if s.path != inner.path
            and s.path.rpartition(".")[0] == parent
            and classes[s.path] == kinds
        ]
        if outer is not None or twins:
            groups.setdefault(outer.path if outer is not None else parent, []).append(inner)
    return [
        Doubt(
            "nested-stacks",
            key,
            f"{len(inners)} stack(s) in {_name(key)} ({_names(inners)}) hold blocks of several "
            f"classes ({inners[0].block_type}), so these may be the sublayers of one block and "
            f"the depth {inners[0].depth} not the number of blocks; {_SET_DEPTH}",
            _DEPTH_AFFECTS,
            (key, *(p for s in inners for p in (s.path, *s.blocks))),
        )
        for key, inners in groups.items()
    ]


def _names(stacks: list[Stack]) -> str:
    shown = ", ".join(_name(s.path) for s in stacks[:3])
    return shown + (", ..." if len(stacks) > 3 else "")


def _in_block(path: str, stack: Stack) -> bool:
    return any(path == b or path.startswith(b + ".") for b in stack.blocks if b != stack.path)


def _unknown_norms(m: ModelMap) -> list[Doubt]:
    """Norm-like modules whose computation discovery could not tell (torch's own norms of no
    convertible kind, LocalResponseNorm, are known and left out)."""
    return [
        Doubt(
            "unknown-norm",
            n.path,
            f"{_name(n.path)} ({n.class_name}) looks like a norm ({n.recognized_by}) but "
            "discovery could not tell what it computes, so it cannot be converted safely; "
            f"leave it out with exclude={block_glob(n.path)!r}",
            ("convert_norms",),
        )
        for n in m.norms
        if n.kind == "unknown" and not n.recognized_by.startswith(("torch class", "subclass of"))
    ]


def block_glob(path: str) -> str:
    """``path`` with block indices as ``*``: a glob for the same module of every block."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def refusal(what: str, standing: list[Doubt], way_out: str) -> str:
    """The message of an action refusing on ``standing`` doubts: each named, then the way out."""
    named = [f"{d.kind} at {_name(d.path)}: {d.reason}" for d in standing[:3]]
    if len(standing) > 3:
        named.append(f"and {len(standing) - 3} more ({[_name(d.path) for d in standing[3:]][:5]})")
    return (
        f"{what} refuses, nothing was changed: the model's map is unsure where it matters "
        f"({'; '.join(named)}). {way_out}; or, once you checked the map, pass model_map= with "
        "those doubts removed"
    )
