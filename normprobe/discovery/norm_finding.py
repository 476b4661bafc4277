"""Which modules are norms: by torch class, by class name or by behaviour on the traced input,
and one norm where a wrapper only applies its own gain and bias to a parameter-free one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import norms as norm_rules
from .graph import Graph
from .model_map import EpsPlacement, NormKind, NormLayer
from .ops import ADD_OPS
from .scene import Scene, within

_MUL_OPS = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__"})
# Ops that keep a tensor's values and layout (but maybe not its dtype).
_CAST_OPS = frozenset({"to", "float", "type", "type_as", "contiguous", "clone", "detach"})
_GEMMA_GAIN = re.compile(r"^(Gemma\d*|RecurrentGemma|PaliGemma)RMSNorm$")
# (class, eps, input shape, settings) -> what the behaviour probe found
ProbeCache = dict[tuple[type, float | None, tuple[int, ...], Any], norm_rules.Behaviour | None]


def find_norms(scene: Scene) -> dict[str, NormLayer]:
    """The norm layers by path, in ``named_modules()`` order, each with role ``other`` and no
    block yet (`normprobe.discovery.roles` and the builder fill them in)."""
    cache: ProbeCache = {}
    found: dict[str, NormLayer] = {}
    for path, m in scene.model.named_modules():
        norm = _norm(scene, path, m, cache)
        if norm is not None:
            found[path] = norm
    if scene.g is not None:
        found = _fold_wrappers(scene, found)
    return found


def _norm(scene: Scene, path: str, m: nn.Module, cache: ProbeCache) -> NormLayer | None:
    """The entry of the module at ``path`` if it is a norm, else None."""
    kind = norm_rules.torch_kind(m)
    named = norm_rules.name_match(m) if not norm_rules.has_param_children(m) else None
    eps, eps_attr = norm_rules.eps_of(m)
    exact_torch = type(m).__module__.startswith("torch.")
    behaviour, probed = None, False
    call = scene.first_call.get(path)
    g = scene.g
    if g is not None and call is not None and g.calls[call].inputs is not None:
        args, kwargs = g.calls[call].inputs  # type: ignore[misc]
        # by behaviour alone, only a module of one input: one scale invariant in its first of
        # several (linear attention's q, divided by q . sum(k)) is no normalizer
        alone = kind is None and named is None
        probing = not exact_torch or (kind is None and named is not None)
        if probing and not (alone and _float_inputs(args, kwargs) > 1):
            key = (type(m), eps, _shape(args, kwargs), _settings(m))
            if key not in cache:
                cache[key] = norm_rules.probe(m, args, kwargs, eps)
                if cache[key] is None and named is not None:  # rows near eps on this input
                    cache[key] = norm_rules.probe(m, args, kwargs, eps, fresh=True)
            behaviour, probed = cache[key], True
            if behaviour is not None and not norm_rules.invariant_as_is(m, args, kwargs, eps):
                behaviour = None  # a normalizer only with the probe's parameters
            named_only = behaviour is None and kind is None and named is not None
            if named_only and norm_rules.no_normalization(m, args, kwargs):
                return None  # named like a norm, but an identity or of another size out
    elif not exact_torch and (kind is not None or named is not None):
        # not traced (no example input): a norm class of its own is run alone on a made-up
        # input, for what its name cannot say (Gemma's 1 + weight behind a plain RMSNorm name)
        key = (type(m), eps, (-1, *_gain_shape(m)), _settings(m))  # -1: no traced shape
        if key not in cache:
            cache[key] = norm_rules.probe_alone(m, eps)
        behaviour = cache[key]
    tanh = norm_rules.tanh_replacement(m)
    if kind is None and named is None and behaviour is None and tanh is None:
        return None
    if g is not None and call is None and _unknown_by_name(kind, named, behaviour, tanh):
        scene.notes.append(
            f"{path or '<root>'} ({type(m).__name__}) is named like a norm, but the forward "
            "never called it and nothing tells what it computes: not listed (it is in no stream)"
        )
        return None
    kind, how = _recognized(scene, path, m, (kind, named, tanh), behaviour, probed)
    return NormLayer(
        path=path,
        kind=kind,
        role="other",
        class_name=type(m).__name__,
        dims=_dims(m, behaviour),
        layout=behaviour.layout if behaviour else norm_rules.torch_layout(m),
        affine=tuple(n for n, _ in m.named_parameters(recurse=False)),
        eps=eps,
        eps_attr=eps_attr,
        eps_placement=_eps_placement(m, exact_torch, behaviour),
        gain_offset=_gain_offset(m, behaviour),
        recognized_by=how,
    )


def _recognized(
    scene: Scene,
    path: str,
    m: nn.Module,
    by: tuple[NormKind | None, str | None, str | None],
    behaviour: norm_rules.Behaviour | None,
    probed: bool,
) -> tuple[NormKind, str]:
    """The norm's kind and how it was recognized, from ``by``: its torch kind, the norm class
    name it matched and the tanh replacement it is (each None when not)."""
    kind, named, tanh = by
    cls = type(m).__name__
    if tanh is not None:
        return "dyt", f"class name {tanh}"
    if kind is not None:
        if type(m).__module__.startswith("torch."):
            return kind, f"torch class nn.{cls}"
        base = next(c.__name__ for c in type(m).__mro__ if c.__module__.startswith("torch.nn"))
        return kind, f"subclass of nn.{base}"
    if named is not None:
        how = f"class name {named}"
        if behaviour is not None:
            return behaviour.kind, how + "; kind by behaviour"
        if probed:
            scene.notes.append(
                f"{path or '<root>'} ({cls}) is named like a norm but its output did "
                "not behave like one on the example input (or it could not be run on "
                "variations of it); listed as a norm anyway"
            )
            how += "; behaviour probe disagreed"
        return norm_rules.kind_from_name(named), how
    assert behaviour is not None
    return behaviour.kind, f"behaviour ({behaviour.layout} statistics)"


def _fold_wrappers(scene: Scene, found: dict[str, NormLayer]) -> dict[str, NormLayer]:
    """One normalization is one norm: a parameter-free norm whose output its enclosing
    modules only multiply by and add their own parameters to (``self.ln(x) * self.gamma``)
    is listed once, as the outermost of them, with their gain and bias."""
    modules = dict(scene.model.named_modules())
    paths: dict[int, list[str]] = {}  # by id of a module: every name it goes by
    for name, m in scene.model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    folded: dict[str, str] = {}  # wrapper -> the norm it wraps
    for path in found:
        if any(True for _ in modules[path].parameters()):
            continue
        outer = path
        while outer and _wraps(scene, parent := outer.rpartition(".")[0], path, modules, paths):
            outer = parent
        if outer != path:
            folded[outer] = path
    for outer, inner in folded.items():
        found[outer] = _wrapper_entry(scene, outer, inner, found[inner], modules[outer])
    drop = set(folded.values()) | {p for p in found if any(within(p, o) for o in folded)}
    drop -= set(folded)
    kept = {p: found[p] for p in modules if p in found and p not in drop}
    # a module that behaves like a norm (or is named like one) around a norm it does more
    # than apply a gain and bias to (a gain shared with another module, a bias before the
    # gain): the norm inside is the normalization, listed once
    holders = {a for p in kept for a in _ancestors(p) if a in kept and a not in folded}
    return {p: n for p, n in kept.items() if p not in holders}


def _ancestors(path: str) -> list[str]:
    """The paths of the modules that hold the module at ``path`` ("" is the root)."""
    if not path:
        return []
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _wraps(
    scene: Scene,
    outer: str,
    norm: str,
    modules: dict[str, nn.Module],
    paths: dict[int, list[str]],
) -> bool:
    """Whether all ``outer`` computes is the norm at ``norm`` on its input, times a gain
    and plus a bias of its own: every parameter below it is its own, the norm reads its
    input (through casts) and its output comes from the norm's (`_affine_chain`)."""
    g = scene.graph
    m = modules[outer]
    own = {id(p) for p in m.parameters(recurse=False)}
    if any(id(p) not in own for p in m.parameters()):
        return False
    if any(True for p, _ in m.named_buffers() if not within(f"{outer}.{p}", norm)):
        return False  # a buffer could scale the output too (only parameters are seen)
    cid = scene.first_call.get(outer)
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
    # its own parameters by every name the module goes by (registered twice: read by both)
    own_named = list(m.named_parameters(recurse=False))
    names = {f"{q}.{n}" if q else n: id(p) for q in paths[id(m)] for n, p in own_named}
    return _affine_chain(g, inner[0].out_nodes[0], call.out_nodes[0], names)


def _wrapper_entry(
    scene: Scene, outer: str, inner: str, norm: NormLayer, module: nn.Module
) -> NormLayer:
    """The norm's entry as the wrapper at ``outer`` presents it."""
    affine = tuple(n for n, _ in module.named_parameters(recurse=False))
    eps, eps_attr = norm_rules.eps_of(module)
    rel = inner[len(outer) + 1 :] if outer else inner
    if eps is None and norm.eps_attr is not None:
        eps, eps_attr = norm.eps, f"{rel}.{norm.eps_attr}"
    gain_offset = None
    captured = scene.graph.calls[scene.first_call[outer]].inputs
    if affine and captured is not None:
        gain_offset = norm_rules.gain_offset(module, *captured)
    return replace(
        norm,
        path=outer,
        class_name=type(module).__name__,
        affine=affine,
        eps=eps,
        eps_attr=eps_attr,
        gain_offset=gain_offset,
        recognized_by=f"{norm.recognized_by} at .{rel}, with its wrapper's "
        + ("+".join(affine) if affine else "no parameters"),
        wraps=inner,
    )


def _affine_chain(g: Graph, start: int, end: int, params: Mapping[str, int] | None = None) -> bool:
    """Whether ``end`` is ``start`` through casts, then at most one product with a gain, then at
    most one sum with a bias, each one of ``params`` (qualified name -> id of the parameter;
    or a tensor computed from it alone, as ``1 + gain``); never through a permute or reshape
    (the statistics would run over another axis), a division or a difference."""
    params = params or {}
    n = end
    seen: dict[str, set[int]] = {}  # "mul" / "add" -> the parameters it reads
    while n != start:
        inputs = g.inputs[n]
        if len(inputs) != 1 or n < start:
            return False
        if g.op[n] not in _CAST_OPS:
            role = "mul" if g.op[n] in _MUL_OPS else "add" if g.op[n] in ADD_OPS else None
            read = g.param_src[n]
            if role is None or not g.uses_param[n] or not read or set(read) - params.keys():
                return False
            if role in seen or (role == "add" and "mul" in seen):  # one gain, then one bias
                return False
            if g.shape[n] != g.shape[inputs[0]]:
                return False
            seen[role] = {params[q] for q in read}
        n = inputs[0]
    return all(len(read) == 1 for read in seen.values())


def _dims(m: nn.Module, behaviour: norm_rules.Behaviour | None) -> tuple[int, ...]:
    dims = norm_rules.torch_dims(m)
    if dims:
        return dims
    if behaviour is not None and behaviour.dims:
        return behaviour.dims
    weight = getattr(m, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()


def _gain_offset(m: nn.Module, behaviour: norm_rules.Behaviour | None) -> float | None:
    """The measured offset; else 0.0 for torch's own forward and 1.0 for Gemma's classes by
    name; None (unknown) for any other class, or one without parameters."""
    if behaviour is not None:
        return behaviour.gain_offset
    if not any(True for _ in m.parameters(recurse=False)):
        return None
    named = [c.__name__ for c in type(m).__mro__]
    if any(_GEMMA_GAIN.match(n) for n in named):
        return 1.0
    torch_forward = type(m).__module__.startswith("torch.") or norm_rules.runs_torch_forward(m)
    return 0.0 if torch_forward else None


def _gain_shape(m: nn.Module) -> tuple[int, ...]:
    weight = norm_rules.own_gain(m)
    return tuple(weight.shape) if weight is not None else ()


def _eps_placement(
    m: nn.Module, exact_torch: bool, behaviour: norm_rules.Behaviour | None
) -> EpsPlacement:
    if exact_torch:
        return "inside-sqrt"  # torch's norms all compute sqrt(var + eps)
    if behaviour is not None:
        return behaviour.eps_placement
    return "inside-sqrt" if norm_rules.torch_kind(m) is not None else "unknown"


def _unknown_by_name(
    kind: NormKind | None,
    named: str | None,
    behaviour: norm_rules.Behaviour | None,
    tanh: str | None,
) -> bool:
    """Whether only a name of unknown kind says the module is a norm."""
    if kind is not None or behaviour is not None or tanh is not None or named is None:
        return False
    return norm_rules.kind_from_name(named) == "unknown"


def _settings(m: nn.Module) -> tuple[Any, ...]:
    """What may make two modules of one class behave differently on one input: the class, the
    plain attributes (GDN's ``inverse``) and the parameter and buffer shapes of each module
    below it (a wrapper around an ``nn.Identity`` or a LayerNorm), ``training`` aside."""
    out: list[Any] = []
    for path, sub in m.named_modules():
        plain = tuple((k, v) for k, v in sorted(vars(sub).items()) if k != "training" and _plain(v))
        tensors = tuple((n, tuple(t.shape)) for n, t in sub.named_parameters(recurse=False))
        buffers = tuple((n, tuple(t.shape)) for n, t in sub.named_buffers(recurse=False))
        out.append((path, type(sub), plain, tensors, buffers))
    return tuple(out)


def _plain(value: Any) -> bool:
    """A number, string, None or tuple of them: a setting."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _float_inputs(args: Any, kwargs: Any) -> int:
    """How many floating-point tensors of 4+ entries a call takes."""
    return sum(1 for _ in norm_rules.float_inputs(args, kwargs))


def _shape(args: Any, kwargs: Any) -> tuple[int, ...]:
    found = norm_rules.first_float_input(args, kwargs)
    return tuple(found[1].shape) if found else ()
