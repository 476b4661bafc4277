"""Find the depth axes: blocks of one class that run one after another, and one block run
several times in a chain."""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn

from ..nested import Key
from .graph import Call, Graph
from .residual import FoundAdd

_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class FoundStack:
    path: str
    blocks: list[str]
    block_type: str
    generic: bool = True  # a ModuleList/Sequential of one class (else it must show adds)
    repeated: bool = False  # one module run len(blocks) times
    mixed: bool = False  # blocks of several classes (a hybrid): each must show adds
    # a mixed container holding two or more blocks of one class in a row: a stack whose last or
    # first block differs (EdgeNeXt's stage), not the sublayers of one block (T5's)
    repeats_a_class: bool = False
    # each block's modules, where a block is several entries of the stack's list (attention
    # and feed-forward side by side) or of parallel lists; blocks[i] is members[i][0]
    members: list[list[str]] | None = None


def _signature(module: nn.Module) -> tuple[object, ...]:
    return (type(module), tuple((n, _signature(c)) for n, c in module.named_children()))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def structural_stacks(model: nn.Module) -> list[FoundStack]:
    """Runs of two or more consecutive parameterized children of one class, in any container.

    A run covering every parameterized child of its container takes the container's path;
    otherwise it is named ``container[first..last]``. Generic containers as blocks must share
    their structure unless they are all their container holds (then they must show adds). A
    ModuleList or Sequential of blocks of several classes (Jamba's Mamba and attention layers)
    is a candidate too, kept only if every block shows adds.
    """
    found = []
    for path, m in model.named_modules():
        kids = [(n, c) for n, c in m.named_children() if any(True for _ in c.parameters())]
        classes = {type(c) for _, c in kids}
        runs: list[list[tuple[str, nn.Module]]] = []
        for name, child in kids:
            if runs and type(runs[-1][-1][1]) is type(child):
                runs[-1].append((name, child))
            else:
                runs.append([(name, child)])
        if (
            isinstance(m, _GENERIC)
            and len(kids) >= 2
            and len(classes) > 1
            and all(
                not isinstance(c, _GENERIC) and any(True for _ in c.children()) for _, c in kids
            )
        ):
            names = "/".join(sorted(c.__name__ for c in classes))
            blocks = [_join(path, n) for n, _ in kids]
            repeats = any(len(run) >= 2 for run in runs)
            stack = FoundStack(path, blocks, names, False, mixed=True, repeats_a_class=repeats)
            found.append(stack)
        # a generic container of one class is a stack by structure; any other run of blocks
        # must show residual adds when traced
        uniform = isinstance(m, _GENERIC) and len({type(c) for c in m.children()}) == 1
        for run in runs:
            if len(run) < 2:
                continue
            trusted = uniform
            if isinstance(run[0][1], _GENERIC) and len({_signature(c) for _, c in run}) != 1:
                if not uniform:
                    continue  # stages and downsamples side by side in one Sequential
                trusted = False  # stages of different blocks (EfficientNet): must show adds
            if not uniform and not any(True for _ in run[0][1].children()):
                continue  # two leaf layers of a block (fc1, fc2) are not a depth axis
            name = path if len(run) == len(kids) else f"{path}[{run[0][0]}..{run[-1][0]}]"
            blocks = [_join(path, n) for n, _ in run]
            found.append(FoundStack(name, blocks, type(run[0][1]).__name__, trusted))
    return found


def skipped_blocks(candidates: list[FoundStack], g: Graph) -> list[str]:
    """The blocks of containers of one class that did not run while others of theirs did, in
    a chain when more than one did (experts a router passed over run side by side); and of any
    container whose blocks are never called themselves, those inside which no module ran while
    one did inside others (LayerDrop over x-transformers' lists of sublayers). A block called
    that holds parameters but ran no module holding some of its own is skipped too."""
    first_call = g.first_calls()
    # containers never called themselves (x-transformers' blocks, lists of sublayers that the
    # parent runs): a block ran when a module inside it did
    inside = {
        path.rsplit(".", depth)[0] for path in first_call for depth in range(1, path.count(".") + 1)
    }
    # modules that ran a module holding parameters of its own, or are one
    weighed = {
        path.rsplit(".", depth)[0]
        for path, cid in first_call.items()
        if any(True for _ in g.calls[cid].module.parameters(recurse=False))
        for depth in range(path.count(".") + 1)
    }
    skipped = []
    for cand in candidates:
        ran = sorted(first_call[b] for b in cand.blocks if b in first_call)
        if not ran:
            entered = [b for b in cand.blocks if b in inside]
            if entered and len(entered) < len(cand.blocks):
                skipped += [b for b in cand.blocks if b not in inside]
            continue
        # a block called but running none of its layers (a per-sample layer dropout keeping no
        # row: torchtune's ModuleLayerDropoutWrapper) was skipped too
        missed = [
            b
            for b in cand.blocks
            if b not in first_call or (b not in weighed and _holds_parameters(g, first_call[b]))
        ]
        if missed and cand.generic and _chained(g, ran):
            skipped += missed
    return skipped


def _holds_parameters(g: Graph, cid: int) -> bool:
    return any(True for _ in g.calls[cid].module.parameters())


def executed_stacks(
    candidates: list[FoundStack],
    g: Graph,
    has_adds: Callable[[str], bool],
    sums: list[int] | None = None,
    sublayers: Callable[[FoundStack, bool], bool] | None = None,
) -> list[FoundStack]:
    """Keep candidates whose blocks ran in a chain (block i+1 reads what block i wrote, through
    an argument block i was given a tensor in), and add every module run several times in a
    chain; sorted by when their first block ran.

    Blocks are put in execution order; expert lists and parallel heads, whose members all read
    the same input, are dropped. Blocks held by a plain module or a mixed container must
    perform residual adds (``has_adds(path)``, some of them), and so must repeated modules:
    two chained layers of a block are no depth axis. Where the model makes residual adds
    (their sums' nodes, ``sums``), blocks applying no weight (norms) must stand at different
    depths of the stream: an add completes while they run (a pre and a post norm of one
    sublayer kept in a list stand at one depth, before the sublayer's add). Blocks that are
    bare layers (no children) need a residual sum between each two: a list of Linears with none
    is one MLP (DETR's box head), not a stack. Candidates holding a block's sublayers rather
    than blocks (``sublayers(candidate, inside another kept stack's block)``: MaxViT's MBConv,
    window and grid attention) are dropped, and so are those of the same structure.
    """
    calls_of: dict[str, list[int]] = {}
    for cid, call in enumerate(g.calls):
        calls_of.setdefault(call.path, []).append(cid)
    first_call = {path: cids[0] for path, cids in calls_of.items()}
    kept: list[tuple[int, FoundStack]] = []
    for cand in candidates:
        ran = sorted((first_call[b], b) for b in cand.blocks if b in first_call)
        if len(ran) < 2 or not _chained(g, [cid for cid, _ in ran]):
            continue
        if not cand.generic and not any(has_adds(b) for _, b in ran):
            continue
        if cand.mixed and (len(ran) < len(cand.blocks) or not all(has_adds(b) for _, b in ran)):
            continue
        if sums and not _apart(g, [cid for cid, _ in ran], sums):
            continue  # weightless blocks at one depth: a sublayer's pre and post norms
        if sums is not None and _bare(g, [cid for cid, _ in ran], sums):
            continue  # bare layers with no residual add between them: one MLP (DETR's)
        blocks = [b for _, b in ran]
        kept.append((ran[0][0], dataclasses.replace(cand, blocks=blocks)))
    if sublayers is not None:
        kept = _without_sublayers(kept, g, first_call, sublayers)
    # blocks of several classes, none twice in a row, inside a block of another stack are its
    # sublayers (T5's self-attention, cross-attention and feed-forward), not a hybrid stack
    blocks_of = [b for _, s in kept if not s.mixed for b in s.blocks]
    kept = [
        (c, s)
        for c, s in kept
        if not (
            s.mixed and not s.repeats_a_class and any(s.path.startswith(b + ".") for b in blocks_of)
        )
    ]
    # a hybrid stack kept: the runs of one class inside it are parts of it, not stacks
    hybrid = [set(s.blocks) for _, s in kept if s.mixed]
    kept = [(c, s) for c, s in kept if not any(set(s.blocks) < h for h in hybrid)]
    repeated: set[str] = set()
    for path, cids in calls_of.items():
        if len(cids) < 2 or not has_adds(path) or _inside_repeated(path, repeated, calls_of):
            continue
        if not _chained(g, cids):
            continue
        repeated.add(path)
        block_type = type(g.calls[cids[0]].module).__name__
        kept.append((cids[0], FoundStack(path, [path] * len(cids), block_type, repeated=True)))
    return [s for _, s in sorted(kept, key=lambda item: item[0])]


def _bare(g: Graph, cids: list[int], sums: list[int]) -> bool:
    """Whether the calls ``cids`` are of layers without children, between two of which
    (from the start of one to the start of the next) no residual sum (a node of sorted
    ``sums``) is computed."""
    if any(True for _ in g.calls[cids[0]].module.children()):
        return False
    starts = [g.calls[c].first_node for c in cids]
    for start, end in itertools.pairwise(starts):
        i = bisect.bisect_left(sums, start)
        if i == len(sums) or sums[i] >= end:
            return True
    return False


def _apart(g: Graph, cids: list[int], sums: list[int]) -> bool:
    """Whether the calls ``cids`` apply a weight, or some residual sum (a node of sorted
    ``sums``) is computed from the start of the first of them to the end of the last."""
    calls = [g.calls[c] for c in cids]
    if any(g.weight[n] for c in calls for n in range(c.first_node, c.end_node)):
        return True
    i = bisect.bisect_left(sums, calls[0].first_node)
    return i < len(sums) and sums[i] < calls[-1].end_node


def _without_sublayers(
    kept: list[tuple[int, FoundStack]],
    g: Graph,
    first_call: dict[str, int],
    sublayers: Callable[[FoundStack, bool], bool],
) -> list[tuple[int, FoundStack]]:
    """Drop the candidates ``sublayers`` tells are a block's sublayers, and those of the same
    classes in the same order (the last layer's, after which the run ends)."""
    blocks_of = [b for _, s in kept if s.generic for b in s.blocks]

    def nested(s: FoundStack) -> bool:
        return any(s.blocks[0].startswith(b + ".") for b in blocks_of)

    def structure(s: FoundStack) -> tuple[type, ...]:
        return tuple(type(g.calls[first_call[b]].module) for b in s.blocks)

    dropped = {structure(s) for _, s in kept if sublayers(s, nested(s))}
    return [(c, s) for c, s in kept if structure(s) not in dropped]


def common_path(paths: list[str]) -> str:
    """The innermost module path holding every one of ``paths``."""
    parts = [p.split(".") if p else [] for p in paths]
    common = 0
    while parts and all(len(p) > common and p[common] == parts[0][common] for p in parts):
        common += 1
    return ".".join(parts[0][:common]) if parts else ""


def stream_runs(g: Graph, adds: list[FoundAdd]) -> list[list[int]]:
    """The runs of residual adds along one stream, as indices into ``adds`` (in order).

    Add j continues add i when j's skip reads i's sum through no weight op (views, dropout,
    Post-LN's norm); a skip through a weight layer (a projection shortcut) or from no earlier
    sum starts a run. Of two adds continuing one sum, the first does.
    """
    sums = {a.out: i for i, a in enumerate(adds)}
    following: dict[int, int] = {}
    starts = []
    for j, a in enumerate(adds):
        i = _previous_sum(g, a.skip, sums)
        if i is None or i in following:
            starts.append(j)
        else:
            following[i] = j
    runs = []
    for j in starts:
        run = [j]
        while run[-1] in following:
            run.append(following[run[-1]])
        runs.append(run)
    return runs


def _previous_sum(g: Graph, node: int, sums: dict[int, int]) -> int | None:
    """The latest residual sum (index in ``sums``) that ``node`` derives from through no
    weight op."""
    todo, seen, found = [node], set(), []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in sums:
            found.append(sums[n])
        elif not g.weight[n]:
            todo.extend(g.inputs[n])
    return max(found, default=None)


def unpacked_stacks(
    model: nn.Module, adds: list[FoundAdd], runs: list[list[int]], homes: list[str | None]
) -> list[tuple[int, FoundStack]]:
    """Stacks of the runs of adds no stack holds (their indices in ``runs``): blocks a parent
    iterates without calling them (``for attn, ff in self.layers``), with each add's writers
    living in ``homes[i]`` (their common module); each with the node its first add starts at.

    The blocks are the children of the common container of the run's homes, grouped into the
    repeating unit of their structure (x-transformers' attention and feed-forward entries
    alternating in one list: a block is one of each); where the homes share no container, the
    children of containers holding them (parallel lists zipped by the parent).
    """
    modules = dict(model.named_modules())
    found = []
    for run in runs:
        entries = _entries([homes[i] for i in run], modules)
        if entries is None:
            continue
        path, order = entries
        units = _units([modules[e] for e in order])
        if len(order) // units < 2:
            continue
        groups = [order[k : k + units] for k in range(0, len(order), units)]
        if len({tuple(e.rpartition(".")[0] for e in u) for u in groups}) > 1:
            continue  # blocks of different lists (TFT's variable and context GRNs)
        block_type = "+".join(type(modules[e]).__name__ for e in groups[0])
        stack = FoundStack(
            path,
            [u[0] for u in groups],
            block_type,
            members=groups if units > 1 else None,
        )
        found.append((min(adds[run[0]].region, default=adds[run[0]].out), stack))
    return found


def grouped_sublayers(stack: FoundStack, model: nn.Module, adds: list[int]) -> FoundStack:
    """A called stack of several classes whose blocks each make one residual add (``adds``:
    how many each holds) grouped into the repeating unit of their structure: KEEL's list of
    alternating attention and feed-forward layers is a stack of (attention, feed-forward)
    pairs, as x-transformers' unpacked list is. Blocks of whole layers (Jamba's Mamba and
    attention layers, two adds each) stay as they are."""
    if not stack.mixed or stack.members or any(n != 1 for n in adds):
        return stack
    modules = dict(model.named_modules())
    units = _units([modules[b] for b in stack.blocks])
    if units == 1 or len(stack.blocks) // units < 2:
        return stack
    groups = [stack.blocks[k : k + units] for k in range(0, len(stack.blocks), units)]
    block_type = "+".join(type(modules[b]).__name__ for b in groups[0])
    return dataclasses.replace(
        stack, blocks=[u[0] for u in groups], block_type=block_type, members=groups
    )


def _entries(
    homes: list[str | None], modules: dict[str, nn.Module]
) -> tuple[str, list[str]] | None:
    """(container, the modules holding each add in turn, each listed once) when each holds
    a contiguous stretch of the run, else None."""
    known = [h for h in homes if h is not None]
    if len(known) < len(homes) or len(homes) < 2:
        return None
    container = common_path(known)
    common = len(container.split(".")) if container else 0
    listed = isinstance(modules[container], _GENERIC)
    held = []
    for p in (h.split(".") if h else [] for h in known):
        if listed:
            depth = common + 1
        else:  # no container: the outermost module below it a list holds
            depth = next(
                (
                    d
                    for d in range(common + 1, len(p) + 1)
                    if isinstance(modules[".".join(p[: d - 1])], _GENERIC)
                ),
                0,
            )
        if not depth or len(p) < depth:
            return None
        held.append(".".join(p[:depth]))
    order = list(dict.fromkeys(held))
    changes = sum(a != b for a, b in itertools.pairwise(held))
    if changes != len(order) - 1:
        return None  # a module holds adds in two stretches of the run
    return container, order


def _units(entries: list[nn.Module]) -> int:
    """The length of the shortest repeating pattern of the entries' structure; else of their
    classes and their children's classes, where at least two units after the first repeat
    their structure (the first unit may hold more deeper inside: x-transformers' first
    attention makes the value residual the later ones read)."""
    signatures = [_signature(e) for e in entries]
    n = len(signatures)
    exact = next(
        p for p in range(1, n + 1) if n % p == 0 and signatures == signatures[:p] * (n // p)
    )
    if exact < n:
        return exact
    # each entry's class and its children's: the first unit's must be the others'
    shallow = [(type(e), tuple(type(c) for c in e.children())) for e in entries]
    return next(
        (
            p
            for p in range(1, n // 3 + 1)
            if n % p == 0
            and shallow == shallow[:p] * (n // p)
            and signatures[p:] == signatures[p : 2 * p] * (n // p - 1)
        ),
        n,
    )


def _inside_repeated(path: str, repeated: set[str], calls_of: dict[str, list[int]]) -> bool:
    """Whether an enclosing module already runs as often (its children repeat with it)."""
    return any(
        path.startswith(r + ".") and len(calls_of[r]) == len(calls_of[path]) for r in repeated
    )


def _chained(g: Graph, cids: list[int]) -> bool:
    """Whether each of the calls ``cids`` (in execution order) feeds the next."""
    return all(_feeds(g, cids[i], cids[i + 1]) for i in range(len(cids) - 1))


def _feeds(g: Graph, earlier: int, later: int) -> bool:
    """Whether some output of call ``earlier`` reaches call ``later`` through an argument that
    ``earlier`` was given a tensor in: the stream passed on, not an encoder's output that a
    decoder only reads for cross-attention."""
    first, second = g.calls[earlier], g.calls[later]
    outs = first.out_nodes
    if not outs:
        return False
    floor = min(outs) - 1
    given = {_argument(first, key) for key in first.in_keys}
    for inp, key in zip(second.in_nodes, second.in_keys, strict=True):
        if _argument(second, key) not in given:
            continue
        seen, _ = g.region(inp, floor)
        if any(o in seen for o in outs):
            return True
    return False


def _argument(call: Call, key: Key) -> Key:
    """``key`` (``(0, i, ...)`` for the i-th positional argument, ``(1, name, ...)`` for a
    keyword) with a positional argument named as the forward names it, so that ``blk(h)`` and
    ``blk(hidden_states=h)`` give one key."""
    if len(key) >= 2 and key[0] == 0 and isinstance(key[1], int):
        names = _positional_names(type(call.module).forward)
        if key[1] < len(names):
            return (1, names[key[1]], *key[2:])
    return key


@cache
def _positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a forward inspect cannot read
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)[1:]  # without self
