"""Observe one forward pass: a dataflow graph of tensor ops with module-call provenance.

A `TorchFunctionMode` records every torch op (its tensor inputs, whether it reads a parameter)
while forward pre/post hooks keep the stack of module calls. The graph is in static single
assignment form: an in-place op gives its tensor a new node. Tensors are tracked by weak
reference, so the trace keeps no activation alive beyond what the forward itself does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

ADD_OPS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
# Ops whose output holds the same values as their input (a residual read through them is exact).
EXACT_VIEW_OPS = frozenset(
    {
        "view",
        "reshape",
        "view_as",
        "reshape_as",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "clone",
        "detach",
        "flatten",
        "squeeze",
        "unsqueeze",
        "to",
        "float",
        "type_as",
        "type",
    }
)
# Ops looked through when deciding what an operand derives from, but not value-preserving.
PASS_OPS = frozenset(
    {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
)
SCALE_OPS = frozenset({"mul", "__mul__", "__rmul__", "div", "__truediv__", "mul_", "__imul__"})
MATMUL_OPS = frozenset({"matmul", "__matmul__", "bmm", "einsum", "baddbmm"})
# Ops that apply a parameter as a weight (a matrix, kernel or table), whatever view of it.
WEIGHT_OPS = frozenset(
    {
        "linear",
        "bilinear",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "einsum",
        "tensordot",
        "embedding",
        "embedding_bag",
        # a stack of expert matrices applied to groups of rows (transformers' grouped_mm experts)
        "grouped_mm",
        "_grouped_mm",
        "grouped_mm_fallback",
    }
)
# nn.MultiheadAttention's functional forms: what they write comes through ``out_proj_weight``.
MHA_OPS = {"multi_head_attention_forward": 11, "_native_multi_head_attention": 7}
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "special_softmax"})
# Ops whose output takes only the shape (and dtype) of their input, none of its values.
SHAPE_ONLY_OPS = frozenset(
    {
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
    }
)
# The tensors after the first only lend these their dtype, device or shape (``x.type_as(y)``).
FIRST_ONLY_OPS = frozenset({"type_as", "view_as", "reshape_as", "expand_as", "to"})
# A parameter broadcast over the batch by these (a class token) starts a stream of its own.
BROADCAST_OPS = frozenset({"expand", "expand_as", "repeat", "tile", "broadcast_to"})
SDPA_OPS = frozenset({"scaled_dot_product_attention"})
# Tensor methods that do no computation worth recording.
_IGNORED = frozenset(
    {
        "__set__",
        "size",
        "dim",
        "numel",
        "__len__",
        "is_floating_point",
        "is_complex",
        "__format__",
        "__repr__",
        "item",
        "tolist",
        "data_ptr",
        "stride",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "get_device",
        "__bool__",
        "__index__",
        "__int__",
        "__float__",
        "__hash__",
    }
)

Key = tuple[str | int, ...]


def iter_tensors(obj: Any, prefix: Key = ()) -> Iterator[tuple[Key, torch.Tensor]]:
    """Yield (key path, tensor) for tensors nested in tuples, lists and dicts (ModelOutput too)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str | int):
                yield from iter_tensors(v, (*prefix, k))
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, (*prefix, i))


def get_by_key(obj: Any, key: Key) -> Any:
    """Follow a key path produced by `iter_tensors`."""
    for k in key:
        obj = obj[k]
    return obj


def replace_at(obj: Any, key: Key, value: Any) -> Any:
    """A copy of nested tuples, lists and dicts ``obj`` with the entry at ``key`` replaced."""
    if not key:
        return value
    head, rest = key[0], key[1:]
    if isinstance(obj, tuple):
        return tuple(replace_at(v, rest, value) if i == head else v for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [replace_at(v, rest, value) if i == head else v for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return {k: replace_at(v, rest, value) if k == head else v for k, v in obj.items()}
    return obj


def applied_as(module: nn.Module, path: str, attr: str) -> tuple[str, str]:
    """(module path, attribute) of the tensor a parameter is applied as: a parametrization's
    ``original`` parameters (``conv.parametrizations.weight.original0``) and old-style weight
    norm's ``weight_g`` and ``weight_v`` make the tensor they parametrize (``conv.weight``)."""
    if isinstance(module, parametrize.ParametrizationList):
        container, _, name = path.rpartition(".")
        return container.rpartition(".")[0], name
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and attr in (f"{hook.name}_g", f"{hook.name}_v"):
            return path, hook.name
    return path, attr


def first_float(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in nested tuples, lists and dicts (or ``obj`` itself)."""
    first = obj  # the common case, a tensor first in (args, kwargs), without a generator
    while isinstance(first, tuple | list) and first:
        first = first[0]
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return first
    for _, t in iter_tensors(obj):
        if t.is_floating_point():
            return t
    return None


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


class _Op(NamedTuple):
    """What one intercepted op makes of its inputs (`_Recorder._classify`)."""

    act_in: tuple[int, ...]  # the activations it reads
    act: bool  # its outputs are activations
    param_const: bool  # its outputs are computed from parameters alone
    uses_param: bool  # it applies parameters to an activation
    owner: str | None  # the module whose weight it applies
    sources: tuple[str, ...]  # the parameters it reads, by name
    weight: tuple[str, ...]  # the weights it applies, by name
    weight_shapes: tuple[tuple[int, ...], ...]  # their shapes (matrices and up)


class _Recorder(TorchFunctionMode):
    def __init__(
        self,
        model: nn.Module,
        capture: Callable[[nn.Module], bool],
    ) -> None:
        super().__init__()
        self.g = Graph()
        # a module registered under two names goes by its first, as in named_modules()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.capture = capture
        self.param_ids = {id(p) for p in model.parameters()}
        # parameter -> (module path, attribute) of every module holding it (tied ones: several)
        self.owners: dict[int, list[tuple[str, str]]] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            for attr, p in m.named_parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(applied_as(m, name, attr))
        self.ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.stack: list[int] = []
        self.call_counts: dict[str, int] = {}
        self.extent_adds: dict[int, int] = {}
        self.root = model
        self.handles: list[RemovableHandle] = []

    # graph bookkeeping -------------------------------------------------------------------
    def _lookup(self, t: torch.Tensor) -> int | None:
        entry = self.ids.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def _new(
        self,
        t: torch.Tensor,
        op: str,
        inputs: tuple[int, ...] = (),
        act: bool = False,
        param_const: bool = False,
        uses_param: bool = False,
        owner: str | None = None,
        param_src: tuple[str, ...] = (),
        weight: tuple[str, ...] = (),
    ) -> int:
        g = self.g
        n = len(g.op)
        g.op.append(op)
        g.inputs.append(inputs)
        g.act.append(act)
        g.param_const.append(param_const)
        g.uses_param.append(uses_param)
        g.alias.append(n)
        g.alias_parent.append(n)
        g.factor.append(1.0)
        g.exact.append(n)
        g.call.append(self.stack[-1] if self.stack else None)
        g.owner.append(owner)
        g.param_src.append(param_src)
        g.weight.append(weight)
        g.shape.append(tuple(t.shape))
        g.floating.append(t.is_floating_point())
        self.ids[id(t)] = (weakref.ref(t), n)
        return n

    def node(self, t: torch.Tensor, act: bool = False) -> int:
        n = self._lookup(t)
        if n is None:
            is_param = id(t) in self.param_ids
            n = self._new(
                t,
                "input" if act else "const",
                act=act,
                param_const=is_param,
                param_src=self._qualified(t) if is_param else (),
            )
        return n

    def _qualified(self, p: torch.Tensor) -> tuple[str, ...]:
        """Every qualified name of the parameter (a tied one has several)."""
        return tuple(f"{m}.{a}" if m else a for m, a in self.owners.get(id(p), []))

    def _resolve(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Of the names of the parameters an op read, those of the innermost running module
        holding one (a tied ``lm_head`` uses its own name), else the first."""
        for c in reversed(self.stack):
            path = self.g.calls[c].path
            held = tuple(q for q in names if q.rpartition(".")[0] == path)
            if held:
                return held
        return names[:1]

    def _owner(self, names: tuple[str, ...]) -> str | None:
        """The module holding the first of these qualified parameter names."""
        return names[0].rpartition(".")[0] if names else None

    def inputs(self, given: Any) -> None:
        """The tensors in ``given`` are the model's inputs, whatever pre-hooks of the root make
        of them (DeepSpeed ZeRO-3's hand the forward detached copies)."""
        for _, t in iter_tensors(given):
            self.node(t, act=True)

    # module hooks ----------------------------------------------------------------------------
    def _pre(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        g = self.g
        path = self.names.get(id(mod), "?")
        index = self.call_counts.get(path, 0)
        self.call_counts[path] = index + 1
        is_root = not self.stack
        # the tensors the forward reads as parameters: FSDP swaps in unsharded ones (FSDP2 as
        # parameters, FSDP1 as plain views set over them)
        for name in mod._parameters:
            p = getattr(mod, name, None)
            if isinstance(p, torch.Tensor) and id(p) not in self.param_ids:
                self.param_ids.add(id(p))
                self.owners.setdefault(id(p), []).append(applied_as(mod, path, name))
                n = self._lookup(p)  # a view FSDP1 computed while this mode was on
                if n is not None:
                    g.param_const[n] = True
                    g.param_src[n] = (f"{path}.{name}" if path else name,)
        call = Call(path, mod, index, self.stack[-1] if self.stack else None, first_node=len(g.op))
        cid = len(g.calls)
        g.calls.append(call)
        for key, t in iter_tensors((args, kwargs)):
            n = self.node(t, act=is_root)
            if t.is_floating_point():
                call.in_nodes.append(n)
                call.in_keys.append(key)
            g.boundary.setdefault(n, (len(g.boundary), "pre", cid, key))
        if self.capture(mod) and index == 0 and not self._parametrizing():
            call.inputs = (args, kwargs)
        call.first_node = len(g.op)
        self.stack.append(cid)

    def _parametrizing(self) -> bool:
        """Whether the running call computes a parametrized tensor (weight norm's ``weight``):
        it transforms parameters, not activations."""
        calls = self.g.calls
        return any(isinstance(calls[c].module, parametrize.ParametrizationList) for c in self.stack)

    def _post(
        self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        g = self.g
        if not self.stack:  # pragma: no cover - always_call after a failed pre-hook
            return
        cid = self.stack.pop()
        call = g.calls[cid]
        call.end_node = len(g.op)
        for key, t in iter_tensors(out):
            n = self._lookup(t)
            if n is None:
                continue
            if t.is_floating_point():
                call.out_nodes.append(n)
            g.boundary.setdefault(n, (len(g.boundary), "post", cid, key))
            if not self.stack and t.is_floating_point():
                g.root_outputs.append((key, n))

    def attach(self, model: nn.Module) -> None:
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(
                m.register_forward_hook(self._post, with_kwargs=True, always_call=True)
            )

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # op interception -------------------------------------------------------------------------
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _IGNORED:
            return func(*args, **kwargs)
        # Inputs are resolved before the call: an in-place op rebinds its tensor to a new node.
        in_tensors = [t for _, t in iter_tensors((args, kwargs))]
        in_nodes = [self.node(t) for t in in_tensors]
        is_add = (
            name in ADD_OPS
            and len(args) >= 2
            and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.Tensor)
        )
        add_operands = (in_nodes[0], in_nodes[1]) if is_add else None
        out = func(*args, **kwargs)
        outs = (
            [in_tensors[0]]
            if name == "__setitem__" and in_tensors
            else [t for _, t in iter_tensors(out)]
        )
        if not outs:
            return out
        op = self._classify(name, args, kwargs, in_nodes)
        for t in outs:
            self._record(t, name, op, (args, in_tensors, in_nodes), add_operands)
        if add_operands is not None:
            for cid in self.stack:
                self.extent_adds[cid] = self.extent_adds.get(cid, 0) + 1
        if op.act and in_tensors and outs[0] is in_tensors[0]:
            self._write_through(in_tensors[0])
        if name in SDPA_OPS:
            self.g.sdpa_calls.append(self.stack[-1] if self.stack else None)
            query = args[0] if args else kwargs.get("query")
            self.g.sdpa_queries.append(
                tuple(query.shape) if isinstance(query, torch.Tensor) else ()
            )
        return out

    def _classify(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], in_nodes: list[int]
    ) -> _Op:
        """What an op's outputs are: activations or parameter constants, and the weight layer
        applying parameters to an activation."""
        g = self.g
        data_in = in_nodes[:1] if name in FIRST_ONLY_OPS else in_nodes
        act_in = tuple(n for n in data_in if g.act[n])
        params = [n for n in data_in if g.param_const[n]]
        if name in SHAPE_ONLY_OPS:
            act_in, params = (), []
        if params and act_in and _picks_matrices(g, act_in, params):
            act_in = ()  # an expert's weight picked by a computed index: still a parameter
        if name in BROADCAST_OPS and not act_in and params and self.stack:
            params = []  # a learned token: an activation from here on
            act = True
        else:
            act = bool(act_in)
        uses_param = act and bool(params)
        sources = tuple(dict.fromkeys(q for n in params for q in g.param_src[n]))
        weight = self._weights(name, args, kwargs, params) if uses_param else ()
        owner = self._owner(weight or self._resolve(sources)) if uses_param else None
        weight_shapes = tuple(g.shape[p] for p in params if len(g.shape[p]) >= 2)
        return _Op(
            act_in, act, not act and bool(params), uses_param, owner, sources, weight, weight_shapes
        )

    def _record(
        self,
        t: torch.Tensor,
        name: str,
        op: _Op,
        inputs: tuple[tuple[Any, ...], list[torch.Tensor], list[int]],
        add_operands: tuple[int, int] | None,
    ) -> None:
        """A node for output ``t`` of op ``name``; ``inputs``: the op's arguments, tensors and
        their nodes."""
        g = self.g
        args, in_tensors, in_nodes = inputs
        n = self._new(
            t,
            name,
            op.act_in,
            op.act,
            op.param_const,
            op.uses_param,
            op.owner,
            op.sources,
            op.weight,
        )
        if op.weight:
            g.weight_shapes[n] = op.weight_shapes
        if op.act and in_nodes:
            self._alias(n, name, args, in_tensors, in_nodes)
        if add_operands is not None and op.act:
            g.adds.append((n, *add_operands))
            if self.stack:
                g.add_order[n] = self.extent_adds.get(self.stack[-1], 0)
        elif name in SOFTMAX_OPS and op.act:
            g.softmaxes.append(n)

    def _write_through(self, view: torch.Tensor) -> None:
        """An in-place op wrote into a view: its base holds what was written too (DeepSeek-V2
        fills a ``new_empty`` key tensor through slices, ``k[..., :d].copy_(k_nope)``)."""
        base = view._base
        if base is None:
            return
        n, b = self._lookup(view), self._lookup(base)
        if n is None or b is None:
            return
        g = self.g
        act_in = tuple(i for i in (b, n) if g.act[i])
        self._new(base, "__setitem__", act_in, act=True, param_src=g.param_src[b])

    def _weights(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], params: list[int]
    ) -> tuple[str, ...]:
        """Qualified names of the parameters an op applies as weights (matrices, kernels)."""
        g = self.g
        if name in MHA_OPS:
            index = MHA_OPS[name]
            w = kwargs.get("out_proj_weight", args[index] if len(args) > index else None)
            n = self._lookup(w) if isinstance(w, torch.Tensor) else None
            return self._resolve(g.param_src[n]) if n is not None else ()
        if name not in WEIGHT_OPS:
            return ()
        return self._resolve(
            tuple(dict.fromkeys(q for n in params if len(g.shape[n]) >= 2 for q in g.param_src[n]))
        )

    def _alias(
        self,
        n: int,
        name: str,
        args: tuple[Any, ...],
        in_tensors: list[torch.Tensor],
        in_nodes: list[int],
    ) -> None:
        g = self.g
        first = in_nodes[0]
        if name in EXACT_VIEW_OPS and g.act[first]:
            g.alias[n], g.alias_parent[n], g.exact[n] = g.alias[first], first, g.exact[first]
        elif name in PASS_OPS and g.act[first]:
            g.alias[n], g.alias_parent[n] = g.alias[first], first
        elif name in SCALE_OPS and len(args) == 2:
            factor = _scalar_factor(args, in_tensors, in_nodes, g)
            if factor is not None:
                src, value = factor
                value = 1.0 / value if name.startswith(("div", "__truediv__")) else value
                g.alias[n], g.alias_parent[n], g.factor[n] = g.alias[src], src, value


def _picks_matrices(g: Graph, index: tuple[int, ...], params: list[int]) -> bool:
    """Whether a parameter read only through computed integer indices gives a parameter's
    values rather than an activation: one slice of it (one index), or matrices picked from a
    stack of them (a 3-D expert weight indexed by the tokens' expert ids, as batched experts
    do). Rows picked from a table by token ids are an embedding lookup: an activation."""
    if any(g.floating[n] for n in index):
        return False
    one = all(math.prod(g.shape[n]) <= 1 for n in index)
    return one or all(len(g.shape[p]) >= 3 for p in params)


def _scalar_factor(
    args: tuple[Any, ...], in_tensors: list[torch.Tensor], in_nodes: list[int], g: Graph
) -> tuple[int, float] | None:
    """For `x * c` with c a Python number or a one-element constant tensor: (node of x, c)."""
    acts = [(t, n) for t, n in zip(in_tensors, in_nodes, strict=True) if g.act[n]]
    if len(acts) != 1:
        return None
    others = [a for a in args if a is not acts[0][0]]
    if len(others) != 1:
        return None
    c = others[0]
    if isinstance(c, int | float) and not isinstance(c, bool) and c != 0:
        return acts[0][1], float(c)
    if isinstance(c, torch.Tensor) and c.numel() == 1 and not isinstance(c, nn.Parameter):
        value = float(c.detach().float().reshape(()))
        return (acts[0][1], value) if value != 0 else None
    return None


def trace(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    capture: Callable[[nn.Module], bool],
) -> Graph:
    """Run ``model(*args, **kwargs)`` once under no_grad and record its dataflow.

    Modules for which ``capture(module)`` is true keep the inputs of their first call
    (for behaviour probes). Every hook is removed, also when the forward raises.
    """
    rec = _Recorder(model, capture)
    rec.attach(model)
    try:
        with torch.no_grad(), scripted_functions_as_python(), rec:
            rec.inputs((args, kwargs))
            model(*args, **kwargs)
    finally:
        rec.detach()
    return rec.g


_COMPILED_CALL: Callable[..., Any] = torch.jit.ScriptFunction.__call__
_as_python_depth = 0


def _call_as_python(fn: Any, *args: Any, **kwargs: Any) -> Any:
    source = getattr(fn, "_torchdynamo_inline", None)
    return (source or partial(_COMPILED_CALL, fn))(*args, **kwargs)


@contextmanager
def scripted_functions_as_python() -> Iterator[None]:
    """Run each TorchScript function (``torch.jit.script`` on a function) as the Python
    function it was compiled from, while the context is active (nested contexts share it): the
    TorchScript interpreter runs its ops out of a `TorchFunctionMode`'s sight (x-transformers
    soft-caps attention logits in one), the Python function runs the same ops in sight."""
    global _as_python_depth
    _as_python_depth += 1
    torch.jit.ScriptFunction.__call__ = _call_as_python  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _as_python_depth -= 1
        if not _as_python_depth:
            torch.jit.ScriptFunction.__call__ = _COMPILED_CALL  # type: ignore[method-assign]
