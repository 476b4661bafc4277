"""Find the depth axes: containers of repeated blocks that run one after another."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .trace import Graph

_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class FoundStack:
    path: str
    blocks: list[str]
    block_type: str


def _signature(module: nn.Module) -> tuple[object, ...]:
    return (type(module), tuple((n, _signature(c)) for n, c in module.named_children()))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def structural_stacks(model: nn.Module) -> list[FoundStack]:
    """ModuleLists/Sequentials of two or more parameterized children of one class.

    Children that are themselves generic containers must also share their structure.
    """
    found = []
    for path, m in model.named_modules():
        if not isinstance(m, nn.Sequential | nn.ModuleList):
            continue
        kids = list(m.named_children())
        if len(kids) < 2 or len({type(c) for _, c in kids}) != 1:
            continue
        if not all(any(True for _ in c.parameters()) for _, c in kids):
            continue
        if isinstance(kids[0][1], _GENERIC) and len({_signature(c) for _, c in kids}) != 1:
            continue
        blocks = [_join(path, n) for n, _ in kids]
        found.append(FoundStack(path, blocks, type(kids[0][1]).__name__))
    return found


def executed_stacks(candidates: list[FoundStack], g: Graph) -> list[FoundStack]:
    """Keep candidates whose blocks ran in a chain (block i+1 reads what block i wrote).

    Blocks are put in execution order and stacks sorted by when their first block ran; expert
    lists and parallel heads, whose members all read the same input, are dropped.
    """
    first_call: dict[str, int] = {}
    for cid, call in enumerate(g.calls):
        first_call.setdefault(call.path, cid)
    kept: list[tuple[int, FoundStack]] = []
    for cand in candidates:
        ran = sorted((first_call[b], b) for b in cand.blocks if b in first_call)
        if len(ran) < 2 or not all(
            _feeds(g, ran[i][0], ran[i + 1][0]) for i in range(len(ran) - 1)
        ):
            continue
        kept.append((ran[0][0], FoundStack(cand.path, [b for _, b in ran], cand.block_type)))
    return [s for _, s in sorted(kept, key=lambda item: item[0])]


def _feeds(g: Graph, earlier: int, later: int) -> bool:
    out, inp = g.calls[earlier].out_node, g.calls[later].in_node
    if out is None or inp is None:
        return False
    seen, _ = g.region(inp, out - 1)
    return out in seen
