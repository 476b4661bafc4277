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
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..nested import iter_tensors
from ..probes.shards import held_part
from .composite import mark_composite
from .graph import Call, Graph
from .ops import (
    ADD_OPS,
    BROADCAST_OPS,
    EXACT_VIEW_OPS,
    FIRST_ONLY_OPS,
    FUSED_ADD_OPS,
    IGNORED_OPS,
    MHA_OPS,
    PASS_OPS,
    PROPERTY_OPS,
    SCALE_OPS,
    SDPA_OPS,
    SHAPE_ONLY_OPS,
    SOFTMAX_OPS,
    WEIGHT_OPS,
)


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
        held = held_part(t)  # a DTensor wrapping a traced tensor (tensor parallelism's inputs)
        return None if held is None else self._lookup(held)

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
        held = held_part(t)  # what a DTensor's to_local() views: the same node
        if held is not None:
            self.ids[id(held)] = (weakref.ref(held), n)
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
        mark_composite(g, cid)  # a LoRA layer's sum: one weight op of the layer

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
        if name == "__get__":
            name = PROPERTY_OPS.get(getattr(getattr(func, "__self__", None), "__name__", ""), name)
        if name in IGNORED_OPS:
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
        op = self._classify(name, args, kwargs, in_nodes, in_tensors)
        for t in outs:
            self._record(t, name, op, (args, in_tensors, in_nodes), add_operands)
        if name in FUSED_ADD_OPS and op.weight and in_nodes and self.g.act[in_nodes[0]]:
            self.g.fused_skips.append(self.node(outs[0]))
        if add_operands is not None:
            for cid in self.stack:
                self.extent_adds[cid] = self.extent_adds.get(cid, 0) + 1
        if op.act and in_tensors and outs[0] is in_tensors[0]:
            self._write_through(in_tensors[0])
        if name == "multi_head_attention_forward" and self.stack:
            heads = args[4] if len(args) > 4 else kwargs.get("num_heads")
            if isinstance(heads, int):
                self.g.mha_calls.append((self.stack[-1], heads))
        if name in SDPA_OPS:
            self.g.sdpa_calls.append(self.stack[-1] if self.stack else None)
            query = args[0] if args else kwargs.get("query")
            self.g.sdpa_queries.append(
                tuple(query.shape) if isinstance(query, torch.Tensor) else ()
            )
        return out

    def _classify(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_nodes: list[int],
        in_tensors: list[torch.Tensor],
    ) -> _Op:
        """What an op's outputs are: activations or parameter constants, and the weight layer
        applying parameters to an activation."""
        g = self.g
        data_in = in_nodes[:1] if name in FIRST_ONLY_OPS else in_nodes
        act_in = tuple(n for n in data_in if g.act[n])
        params = [n for n in data_in if g.param_const[n]]
        if name in SHAPE_ONLY_OPS:
            act_in, params = (), []
        # complex activations (FEDformer's Fourier modes) are values, never indices
        values = {n for n, t in zip(in_nodes, in_tensors, strict=True) if t.is_complex()}
        if params and act_in and not values & set(act_in) and _picks_matrices(g, act_in, params):
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
