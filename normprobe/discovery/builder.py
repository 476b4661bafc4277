"""Turns a traced forward (or the module tree alone) into a `ModelMap`, asking the questions of
discovery in order: which modules are norms, where the residual adds are, which containers are
stacks of blocks, what role each norm plays, where attention and the output head are."""

from __future__ import annotations

import warnings
from dataclasses import replace

from torch import nn

from .add_mapping import add_where, fused_skips, map_add, unattached_writers
from .attention import find_attention
from .doubts import doubts, merged
from .graph import Graph
from .model_map import Attention, ModelMap, NormLayer, ResidualAdd
from .norm_finding import find_norms
from .residual import find_residual_adds
from .roles import AddNorms, norm_roles
from .scene import Scene, within
from .stack_finding import find_stacks, map_stack, nested_doubts
from .stacks import stream_runs


class DiscoveryWarning(UserWarning):
    """A model lacks something normprobe looks for (norms, residual adds)."""


def build_map(model: nn.Module, g: Graph | None, trace_ms: float) -> ModelMap:
    """The map of ``model`` from its traced forward ``g`` (None: the module tree alone)."""
    scene = Scene(model, g, first_call=g.first_calls() if g is not None else {})
    found_norms = find_norms(scene)
    if g is not None:
        norm_calls = frozenset(cid for cid, c in enumerate(g.calls) if c.path in found_norms)
        scene.adds = find_residual_adds(g, norm_calls)
        scene.weight_layers = {o for n, o in enumerate(g.owner) if g.weight[n] and o is not None}
        scene.runs = stream_runs(g, scene.adds)
    scene.index_blocks(find_stacks(scene))
    scene.add_where = [add_where(scene, a) for a in scene.adds]
    roles, add_norms = norm_roles(scene, found_norms)
    norms = [
        replace(n, role=roles.get(path, "other"), stack=stack, block=block)
        for path, n in found_norms.items()
        for stack, block in [scene.where(path)]
    ]
    residual_adds = _residual_adds(scene, add_norms, norms)
    model_map = ModelMap(
        model_type=type(model).__name__,
        norms=norms,
        stacks=[map_stack(scene, s, norms, residual_adds) for s in scene.stacks],
        residual_adds=residual_adds,
        attention=_attention(scene),
        head=_head(scene),
        traced=g is not None,
        trace_ms=trace_ms if g is not None else 0.0,
        notes=scene.notes,
        weight_layers=tuple(p for p, _ in model.named_modules() if p in scene.weight_layers),
    )
    if g is not None:
        model_map.doubts += unattached_writers(scene, residual_adds)
        model_map.doubts += fused_skips(scene)
        model_map.doubts += nested_doubts(scene, model_map)
    model_map.doubts = merged(model_map.doubts, doubts(model_map, model))
    _warn(model, model_map)
    return model_map


def _residual_adds(scene: Scene, add_norms: AddNorms, norms: list[NormLayer]) -> list[ResidualAdd]:
    """The map's residual adds, each numbered among the adds of its module's call."""
    ordinals: dict[int, int] = {}
    found = []
    for i, a in enumerate(scene.adds):
        ordinals[a.call] = ordinals.get(a.call, -1) + 1
        found.append(map_add(scene, i, ordinals[a.call], add_norms.get(i, {}), norms))
    return found


def _attention(scene: Scene) -> list[Attention]:
    found = find_attention(scene.g) if scene.g is not None else {}
    return [
        Attention(path, impl, heads=heads, stack=stack, block=block)
        for path, (impl, heads) in found.items()
        for stack, block in [scene.where(path)]
    ]


_JOINS = frozenset({"cat", "concat", "concatenate", "stack"})


def _head(scene: Scene) -> str | None:
    """The weight layer the model's (logits) output comes from through single-input ops."""
    g = scene.g
    if g is None or not g.root_outputs:
        return None
    _, node = next(((k, n) for k, n in g.root_outputs if "logits" in k), g.root_outputs[0])
    for _ in range(16):
        owner = g.owner[node]
        if g.uses_param[node]:
            # read at the module's output only when its own forward applied the weight: a tied
            # embedding applied by the parent (`x @ emb.weight.T`) returns the lookup instead
            cid = g.call[node]
            inside = cid is not None and owner is not None and within(g.calls[cid].path, owner)
            return owner if owner in scene.weight_layers and inside else None
        inputs = set(g.inputs[node])
        owners = {g.owner[i] for i in inputs if g.uses_param[i]}
        if g.op[node] in _JOINS and len(owners) == 1 and all(g.uses_param[i] for i in inputs):
            inputs = {min(inputs)}  # one layer applied to chunks (litgpt's lm_head_chunk_size)
        parents = {p for i in inputs for p in g.inputs[i]}
        if len(inputs) > 1 and len(parents) == 1 and all(len(g.inputs[i]) == 1 for i in inputs):
            inputs = parents  # pieces of one tensor put back together (a gather's chunks)
        if len(inputs) != 1:
            return None
        node = inputs.pop()
    return None


def _warn(model: nn.Module, m: ModelMap) -> None:
    name = type(model).__name__
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
