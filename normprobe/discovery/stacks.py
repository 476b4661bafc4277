"""Find the depth axes: blocks of one class that run one after another, and one block run
several times in a chain."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn

from .trace import Call, Graph, Key

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
    a chain when more than one did (experts a router passed over run side by side)."""
    first_call = g.first_calls()
    skipped = []
    for cand in candidates:
        ran = sorted(first_call[b] for b in cand.blocks if b in first_call)
        if not cand.generic or not ran or len(ran) == len(cand.blocks):
            continue
        if _chained(g, ran):
            skipped += [b for b in cand.blocks if b not in first_call]
    return skipped


def executed_stacks(
    candidates: list[FoundStack], g: Graph, has_adds: Callable[[str], bool]
) -> list[FoundStack]:
    """Keep candidates whose blocks ran in a chain (block i+1 reads what block i wrote, through
    an argument block i was given a tensor in), and add every module run several times in a
    chain; sorted by when their first block ran.

    Blocks are put in execution order; expert lists and parallel heads, whose members all read
    the same input, are dropped. Blocks held by a plain module or a mixed container must
    perform residual adds (``has_adds(path)``, some of them), and so must repeated modules:
    two chained layers of a block are no depth axis.
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
        blocks = [b for _, b in ran]
        kept.append((ran[0][0], dataclasses.replace(cand, blocks=blocks)))
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
