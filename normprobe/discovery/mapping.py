"""`discover`: one read-only call that maps a model's norms, stacks, residual adds and heads."""

from __future__ import annotations

import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import norms as norm_rules
from .attention import find_attention
from .doubts import doubts, merged
from .model_map import (
    Anchor,
    Attention,
    Doubt,
    EpsPlacement,
    ModelMap,
    NormLayer,
    NormPlacement,
    NormRole,
    Placement,
    ResidualAdd,
    Stack,
)
from .residual import FoundAdd, find_residual_adds
from .stacks import (
    FoundStack,
    common_path,
    executed_stacks,
    grouped_sublayers,
    skipped_blocks,
    stream_runs,
    structural_stacks,
    unpacked_stacks,
)
from .state import preserved
from .trace import (
    ADD_OPS,
    MATMUL_OPS,
    SCALE_OPS,
    SDPA_OPS,
    SOFTMAX_OPS,
    Graph,
    Key,
    trace,
)


class DiscoveryWarning(UserWarning):
    """A model lacks something normprobe looks for (norms, residual adds)."""


_MUL_OPS = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__"})
# Ops that keep a tensor's values and layout (but maybe not its dtype).
_CAST_OPS = frozenset({"to", "float", "type", "type_as", "contiguous", "clone", "detach"})
_GEMMA_GAIN = re.compile(r"^(Gemma\d*|RecurrentGemma|PaliGemma)RMSNorm$")


def discover(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> ModelMap:
    """Map what ``model`` contains, without changing it.

    With example inputs, observes one forward pass (under ``no_grad``, in the model's current
    train/eval mode; a second one in eval mode when a block of a container was skipped, as
    LayerDrop does in training) to find residual adds, norm roles, attention, the output head
    and the behaviour of norm classes it does not know. Without them, reports what the module
    tree alone shows. Parameters, buffers, hooks, training modes and the random number
    generators are the same afterwards.

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
    # behaviour probes call modules too: an attached probe's hooks stay silent until the end
    with read_only(model):  # modes restored on exit
        start = time.perf_counter()
        if traced:
            try:
                g = trace(model, example_args, example_kwargs, lambda m: id(m) in candidates)
                if model.training and skipped_blocks(structural_stacks(model), g):
                    # LayerDrop or stochastic depth skipped a block: in eval mode every one runs
                    model.eval()
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


def discover_on_carried(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ModelMap:
    """`discover` on inputs the model carries (transformers' ``dummy_inputs``, which the user
    did not choose): the module tree alone when the model does not run on them, as an
    encoder-decoder's dummy inputs without decoder ids or a dual encoder's without images."""
    try:
        return discover(model, *args, **kwargs)
    except Exception:
        return discover(model)


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


@contextmanager
def read_only(model: nn.Module, silence_hooks: bool = True) -> Iterator[None]:
    """No grad, forked RNGs; buffers (BatchNorm statistics) and modes restored on exit.

    The model's own forward hooks run (a forward may need them: transformers collects hidden
    states with hooks); normprobe's own hooks (an attached probe's) are silenced meanwhile,
    unless ``silence_hooks`` is False. FSDP2 modules are resharded on exit, as they were before.
    """
    # (live hook dict, its key order, normprobe's hooks taken out): edited in place, so hooks
    # the forward itself installs (transformers' output capturing) stay installed
    silenced: list[tuple[dict[int, Any], list[int], dict[int, Any]]] = []
    if silence_hooks:
        for m in model.modules():
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                live = getattr(m, name)
                ours = {k: h for k, h in live.items() if _is_normprobe_hook(h)}
                if ours:
                    silenced.append((live, list(live), ours))
                    for k in ours:
                        del live[k]
    try:
        with preserved(model), torch.no_grad():
            yield
    finally:
        for live, order, ours in silenced:
            rank = {k: i for i, k in enumerate(order)}
            items = sorted({**live, **ours}.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            live.clear()
            live.update(items)
        _reshard(model)


def _is_normprobe_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", None)).startswith("normprobe.")


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
        self.weight_layers: set[str] = set()
        self._consumers: dict[int, list[int]] | None = None  # node -> nodes reading it
        self._pre_normed: list[bool] = []  # per add: whether a pre norm feeds its branch
        self.runs: list[list[int]] = []  # the adds (indices) along each stream, in order

    def build(self) -> ModelMap:
        g = self.g
        self.first_call = g.first_calls() if g is not None else {}
        found_norms = self._norms()
        adds = find_residual_adds(g, self._norm_calls(found_norms)) if g is not None else []
        self.adds = adds
        if g is not None:
            self.weight_layers = {o for n, o in enumerate(g.owner) if g.weight[n] and o is not None}
            self.runs = stream_runs(g, adds)
            sums = sorted(a.out for a in adds)
            found = executed_stacks(
                structural_stacks(self.model), g, self._holds_add, sums, self._sublayers
            )
            found = [
                grouped_sublayers(s, self.model, [self._adds_in_block(b) for b in s.blocks])
                for s in self._without_lone_sublayers(found)
            ]
            stacks = self._with_unpacked(found)
        else:  # without a forward only the module tree shows: containers of one class
            stacks = [s for s in structural_stacks(self.model) if s.generic]
        self.stacks = stacks
        # block path -> (stack, index); a path's blocks are found among its dotted prefixes
        self.blocks = {
            b: (s.path, i)
            for s in stacks
            if not s.repeated
            for i, members in enumerate(s.members or [[b] for b in s.blocks])
            for b in members
        }
        self.repeated = {s.blocks[0]: s.path for s in stacks if s.repeated}
        attention = find_attention(g) if g is not None else {}
        self.add_where = [self._add_where(a) for a in adds]
        roles, add_norms = self._roles(found_norms, adds)
        norms = [
            NormLayer(**fields, role=roles.get(fields["path"], "other"), **self._where(path))
            for path, fields in found_norms.items()
        ]
        ordinals: dict[int, int] = {}
        residual_adds = []
        for i, a in enumerate(adds):
            ordinals[a.call] = ordinals.get(a.call, -1) + 1
            residual_adds.append(
                self._add(a, self.add_where[i], ordinals[a.call], add_norms.get(i, {}), norms)
            )
        map_stacks = [self._stack(s, norms, residual_adds) for s in stacks]
        model_map = ModelMap(
            model_type=type(self.model).__name__,
            norms=norms,
            stacks=map_stacks,
            residual_adds=residual_adds,
            attention=[
                Attention(p, impl, heads=heads, **self._where(p))
                for p, (impl, heads) in attention.items()
            ],
            head=self._head(),
            traced=g is not None,
            trace_ms=self.trace_ms if g is not None else 0.0,
            notes=self.notes,
            weight_layers=tuple(
                p for p, _ in self.model.named_modules() if p in self.weight_layers
            ),
        )
        if g is not None:
            model_map.doubts += self._unattached_writers(residual_adds)
            model_map.doubts += self._nested_doubts(model_map)
        model_map.doubts = merged(model_map.doubts, doubts(model_map, self.model))
        self._warn(model_map)
        return model_map

    # norms ---------------------------------------------------------------------------------
    def _norm_calls(self, found_norms: dict[str, dict[str, Any]]) -> frozenset[int]:
        g = self.g
        assert g is not None
        return frozenset(cid for cid, call in enumerate(g.calls) if call.path in found_norms)

    def _norms(self) -> dict[str, dict[str, Any]]:
        g = self.g
        cache: dict[tuple[type, float | None, tuple[int, ...]], norm_rules.Behaviour | None] = {}
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
                    key = (type(m), eps, _shape(args, kwargs))
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
                        "not behave like one on the example input (or it could not be run on "
                        "variations of it); listed as a norm anyway"
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
        if g is not None:
            found = self._fold_wrappers(found)
        return found

    def _fold_wrappers(self, found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """One normalization is one norm: a parameter-free norm whose output its enclosing
        modules only multiply by and add their own parameters to (``self.ln(x) * self.gamma``)
        is listed once, as the outermost of them, with their gain and bias."""
        modules = dict(self.model.named_modules())
        folded: dict[str, str] = {}  # wrapper -> the norm it wraps
        for path in found:
            if any(True for _ in modules[path].parameters()):
                continue
            outer = path
            while outer and self._wraps(parent := outer.rpartition(".")[0], path, modules):
                outer = parent
            if outer != path:
                folded[outer] = path
        if not folded:
            return found
        for outer, inner in folded.items():
            found[outer] = self._wrapper_entry(outer, inner, found[inner], modules[outer])
        drop = set(folded.values()) | {p for p in found if any(_within(p, o) for o in folded)}
        drop -= set(folded)
        return {p: found[p] for p in modules if p in found and p not in drop}

    def _wraps(self, outer: str, norm: str, modules: dict[str, nn.Module]) -> bool:
        """Whether all ``outer`` computes is the norm at ``norm`` on its input, times a gain
        and plus a bias of its own: every parameter below it is its own, the norm reads its
        input (through casts) and its output comes from the norm's (`_affine_chain`)."""
        g = self.g
        assert g is not None
        m = modules[outer]
        own = {id(p) for p in m.parameters(recurse=False)}
        if any(id(p) not in own for p in m.parameters()):
            return False
        if any(True for p, _ in m.named_buffers() if not _within(f"{outer}.{p}", norm)):
            return False  # a buffer could scale the output too (only parameters are seen)
        cid = self.first_call.get(outer)
        if cid is None:
            return False
        call = g.calls[cid]
        inner = [
            c for c in g.calls if c.path == norm and call.first_node <= c.first_node < call.end_node
        ]
        if len(inner) != 1 or not (call.in_nodes and call.out_nodes and inner[0].out_nodes):
            return False
        if not inner[0].in_nodes or not _affine_chain(g, call.in_nodes[0], inner[0].in_nodes[0]):
            return False
        names = frozenset(
            f"{outer}.{n}" if outer else n for n, _ in m.named_parameters(recurse=False)
        )
        return _affine_chain(g, inner[0].out_nodes[0], call.out_nodes[0], names)

    def _wrapper_entry(
        self, outer: str, inner: str, norm: dict[str, Any], module: nn.Module
    ) -> dict[str, Any]:
        """The norm's entry as the wrapper at ``outer`` presents it."""
        affine = tuple(n for n, _ in module.named_parameters(recurse=False))
        eps, eps_attr = norm_rules.eps_of(module)
        rel = inner[len(outer) + 1 :] if outer else inner
        if eps is None and norm["eps_attr"] is not None:
            eps, eps_attr = norm["eps"], f"{rel}.{norm['eps_attr']}"
        gain_offset = None
        g = self.g
        captured = g.calls[self.first_call[outer]].inputs if g is not None else None
        if affine and captured is not None:
            gain_offset = norm_rules.gain_offset(module, *captured)
        return dict(
            norm,
            path=outer,
            class_name=type(module).__name__,
            affine=affine,
            eps=eps,
            eps_attr=eps_attr,
            gain_offset=gain_offset,
            recognized_by=f"{norm['recognized_by']} at .{rel}, with its wrapper's "
            + ("+".join(affine) if affine else "no parameters"),
            wraps=inner,
        )

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

    def _holds_add(self, block: str) -> bool:
        """Whether a residual add happens inside ``block``, or wraps exactly it (the stream
        enters the block and every writer is inside: ``x = x + block(x)`` in a parent's loop)."""
        g = self.g
        assert g is not None
        calls = [c for c in g.calls if c.path == block]
        inputs = {g.alias[n] for c in calls for n in c.in_nodes}
        for a in self.adds:
            if _within(g.calls[a.call].path, block):
                return True
            writers = [g.owner[n] or "" for n in a.writes.writers]
            inside = bool(writers) and all(_within(w, block) for w in writers)
            if inside and g.alias[a.stream] in inputs:
                return True
        return False

    def _adds_in_block(self, block: str) -> int:
        """How many residual adds ``block`` performs or holds every writer of."""
        return sum(self._add_within(a, block) for a in self.adds)

    def _add_within(self, a: FoundAdd, block: str) -> bool:
        """Whether ``block`` performs add ``a`` or holds every one of its writers."""
        g = self.g
        assert g is not None
        writers = [g.owner[n] or "" for n in a.writes.writers]
        return _within(g.calls[a.call].path, block) or (
            bool(writers) and all(_within(w, block) for w in writers)
        )

    def _sublayers(self, s: FoundStack, nested: bool) -> bool:
        """Whether the blocks of candidate ``s`` are a block's sublayers: a run of residual
        adds goes on past the last of them, into the next entry of the list whose entry holds
        them, and they are of several classes, or of one class beside another inside another
        stack's block (MaxViT's MBConv, window and grid attention; or on within that block:
        ``nn.TransformerDecoderLayer``'s two attentions, then its feed-forward); or into
        another entry, never called, of a list holding the run (``for attn, ff in
        self.layers``)."""
        inside = {
            i for i, a in enumerate(self.adds) if any(self._add_within(a, b) for b in s.blocks)
        }
        following: list[tuple[list[int], int]] = []  # (run, the add after the last inside)
        for run in self.runs:
            last = max((k for k, i in enumerate(run) if i in inside), default=len(run))
            if last + 1 < len(run):
                following.append((run, run[last + 1]))
        modules = dict(self.model.named_modules())
        held = common_path(s.blocks)
        beside = not s.generic and nested and "[" in s.path  # beside a block of another class
        if s.mixed or beside:
            entry = _entry(held, modules)
            if entry is None:
                return False
            parent = entry.rpartition(".")[0]
            return any(
                (
                    (not parent or self._add_within(self.adds[j], parent))
                    and not self._add_within(self.adds[j], entry)
                )
                # or on within the same block: torch's TransformerDecoderLayer's self- and
                # cross-attention, then its feed-forward add
                or (beside and self._add_within(self.adds[j], entry))
                for _, j in following
            )
        for run, _ in following:
            homes = [self._home(self.adds[i]) for i in run]
            container = common_path([h for h in homes if h is not None])
            if not isinstance(modules[container], nn.ModuleList) or not _within(held, container):
                continue
            entry = ".".join(held.split(".")[: len(container.split(".")) + 1])
            if held != container and entry not in self.first_call:
                return True
        return False

    def _without_lone_sublayers(self, found: list[FoundStack]) -> list[FoundStack]:
        """Drop the mixed containers and plain modules' runs held by a block that is no
        stack's block but of a class other stacks have as blocks: the sublayers of a block
        alone in its stage (a MaxViT stage of one layer), not a stack of their own."""
        modules = dict(self.model.named_modules())
        blocks = {b for s in found for b in s.blocks}
        classes = {
            type(modules[b]) for s in found if s.generic and not s.repeated for b in s.blocks
        }

        def lone(s: FoundStack) -> bool:
            holder = s.path.rpartition(".")[0] if s.mixed else s.path.partition("[")[0]
            module = modules.get(holder)
            return (
                holder not in blocks
                and type(module) in classes
                and not isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict)
            )

        return [s for s in found if s.generic or not lone(s)]

    def _with_unpacked(self, found: list[FoundStack]) -> list[FoundStack]:
        """``found`` and the stacks of the stretches of runs no block of them holds, in
        execution order."""
        g = self.g
        assert g is not None
        blocks = [b for s in found for members in s.members or [s.blocks] for b in members]
        held = [any(self._add_within(a, b) for b in blocks) for a in self.adds]
        stretches: list[list[int]] = []
        for run in self.runs:
            for i, previous in zip(run, [None, *run], strict=False):
                if held[i]:
                    continue
                if previous is None or held[previous]:
                    stretches.append([])
                stretches[-1].append(i)
        homes = [self._home(a) for a in self.adds]
        keyed = [(g.calls[self.first_call[s.blocks[0]]].first_node, s) for s in found]
        keyed += unpacked_stacks(self.model, self.adds, stretches, homes)
        return [s for _, s in sorted(keyed, key=lambda item: item[0])]

    def _home(self, a: FoundAdd) -> str | None:
        """The innermost module holding every writer of ``a`` (its weight layers, without)."""
        g = self.g
        assert g is not None
        paths = [g.owner[n] or "" for n in a.writes.writers] or list(a.layers)
        return common_path(paths) if paths else None

    # roles -----------------------------------------------------------------------------------
    def _roles(
        self,
        found_norms: dict[str, dict[str, Any]],
        adds: list[FoundAdd],
    ) -> tuple[dict[str, NormRole], dict[int, dict[str, str]]]:
        """Each norm's role from the dataflow around the residual adds, never from the kind of
        shortcut or where the norm module sits."""
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
            if call.in_nodes and call.out_nodes:  # the first floating-point input and output
                io[path] = (g.alias[call.in_nodes[0]], call.out_nodes[0])
        # a branch's output, also seen before a layer scale multiplies it
        branch_of = {
            n: i for i, a in enumerate(adds) for b in a.branches for n in _before_scales(g, b)
        }
        stream_of: dict[int, list[int]] = {}
        for i, a in enumerate(adds):
            stream_of.setdefault(g.alias[a.stream], []).append(i)
        sum_of = {a.out: i for i, a in enumerate(adds)}
        # a projection add's fork, and what it was activated from
        forks_of: dict[int, list[int]] = {}
        for i, a in enumerate(adds):
            if a.kind == "projection":
                for n in _activated_from(g, a.stream):
                    forks_of.setdefault(n, []).append(i)
        # pre norms first: sandwich-post needs to know whether the branch has one. A pre norm
        # reads the stream an add's branch reads and feeds that branch; in front of a
        # projection shortcut, in the add's own block, its output (or its activation) may be
        # what both sides read.
        for path, (inp, out) in io.items():
            reading = [i for i, a in enumerate(adds) if out in a.region]
            forked = forks_of.get(g.alias[out], [])
            for i in stream_of.get(inp, []) + forked + reading:
                a = adds[i]
                fork = i in forked and self._where(path) == self._where_add(i)
                # it reads the stream itself, or with other tokens joined to it (class attention)
                reads = inp == g.alias[a.stream] or _plain_path(g, g.alias[a.stream], inp)
                if fork or (out in a.region and reads):
                    roles[path] = "pre"
                    add_norms.setdefault(i, {})["pre_norm"] = path
                    break
        readers = {inp: path for path, (inp, _) in io.items() if path not in roles}
        self._pre_normed = ["pre_norm" in add_norms.get(i, {}) for i in range(len(adds))]
        scores_from = _feeding_scores(g)
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
            elif inp in sum_of and (role := self._after_sum(path, sum_of[inp], readers)):
                roles[path] = role
                if role == "post":
                    add_norms.setdefault(sum_of[inp], {})["post_norm"] = path
            elif out in scores_from:
                roles[path] = "qk"
            elif self._follows_stack(path, inp):
                roles[path] = "final"
            elif out in in_branch or inp in in_branch:
                roles[path] = "branch"
        # a norm run several times (a block shared across depth) plays its role at every run
        for call in g.calls:
            role = roles.get(call.path)
            if role is None or call.index == 0 or not (call.in_nodes and call.out_nodes):
                continue
            inp, out = g.alias[call.in_nodes[0]], call.out_nodes[0]
            if role == "post" and inp in sum_of:
                add_norms.setdefault(sum_of[inp], {}).setdefault("post_norm", call.path)
            elif role == "sandwich-post" and g.alias[out] in branch_of:
                norms = add_norms.setdefault(branch_of[g.alias[out]], {})
                norms.setdefault("sandwich_norm", call.path)
            elif role == "pre":
                for i in stream_of.get(inp, []):
                    if out in adds[i].region:
                        add_norms.setdefault(i, {}).setdefault("pre_norm", call.path)
        return roles, add_norms

    def _where_add(self, i: int) -> dict[str, Any]:
        stack, block = self.add_where[i]
        return {"stack": stack, "block": block}

    def _after_sum(self, norm: str, i: int, readers: dict[int, str]) -> NormRole | None:
        """The role of a norm reading add ``i``'s sum, when nothing else reads it (else the
        stream goes on around the norm): ``post`` wherever it sits, except after
        a stack's last add when the same add of most other blocks has no norm on its sum (one
        block without, as a first sublayer left unnormalized, does not decide): then it closes
        the stack (``final``) if it sits in no block the stack is not in, and belongs to what
        follows (a downsample) otherwise."""
        if self._bypassed(self.adds[i].out, norm):
            return None  # the stream goes on around the norm: it does not normalize the sum
        stack, block = self.add_where[i]
        if stack is None and self._pre_normed[i]:
            return None  # one Pre-LN block: the norm after it closes the model, not the block
        if stack is None or self._inside(norm, stack):
            return "post"
        mine = [j for j, (s, _) in enumerate(self.add_where) if s == stack]
        if mine[-1] != i:
            return "post"
        position = [j for j in mine if self.add_where[j][1] == block].index(i)
        others = {b for _, b in (self.add_where[j] for j in mine) if b != block}
        following = 0
        for b in others:
            same = [j for j in mine if self.add_where[j][1] == b]
            if position < len(same) and self.adds[same[position]].out in readers:
                following += 1
        if 2 * following > len(others):  # most blocks normalize this sum: the last one too
            return "post"
        return "final" if self._around(norm) <= self._around_stack(stack) else None

    def _bypassed(self, total: int, norm: str) -> bool:
        """Whether something besides the norm at ``norm`` reads the sum ``total`` (or a view of
        it): then the stream continues around the norm."""
        g = self.g
        assert g is not None
        call = g.calls[self.first_call[norm]]
        todo, seen = [total], {total}
        while todo:
            for c in self._readers().get(todo.pop(), []):
                if call.first_node <= c < call.end_node or c in seen:
                    continue
                if g.alias[c] != g.alias[total]:
                    return True
                seen.add(c)
                todo.append(c)
        return False

    def _readers(self) -> dict[int, list[int]]:
        """Node -> the nodes computed from it."""
        g = self.g
        assert g is not None
        if self._consumers is None:
            self._consumers = {}
            for n, inputs in enumerate(g.inputs):
                for i in inputs:
                    self._consumers.setdefault(i, []).append(n)
        return self._consumers

    def _around(self, path: str) -> set[tuple[str, int | None]]:
        """The blocks (stack, index) holding ``path``."""
        return set(self._blocks_of(path))

    def _around_stack(self, stack: str) -> set[tuple[str, int | None]]:
        return {b for b in self._around(self._stack_blocks(stack)[0]) if b[0] != stack}

    def _follows_stack(self, norm: str, inp: int) -> bool:
        """A norm downstream of a stack's last sum with no weight op between (a pooled stream,
        not a head's conv), in no block the stack is not in."""
        g = self.g
        assert g is not None
        last: dict[str, int] = {}
        for (stack, _), a in zip(self.add_where, self.adds, strict=True):
            if stack is not None:
                last[stack] = max(last.get(stack, -1), a.out)
        outer = self._around(norm)
        for stack, end in last.items():
            if outer <= self._around_stack(stack) and inp >= end and _plain_path(g, end, inp):
                return True
        return False

    # residual adds ----------------------------------------------------------------------------
    def _add_where(self, a: FoundAdd) -> tuple[str | None, int | None]:
        """The stack and block of an add: the innermost block holding its last writer (else
        the module performing it) that also holds that module, if one does: not a stack
        inside its own branch (HGNet's aggregation chain); a repeated block's index is the
        run it happened in."""
        g = self.g
        assert g is not None
        module = g.calls[a.call].path
        writers = [g.owner[n] for n in a.writes.writers]
        anchor = writers[-1] if writers and self._blocks_of(writers[-1] or "") else module
        found = self._blocks_of(anchor or "")
        if not found:
            return None, None
        # a repeated block's stack lists that one block once per run
        holding = [(s, i) for s, i in found if _within(module, self._stack_blocks(s)[i or 0])]
        stack, index = holding[0] if holding else found[0]
        if index is None:  # a repeated block: count its runs up to this add
            block = self._stack_blocks(stack)[0]
            start = g.call[a.writes.writers[-1]] if a.writes.writers else a.call
            c: int | None = start
            while c is not None and g.calls[c].path != block:
                c = g.calls[c].parent
            index = g.calls[c].index if c is not None else None
        return stack, index

    def _add(
        self,
        a: FoundAdd,
        where: tuple[str | None, int | None],
        ordinal: int,
        norms: dict[str, str],
        norm_layers: list[NormLayer],
    ) -> ResidualAdd:
        g = self.g
        assert g is not None
        call = g.calls[a.call]
        w = a.writes
        writers = tuple(dict.fromkeys(o for n in w.writers if (o := g.owner[n]) is not None))
        params = tuple(dict.fromkeys(q for n in w.writers for q in g.weight[n]))
        writers, params = self._with_unrouted(call.path, writers, params)
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
        return ResidualAdd(
            module=call.path,
            call=call.index,
            ordinal=ordinal,
            kind="identity" if a.kind == "identity" else "projection",
            stack=where[0],
            block=where[1],
            branch_out=writers[0] if len(writers) == 1 else None,
            branch_layers=a.layers,
            skip_scale=a.skip_scale,
            skip_gain=next((q for n in a.skip_gains for q in _canonical(g, n)), None),
            pre_norm=norms.get("pre_norm"),
            post_norm=norms.get("post_norm"),
            sandwich_norm=norms.get("sandwich_norm"),
            anchor=self._anchor(a),
            writers=writers,
            writer_params=params,
            gates=tuple(
                dict.fromkeys(
                    o for n in w.gates if (o := g.owner[n]) is not None and o not in writers
                )
            ),
            scales=scales,
            parallel=w.parallel,
            open_path=w.open_path,
        )

    def _unattached_writers(self, adds: list[ResidualAdd]) -> list[Doubt]:
        """A doubt for each weight layer whose output is added into a residual stream, with no
        weight op between, by no residual add that names it a writer or a gate."""
        g = self.g
        assert g is not None
        attached = {p for a in adds for p in (*a.writers, *a.gates)}
        streams = {g.alias[n] for a in self.adds for n in (a.stream, a.out)}
        skips = {a.skip for a in self.adds}
        found: dict[str, None] = {}
        for n, owner in enumerate(g.owner):
            candidate = (
                g.weight[n] and owner is not None and owner not in attached and owner not in found
            )
            if candidate and g.alias[n] not in streams and self._writes_stream(n, streams, skips):
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

    def _writes_stream(self, node: int, streams: set[int], skips: set[int]) -> bool:
        """Whether ``node``'s value reaches, through no weight op, an add making a stream value
        whose other operand is a stream value, a skip or an input of the module adding. A value
        that becomes the stream itself (a stem, token plus position embeddings) writes nothing
        into it."""
        g = self.g
        assert g is not None
        readers = self._readers()
        todo, seen = [node], {node}
        while todo:
            n = todo.pop()
            for c in readers.get(n, []):
                if c in seen or g.weight[c]:
                    continue
                seen.add(c)
                if g.alias[c] in streams:
                    call = g.call[c]
                    entering = (
                        {g.alias[i] for i in g.calls[call].in_nodes} if call is not None else set()
                    )
                    others = [i for i in g.inputs[c] if i != n]
                    if g.op[c] in ADD_OPS and any(
                        g.alias[i] in streams | entering or i in skips for i in others
                    ):
                        return True
                    continue
                todo.append(c)
        return False

    def _with_unrouted(
        self, module: str, writers: tuple[str, ...], params: tuple[str, ...]
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Writers (and their parameters) with the experts the traced forward routed no token
        to: a writer in one member of a ModuleList or ModuleDict (the innermost holding it)
        inside the add's ``module`` stands for the same layer in each member of its class
        that never ran."""
        names = dict(self.model.named_modules())
        more: dict[str, None] = {}
        for w in writers:
            container, member, rest = next(
                (split for split in _member_paths(w) if _is_list(names.get(split[0]))),
                ("", "", ""),
            )
            if not container or not _within(container, module):
                continue
            kind = type(names[f"{container}.{member}"])
            for key, sibling in names[container].named_children():
                path = f"{container}.{key}"
                if type(sibling) is kind and path not in self.first_call:
                    more[f"{path}{rest}"] = None
        extra = tuple(p for p in more if p in names and p not in writers)
        if not extra:
            return writers, params
        self.notes.append(
            f"{len(extra)} layers of experts that no token reached in the traced forward "
            f"counted as writers like the ones that ran ({extra[0]}, ...)"
        )
        held = {p: tuple(n for n, _ in names[p].named_parameters()) for p in extra}
        own = [q for q in params if any(q.startswith(f"{w}.") for w in writers)]
        suffixes = dict.fromkeys(q.rpartition(".")[2] for q in own)
        extra_params = tuple(f"{p}.{a}" for p in extra for a in suffixes if a in held[p])
        return writers + extra, params + extra_params

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
    def _blocks_of(self, path: str) -> list[tuple[str, int | None]]:
        """(stack, block index) of every block containing ``path``, innermost first; a
        repeated block's index is None (it is every block of its stack)."""
        parts = path.split(".") if path else []
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        found: list[tuple[str, int | None]] = []
        for p in prefixes:
            if p in self.repeated:
                found.append((self.repeated[p], None))
            if p in self.blocks:
                found.append(self.blocks[p])
        return found

    def _block_of(self, path: str) -> tuple[str, int | None] | None:
        found = self._blocks_of(path)
        return found[0] if found else None

    def _inside(self, path: str, stack: str) -> bool:
        return any(s == stack for s, _ in self._blocks_of(path))

    def _stack_blocks(self, stack: str) -> list[str]:
        return next(s.blocks for s in self.stacks if s.path == stack)

    def _where(self, path: str) -> dict[str, Any]:
        found = self._block_of(path)
        return {"stack": found[0], "block": found[1]} if found else {"stack": None, "block": None}

    def _stack(self, s: FoundStack, norms: list[NormLayer], adds: list[ResidualAdd]) -> Stack:
        mine = [a for a in adds if a.stack == s.path or self._inside(a.module, s.path)]
        by_path = {n.path: n for n in norms}
        roles = {n.role for n in norms if self._inside(n.path, s.path)}
        for a in mine:
            for p in (a.pre_norm, a.post_norm, a.sandwich_norm):
                if p is not None:
                    roles.add(by_path[p].role)
        norm_placement: NormPlacement
        if not mine and roles <= {"other"}:  # no add, and no norm of another stack's adds
            norm_placement = "no-residual"
        elif "post" in roles and "pre" in roles:
            norm_placement = "mixed"
        elif "post" in roles:
            deep = any(a.skip_scale > 1 + 1e-6 for a in mine)
            norm_placement = "deepnorm" if deep else "post-ln"
        elif "pre" in roles:
            norm_placement = "sandwich" if "sandwich-post" in roles else "pre-ln"
        elif roles & {"branch", "sandwich-post"}:
            norm_placement = "in-branch"
        else:
            norm_placement = "no-norm"
        own = [a for a in adds if a.stack == s.path]
        placement: Placement = "parallel" if any(a.parallel for a in own) else norm_placement
        parent = next((stack for stack, _ in self._blocks_of(s.blocks[0]) if stack != s.path), None)
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

    # doubts --------------------------------------------------------------------------------------
    def _nested_doubts(self, m: ModelMap) -> list[Doubt]:
        """Stacks holding stacks whose blocks one run of adds crosses (the outer blocks stand
        along the same stream as the inner ones, so either count could be the depth), or some
        of whose blocks make adds of their own beside blocks holding stacks (a stage of one
        block, whose N would be the number of stages)."""
        doubts = []
        inner = {s.parent for s in m.stacks if s.parent is not None and not s.repeated}
        for outer in (s for s in m.stacks if s.path in inner):
            anchors = [a.writers[-1] if a.writers else a.module for a in m.residual_adds]
            index = [
                next((i for s, i in self._blocks_of(p) if s == outer.path), None) for p in anchors
            ]
            crossed = any(len({index[i] for i in run} - {None}) > 1 for run in self.runs)
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
            doubts.append(
                Doubt(
                    "nested-stacks",
                    outer.path,
                    reason,
                    ("reinit", "insert_branch_scale"),  # N, and CaiT's init of LayerScale
                    (outer.path, *_doubt_paths(held)),
                )
            )
        return doubts

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


def _feeding_scores(g: Graph) -> set[int]:
    """Nodes that reach an attention score (q·k) without passing a weight op: a norm there
    normalizes queries or keys. Of fused attention, the query and key count; a product of
    attention weights (a softmax's output) and values is no score."""
    todo: list[int] = []
    for n, op in enumerate(g.op):
        inputs = g.inputs[n]
        if op in SDPA_OPS:
            todo += inputs[:2]
        elif op in MATMUL_OPS and not g.weight[n] and len(inputs) >= 2 and not _weighs(g, inputs):
            todo += inputs
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not g.weight[n]:
            todo.extend(g.inputs[n])
    return seen


def _weighs(g: Graph, inputs: tuple[int, ...]) -> bool:
    """Whether a product of ``inputs`` applies attention weights (a softmax's output, through
    views and dropout) to values."""
    return any(g.op[g.alias[i]] in SOFTMAX_OPS for i in inputs)


def _before_scales(g: Graph, node: int) -> list[int]:
    """The roots (through views) of ``node`` and of what it was computed from through layer
    scales (elementwise multiplies by a parameter): a norm there still ends the branch."""
    chain = [g.alias[node]]
    while g.op[chain[-1]] in SCALE_OPS and g.uses_param[chain[-1]]:
        inputs = [i for i in g.inputs[chain[-1]] if g.floating[i]]
        if len(inputs) != 1:
            break
        chain.append(g.alias[inputs[0]])
    return chain


def _activated_from(g: Graph, node: int) -> list[int]:
    """The root (through views) of ``node`` and the roots it was computed from by weightless
    elementwise ops of one input (activations): a norm's output there feeds ``node``."""
    chain = [g.alias[node]]
    while True:
        n = chain[-1]
        inputs = [i for i in g.inputs[n] if g.floating[i]]
        if len(inputs) != 1 or g.weight[n] or g.uses_param[n] or g.shape[n] != g.shape[inputs[0]]:
            return chain
        chain.append(g.alias[inputs[0]])


def _plain_path(g: Graph, start: int, end: int) -> bool:
    """Whether node ``end`` derives from ``start`` on a path through no weight op."""
    todo, seen = [end], set()
    while todo:
        n = todo.pop()
        if n == start:
            return True
        if n < start or n in seen or g.weight[n]:
            continue
        seen.add(n)
        todo.extend(g.inputs[n])
    return False


def _affine_chain(g: Graph, start: int, end: int, params: frozenset[str] = frozenset()) -> bool:
    """Whether ``end`` is ``start`` through casts, then at most one product with a gain, then at
    most one sum with a bias, each one of ``params`` (or a tensor computed from it alone, as
    ``1 + gain``); never through a permute or reshape (the statistics would run over another
    axis), a division or a difference."""
    n = end
    seen: dict[str, tuple[str, ...]] = {}  # "mul" / "add" -> the parameters it reads
    while n != start:
        inputs = g.inputs[n]
        if len(inputs) != 1 or n < start:
            return False
        if g.op[n] not in _CAST_OPS:
            role = "mul" if g.op[n] in _MUL_OPS else "add" if g.op[n] in ADD_OPS else None
            read = g.param_src[n]
            if role is None or not g.uses_param[n] or not read or set(read) - params:
                return False
            if role in seen or (role == "add" and "mul" in seen):  # one gain, then one bias
                return False
            if g.shape[n] != g.shape[inputs[0]]:
                return False
            seen[role] = read
        n = inputs[0]
    return all(len(read) == 1 for read in seen.values())


def _member_paths(path: str) -> Iterator[tuple[str, str, str]]:
    """(container, member, rest) for each split of ``path`` at a dot, innermost first:
    ``a.experts.3.w2`` gives ``("a.experts", "3", ".w2")``, then ``("a", "experts", ".3.w2")``."""
    parts = path.split(".")
    for i in range(len(parts) - 2, 0, -1):
        yield ".".join(parts[:i]), parts[i], "".join(f".{p}" for p in parts[i + 1 :])


def _is_list(m: nn.Module | None) -> bool:
    return isinstance(m, nn.ModuleList | nn.ModuleDict)


def _doubt_paths(adds: list[ResidualAdd]) -> tuple[str, ...]:
    """The modules performing ``adds`` and the layers writing through them."""
    return tuple(dict.fromkeys(p for a in adds for p in (a.module, *a.writers)))


def _entry(path: str, modules: dict[str, nn.Module]) -> str | None:
    """The innermost module holding ``path`` (or ``path`` itself) that a list holds."""
    while path:
        parent = path.rpartition(".")[0]
        if isinstance(modules[parent], nn.ModuleList | nn.Sequential | nn.ModuleDict):
            return path
        path = parent
    return None


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def _canonical(g: Graph, node: int) -> tuple[str, ...]:
    """The names of the parameters ``node`` reads as the module applying them holds them (a
    block registered under two names goes by its first, as writers do)."""
    names = g.param_src[node]
    held = tuple(q for q in names if _parent(q) == g.owner[node])
    return held or names[:1]


def _parent(qualified: str) -> str:
    return qualified.rpartition(".")[0]


def _eps_placement(
    m: nn.Module, exact_torch: bool, behaviour: norm_rules.Behaviour | None
) -> EpsPlacement:
    if exact_torch:
        return "inside-sqrt"  # torch's norms all compute sqrt(var + eps)
    if behaviour is not None:
        return behaviour.eps_placement
    return "inside-sqrt" if norm_rules.torch_kind(m) is not None else "unknown"


def _shape(args: Any, kwargs: Any) -> tuple[int, ...]:
    found = norm_rules._first_float_input(args, kwargs)
    return tuple(found[1].shape) if found else ()
