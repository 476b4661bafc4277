"""The dataflow graph of one traced forward: a node per tensor value, with the module call that
made it, and the calls themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..nested import Key


@dataclass
class Call:
    """One call of one module during the traced forward."""

    path: str
    module: nn.Module
    index: int  # how many times this module was called before
    parent: int | None  # enclosing call
    first_node: int  # nodes created during the call have ids >= first_node
    end_node: int = -1
    in_nodes: list[int] = field(default_factory=list)  # every floating-point tensor input
    in_keys: list[Key] = field(default_factory=list)  # where each of them was passed
    out_nodes: list[int] = field(default_factory=list)  # every floating-point tensor output
    inputs: tuple[Any, Any] | None = None  # (args, kwargs), kept only for capture candidates


@dataclass
class Graph:
    """Dataflow of one forward, one entry per tensor value (node)."""

    op: list[str] = field(default_factory=list)
    inputs: list[tuple[int, ...]] = field(default_factory=list)  # activation inputs only
    act: list[bool] = field(default_factory=list)  # derives from the model's inputs
    param_const: list[bool] = field(default_factory=list)  # a parameter or derived from them only
    uses_param: list[bool] = field(default_factory=list)  # an activation op reading a parameter
    alias: list[int] = field(default_factory=list)  # root through view/dropout/scalar-scale ops
    alias_parent: list[int] = field(default_factory=list)  # previous node on that chain
    factor: list[float] = field(default_factory=list)  # constant factor from `alias_parent`
    exact: list[int] = field(default_factory=list)  # root through value-preserving views only
    call: list[int | None] = field(default_factory=list)  # innermost module call
    owner: list[str | None] = field(default_factory=list)  # module owning the parameter read
    # qualified names of the parameters a node reads or derives from (through views, slices)
    param_src: list[tuple[str, ...]] = field(default_factory=list)
    # for an op applying parameters as weights: their qualified names (empty for other ops)
    weight: list[tuple[str, ...]] = field(default_factory=list)
    # for such an op: the shapes of the parameters it applies as matrices or kernels
    weight_shapes: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    shape: list[tuple[int, ...]] = field(default_factory=list)
    floating: list[bool] = field(default_factory=list)  # holds floating-point values
    adds: list[tuple[int, int, int]] = field(default_factory=list)  # (out, left, right)
    # for each add's output: how many tensor-tensor adds ran before it in its call's extent
    add_order: dict[int, int] = field(default_factory=dict)
    softmaxes: list[int] = field(default_factory=list)
    sdpa_calls: list[int | None] = field(default_factory=list)  # call of each sdpa op
    sdpa_queries: list[tuple[int, ...]] = field(default_factory=list)  # its query's shape
    # weight ops that add an activation to their product (addmm(h, h, W)): a skip inside one op
    fused_skips: list[int] = field(default_factory=list)
    # call of each F.multi_head_attention_forward, and its num_heads
    mha_calls: list[tuple[int, int]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    # first module boundary where a node's value is seen: node -> (sequence, hook, call id, key)
    boundary: dict[int, tuple[int, str, int, Key]] = field(default_factory=dict)
    root_outputs: list[tuple[Key, int]] = field(default_factory=list)  # (key, node) of the output

    def __len__(self) -> int:
        return len(self.op)

    def first_calls(self) -> dict[str, int]:
        """Each called module's path -> the index in `calls` of its first call."""
        first: dict[str, int] = {}
        for cid, call in enumerate(self.calls):
            first.setdefault(call.path, cid)
        return first

    def region(self, start: int, floor: int) -> tuple[set[int], set[int]]:
        """Walk back from `start` through activation inputs, visiting nodes above `floor`.

        Returns the visited nodes and the frontier: the nodes at or below `floor` reached.
        Node ids are topologically ordered, so everything an op computed from lies below it.
        """
        seen: set[int] = set()
        frontier: set[int] = set()
        todo = [start]
        while todo:
            n = todo.pop()
            if n <= floor:
                frontier.add(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            todo.extend(self.inputs[n])
        return seen, frontier

    def path_of(self, node: int) -> str | None:
        c = self.call[node]
        return None if c is None else self.calls[c].path

    def skip_inside(self, a: int, b: int) -> bool:
        """Whether one of the sum's operands ``a``, ``b`` reaches, through weightless ops only,
        something the other is computed from: a skip inside a branch (Inkling's short
        convolution, ``conv(y) + y``), not two branches side by side (each ends in its own
        weight op)."""
        for skip, other in ((a, b), (b, a)):
            reach: set[int] = set()
            todo = [skip]
            while todo:
                n = todo.pop()
                if n not in reach:
                    reach.add(n)  # up to the first weight op on each path, itself included
                    if not self.weight[n]:
                        todo.extend(i for i in self.inputs[n] if self.floating[i])
            if reach and reach & self.region(other, min(reach) - 1)[0]:
                return True
        return False
