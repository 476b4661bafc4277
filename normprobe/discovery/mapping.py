"""`discover`: one read-only call that maps a model's norms, stacks, residual adds and heads."""

from __future__ import annotations

import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import norms as norm_rules
from .attention import find_attention
from .model_map import (
    Anchor,
    AttentionImpl,
    Attention,
    EpsPlacement,
    ModelMap,
    NormLayer,
    NormRole,
    Placement,
    ResidualAdd,
    Stack,
)
from .residual import FoundAdd, find_residual_adds
from .stacks import FoundStack, executed_stacks, structural_stacks
from .trace import Graph, Key, trace


class DiscoveryWarning(UserWarning):
    """A model lacks something normprobe looks for (norms, residual adds)."""


_GEMMA_GAIN = re.compile(r"^(Gemma\d*|RecurrentGemma|PaliGemma)RMSNorm$")


def discover(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> ModelMap:
    """Map what ``model`` contains, without changing it.

    With example inputs, observes one forward pass (under ``no_grad``, in the model's current
    train/eval mode) to find residual adds, norm roles, attention, the output head and the
    behaviour of norm classes it does not know. Without them, reports what the module tree alone
    shows. Parameters, buffers, hooks, training modes and the random number generators are the
    same afterwards.

    Args:
        model: any ``nn.Module``.
        *example_args: positional inputs for one forward call.
        **example_kwargs: keyword inputs for it (``input_ids=...`` for HF models).

    Returns:
        A `ModelMap`; ``print()`` it for a table.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        Exception: whatever the model's forward raises on the example inputs, with a note that
            discovery was running.

    Example::

        >>> m = normprobe.discover(model, torch.randint(0, 100, (2, 16)))
        >>> print(m)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"discover() needs a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}"
        )
    traced = bool(example_args or example_kwargs)
    candidates = {
        id(m) for m in model.modules() if norm_rules.is_probe_candidate(m) or _named_norm(m)
    }
    g: Graph | None = None
    # behaviour probes call modules too: the model's own hooks stay silent until the end
    with read_only(model):
        start = time.perf_counter()
        if traced:
            try:
                g = trace(model, example_args, example_kwargs, lambda m: id(m) in candidates)
            except Exception as err:
                err.add_note(
                    "(raised while normprobe.discover ran one forward pass of "
                    f"{type(model).__name__} on the example inputs it was given; "
                    "pass inputs that model(*args, **kwargs) accepts)"
                )
                raise
        trace_ms = (time.perf_counter() - start) * 1e3
        return _Builder(model, g, trace_ms).build()


def _named_norm(m: nn.Module) -> bool:
    return norm_rules.name_match(m) is not None and not norm_rules.has_param_children(m)


def discover_on_first_forward(
    model: nn.Module, callback: Callable[[ModelMap], None]
) -> RemovableHandle:
    """Discover ``model`` on the inputs of its next forward call, then pass the map on.

    The forward itself then runs as usual. Returns the handle of the one-shot hook, to cancel
    it before that forward happens.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__qualname__}")

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        callback(discover(module, *args, **kwargs))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return handle


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@contextmanager
def read_only(model: nn.Module, silence_hooks: bool = True) -> Iterator[None]:
    """No grad, forked RNGs; buffers (BatchNorm statistics), modes and, unless asked to keep
    them running, the model's own forward hooks (silenced meanwhile) restored on exit.

    Hooks of ``torch.distributed`` (FSDP2's unsharding, tensor parallelism) keep running: the
    forward needs them. FSDP2 modules are resharded on exit, as they were before.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    hooks = (
        [(m, {name: getattr(m, name) for name in _HOOK_DICTS}) for m in model.modules()]
        if silence_hooks
        else []
    )
    for m, saved in hooks:
        kept = {
            key
            for name in ("_forward_pre_hooks", "_forward_hooks")
            for key, hook in saved[name].items()
            if _is_distributed_hook(hook)
        }
        for name, value in saved.items():
            setattr(m, name, type(value)((k, v) for k, v in value.items() if k in kept))
    cuda = sorted(
        {t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.is_cuda}
    )
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for m, mode in modes:
            m.training = mode
        for m, saved in hooks:
            for name, value in saved.items():
                setattr(m, name, value)
        _reshard(model)


def _is_distributed_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", None)).startswith("torch.distributed.")


def _reshard(model: nn.Module) -> None:
    """Register FSDP2's sharded parameters again (a forward leaves the root's unsharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module exists
    if fsdp is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()


class _Builder:
    """Turns a traced graph (or just the module tree) into a `ModelMap`."""

    def __init__(self, model: nn.Module, g: Graph | None, trace_ms: float) -> None:
        self.model = model
        self.g = g
        self.trace_ms = trace_ms
        self.notes: list[str] = []
        self._seen_at: dict[int, list[tuple[int, tuple[int, str, int, Key]]]] | None = None
        self.weight_layers = {
            path
            for path, m in model.named_modules()
            if any(p.ndim >= 2 for p in m.parameters(recurse=False))
        }

    def build(self) -> ModelMap:
        g = self.g
        stacks = structural_stacks(self.model)
        if g is not None:
            stacks = executed_stacks(stacks, g)
        self.stacks = stacks
        # block path -> (stack, index); a path's blocks are found among its dotted prefixes
        self.blocks = {b: (s.path, i) for s in stacks for i, b in enumerate(s.blocks)}
        first_call: dict[str, int] = {}
        if g is not None:
            for cid, call in enumerate(g.calls):
                first_call.setdefault(call.path, cid)
        self.first_call = first_call
        found_norms = self._norms()
        adds = find_residual_adds(g, self.weight_layers) if g is not None else []
        attention = find_attention(g) if g is not None else {}
        roles, add_norms = self._roles(found_norms, adds, attention)
        norms = [
            NormLayer(**fields, role=roles.get(fields["path"], "other"), **self._where(path))
            for path, fields in found_norms.items()
        ]
        ordinals: dict[int, int] = {}
        residual_adds = []
        for i, a in enumerate(adds):
            ordinals[a.call] = ordinals.get(a.call, -1) + 1
            residual_adds.append(self._add(a, ordinals[a.call], add_norms.get(i, {})))
        map_stacks = [self._stack(s, norms, residual_adds) for s in stacks]
        model_map = ModelMap(
            model_type=type(self.model).__name__,
            norms=norms,
            stacks=map_stacks,
            residual_adds=residual_adds,
            attention=[Attention(p, impl, **self._where(p)) for p, impl in attention.items()],
            head=self._head(),
            traced=g is not None,
            trace_ms=self.trace_ms if g is not None else 0.0,
            notes=self.notes,
        )
        self._warn(model_map)
        return model_map

    # norms ---------------------------------------------------------------------------------
    def _norms(self) -> dict[str, dict[str, Any]]:
        g = self.g
        cache: dict[tuple[type, float | None, int], norm_rules.Behaviour | None] = {}
        found: dict[str, dict[str, Any]] = {}
        for path, m in self.model.named_modules():
            kind = norm_rules.torch_kind(m)
            named = norm_rules.name_match(m) if not norm_rules.has_param_children(m) else None
            eps, eps_attr = norm_rules.eps_of(m)
            behaviour = None
            probed = False
            call = self.first_call.get(path)
            exact_torch = type(m).__module__.startswith("torch.")
            if g is not None and call is not None and g.calls[call].inputs is not None:
                args, kwargs = g.calls[call].inputs  # type: ignore[misc]
                if not exact_torch or (kind is None and named is not None):
                    key = (type(m), eps, _ndim(args, kwargs))
                    if key not in cache:
                        cache[key] = norm_rules.probe(m, args, kwargs, eps)
                    behaviour, probed = cache[key], True
            tanh = norm_rules.tanh_replacement(m)
            if kind is None and named is None and behaviour is None and tanh is None:
                continue
            cls = type(m).__name__
            if tanh is not None:
                kind, how = "dyt", f"class name {tanh}"
            elif kind is not None:
                base = next(
                    c.__name__ for c in type(m).__mro__ if c.__module__.startswith("torch.nn")
                )
                how = f"torch class nn.{cls}" if exact_torch else f"subclass of nn.{base}"
            elif named is not None:
                kind = behaviour.kind if behaviour is not None else norm_rules.kind_from_name(named)
                how = f"class name {named}"
                if behaviour is not None:
                    how += "; kind by behaviour"
                elif probed:
                    how += "; behaviour probe disagreed"
                    self.notes.append(
                        f"{path or '<root>'} ({cls}) is named like a norm but its output did "
                        "not behave like one on the example input; listed as a norm anyway"
                    )
            else:
                assert behaviour is not None
                kind = behaviour.kind
                how = f"behaviour ({behaviour.layout} statistics)"
            found[path] = dict(
                path=path,
                kind=kind,
                class_name=cls,
                dims=self._dims(m, behaviour),
                layout=behaviour.layout if behaviour else norm_rules.torch_layout(m),
                affine=tuple(n for n, _ in m.named_parameters(recurse=False)),
                eps=eps,
                eps_attr=eps_attr,
                eps_placement=_eps_placement(m, exact_torch, behaviour),
                gain_offset=self._gain_offset(m, behaviour),
                recognized_by=how,
            )
        return found

    @staticmethod
    def _dims(m: nn.Module, behaviour: norm_rules.Behaviour | None) -> tuple[int, ...]:
        dims = norm_rules.torch_dims(m)
        if dims:
            return dims
        if behaviour is not None and behaviour.dims:
            return behaviour.dims
        weight = getattr(m, "weight", None)
        return tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()

    @staticmethod
    def _gain_offset(m: nn.Module, behaviour: norm_rules.Behaviour | None) -> float | None:
        if behaviour is not None:
            return behaviour.gain_offset
        if not any(True for _ in m.parameters(recurse=False)):
            return None
        named = [c.__name__ for c in type(m).__mro__]
        return 1.0 if any(_GEMMA_GAIN.match(n) for n in named) else 0.0

    # roles -----------------------------------------------------------------------------------
    def _roles(
        self,
        found_norms: dict[str, dict[str, Any]],
        adds: list[FoundAdd],
        attention: dict[str, AttentionImpl],
    ) -> tuple[dict[str, NormRole], dict[int, dict[str, str]]]:
        g = self.g
        roles: dict[str, NormRole] = {}
        add_norms: dict[int, dict[str, str]] = {}
        if g is None:
            return roles, add_norms
        io: dict[str, tuple[int, int]] = {}
        for path in found_norms:
            cid = self.first_call.get(path)
            if cid is None:
                continue
            call = g.calls[cid]
            if call.in_node is not None and call.out_node is not None:
                io[path] = (g.alias[call.in_node], call.out_node)
        branch_of = {g.alias[a.branch]: i for i, a in enumerate(adds)}
        skip_of: dict[int, list[int]] = {}
        sum_of = {a.out: i for i, a in enumerate(adds)}
        for i, a in enumerate(adds):
            skip_of.setdefault(g.alias[a.skip], []).append(i)
        # pre norms first: sandwich-post needs to know whether the branch has one
        for path, (inp, out) in io.items():
            for i in skip_of.get(inp, []):
                if out in adds[i].region:
                    roles[path] = "pre"
                    add_norms.setdefault(i, {})["pre_norm"] = path
                    break
        stack_ends = self._stack_ends(adds)
        in_branch = set().union(*(a.region for a in adds)) if adds else set()
        for path, (inp, out) in io.items():
            if path in roles:
                continue
            if g.alias[out] in branch_of:
                i = branch_of[g.alias[out]]
                if "pre_norm" in add_norms.get(i, {}):
                    roles[path] = "sandwich-post"
                    add_norms[i]["sandwich_norm"] = path
                else:
                    roles[path] = "branch"
            elif inp in sum_of and self._same_block(path, adds[sum_of[inp]]):
                roles[path] = "post"
                add_norms.setdefault(sum_of[inp], {})["post_norm"] = path
            elif any(path.startswith(att + ".") for att in attention):
                roles[path] = "qk"
            elif self._block_of(path) is None and any(
                inp >= end and end in g.region(inp, end - 1)[0] for end in stack_ends
            ):
                roles[path] = "final"
            elif out in in_branch or inp in in_branch:
                roles[path] = "branch"
        return roles, add_norms

    def _same_block(self, norm: str, add: FoundAdd) -> bool:
        """A post norm sits in the block of the add it follows: no stack separates them."""
        norm_blocks = dict(self._blocks_of(norm))
        if not norm_blocks:
            return False
        add_blocks = self._blocks_of(self._add_anchor_path(add))
        return all(norm_blocks.get(stack, index) == index for stack, index in add_blocks)

    def _stack_ends(self, adds: list[FoundAdd]) -> list[int]:
        last: dict[str, int] = {}
        for a in adds:
            stack = self._where(self._add_anchor_path(a))["stack"]
            if stack is not None:
                last[stack] = max(last.get(stack, -1), a.out)
        return sorted(last.values())

    # residual adds ----------------------------------------------------------------------------
    def _add_anchor_path(self, a: FoundAdd) -> str:
        """The path that decides an add's stack: its branch's last layer, else its module."""
        assert self.g is not None
        module = self.g.calls[a.call].path
        if a.layers and self._block_of(a.layers[-1]) is not None:
            return a.layers[-1]
        return module

    def _add(self, a: FoundAdd, ordinal: int, norms: dict[str, str]) -> ResidualAdd:
        g = self.g
        assert g is not None
        call = g.calls[a.call]
        where = self._where(self._add_anchor_path(a))
        return ResidualAdd(
            module=call.path,
            call=call.index,
            ordinal=ordinal,
            kind="identity" if a.kind == "identity" else "projection",
            stack=where["stack"],
            block=where["block"],
            branch_out=a.layers[-1] if a.layers else None,
            branch_layers=a.layers,
            skip_scale=a.skip_scale,
            pre_norm=norms.get("pre_norm"),
            post_norm=norms.get("post_norm"),
            sandwich_norm=norms.get("sandwich_norm"),
            anchor=self._anchor(a),
        )

    def _anchor(self, a: FoundAdd) -> Anchor:
        g = self.g
        assert g is not None
        if self._seen_at is None:  # boundary events by the value they show, in one pass
            self._seen_at = {}
            for node, event in g.boundary.items():
                self._seen_at.setdefault(g.exact[node], []).append((node, event))
        best = None
        for node, event in self._seen_at.get(a.out, []):
            if node >= a.out and (best is None or event < best):
                best = event
        if best is None:  # only the forward that computed it sees it: count adds there
            call = g.calls[a.call]
            return Anchor("inside", call.path, call.index, (g.add_order[a.out],))
        _, hook, cid, key = best
        call = g.calls[cid]
        return Anchor("pre" if hook == "pre" else "post", call.path, call.index, key)

    # stacks ------------------------------------------------------------------------------------
    def _blocks_of(self, path: str) -> list[tuple[str, int]]:
        """(stack, block index) of every block containing ``path``, innermost first."""
        parts = path.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        return [self.blocks[p] for p in prefixes if p in self.blocks]

    def _block_of(self, path: str) -> tuple[str, int] | None:
        found = self._blocks_of(path)
        return found[0] if found else None

    def _where(self, path: str) -> dict[str, Any]:
        found = self._block_of(path)
        return {"stack": found[0], "block": found[1]} if found else {"stack": None, "block": None}

    def _stack(self, s: FoundStack, norms: list[NormLayer], adds: list[ResidualAdd]) -> Stack:
        def inside(path: str) -> bool:
            return any(stack == s.path for stack, _ in self._blocks_of(path))

        mine = [a for a in adds if a.stack == s.path or inside(a.module)]
        by_path = {n.path: n for n in norms}
        roles = {n.role for n in norms if inside(n.path)}
        for a in mine:
            for p in (a.pre_norm, a.post_norm, a.sandwich_norm):
                if p is not None:
                    roles.add(by_path[p].role)
        placement: Placement
        if "post" in roles and "pre" in roles:
            placement = "mixed"
        elif "post" in roles:
            placement = "deepnorm" if any(a.skip_scale > 1 + 1e-6 for a in mine) else "post-ln"
        elif "pre" in roles:
            placement = "sandwich" if "sandwich-post" in roles else "pre-ln"
        elif roles & {"branch", "sandwich-post"}:
            placement = "in-branch"
        else:
            placement = "no-norm"
        parent = next((stack for stack, _ in self._blocks_of(s.path) if stack != s.path), None)
        return Stack(s.path, tuple(s.blocks), s.block_type, placement, "qk" in roles, parent)

    # head ----------------------------------------------------------------------------------------
    def _head(self) -> str | None:
        g = self.g
        if g is None or not g.root_outputs:
            return None
        _, node = next(
            ((k, n) for k, n in g.root_outputs if "logits" in k),
            g.root_outputs[0],
        )
        for _ in range(16):
            owner = g.owner[node]
            if g.uses_param[node]:
                return owner if owner in self.weight_layers else None
            if len(g.inputs[node]) != 1:
                return None
            node = g.inputs[node][0]
        return None

    def _warn(self, m: ModelMap) -> None:
        name = type(self.model).__name__
        if not m.norms:
            m.notes.append("no normalization layers found")
            warnings.warn(f"normprobe found no normalization layers in {name}", DiscoveryWarning, 4)
        if m.traced and not m.residual_adds:
            m.notes.append("no residual adds found in the traced forward")
            warnings.warn(
                f"normprobe found no residual adds (x + f(x)) in one forward of {name}",
                DiscoveryWarning,
                4,  # the caller of discover()
            )


def _eps_placement(
    m: nn.Module, exact_torch: bool, behaviour: norm_rules.Behaviour | None
) -> EpsPlacement:
    if exact_torch:
        return "inside-sqrt"  # torch's norms all compute sqrt(var + eps)
    if behaviour is not None:
        return behaviour.eps_placement
    return "inside-sqrt" if norm_rules.torch_kind(m) is not None else "unknown"


def _ndim(args: Any, kwargs: Any) -> int:
    found = norm_rules._first_float_input(args, kwargs)
    return found[1].ndim if found else -1
