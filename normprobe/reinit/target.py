"""What a scheme works on: the model, its (lazily discovered) map, its example inputs, and the
weights and norms it selects from them.

`Target` discovers the map on first use (or checks a given one still describes the model), picks
the weight layers and parameters a scheme overwrites, counts a stack's depth, and runs one
read-only forward where a scheme must watch the model (`Target.call_order`). `set_norm` and
`zero_params` set what they select and record it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from ..common import example_call
from ..discovery import (
    DEPTH_DOUBTS,
    Action,
    DiscoveryWarning,
    ModelMap,
    NormLayer,
    ResidualAdd,
    discover,
    discover_on_carried,
    is_bias_name,
    read_only,
    refusal,
)
from ..layers.branch_scale import Wrapper
from .report import Recorder, constant
from .weights import Applied, direct_params, is_layer


@contextmanager
def observing(model: nn.Module) -> Iterator[None]:
    """Discovery's read-only context in eval mode, with the hooks reinit registers running."""
    with read_only(model, silence_hooks=False):
        model.eval()
        yield


@contextmanager
def removing() -> Iterator[list[RemovableHandle]]:
    """A list to put hook handles in; each is removed on exit, also when the forward raises."""
    handles: list[RemovableHandle] = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


class Target:
    """A model with its (lazily discovered) map and example inputs."""

    def __init__(
        self,
        model: nn.Module,
        what: str,
        example_inputs: Sequence[Any] | Any,
        example_kwargs: Mapping[str, Any] | None,
        model_map: ModelMap | None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{what} needs a torch.nn.Module, got {type(model).__qualname__}")
        self.model = model
        self.what = what
        # without inputs given, those the model carries (transformers' dummy_inputs)
        own = model_map is None
        self.args, self.kwargs = example_call(model, example_inputs, example_kwargs, own=False)
        self._carried = own and not (self.args or self.kwargs)
        if self._carried:
            self.args, self.kwargs = example_call(model)
        self._map = model_map
        self.applied = Applied()  # reinit commits it after the scheme ran
        self.rec = Recorder()  # what the scheme set, for reinit_with_report
        self.kept_vectors: list[torch.Tensor] = []  # weight-layer vectors no scheme can draw
        if model_map is not None:
            self._check_map(model_map)

    @property
    def has_inputs(self) -> bool:
        if self._carried:
            self.map  # noqa: B018 (inputs the model does not run on are dropped there)
        return bool(self.args or self.kwargs)

    @property
    def map(self) -> ModelMap:
        if self._map is None:
            with warnings.catch_warnings():
                # a norm-free model (Fixup's use case) is expected here, not worth a warning
                warnings.simplefilter("ignore", DiscoveryWarning)
                if self._carried:
                    self._map = discover_on_carried(self.model, self.args, self.kwargs)
                    if not self._map.traced:  # the model does not run on them
                        self.args, self.kwargs = (), {}
                else:
                    self._map = discover(self.model, *self.args, **self.kwargs)
        return self._map

    def _check_map(self, m: ModelMap) -> None:
        modules = dict(self.model.named_modules())
        stale = [
            p
            for a in m.residual_adds
            for p in a.branch_layers
            if p not in modules
            or isinstance(modules[p], Wrapper)
            or not (is_layer(modules[p]) or p in m.weight_layers)
        ]
        stale += [
            n.path for n in m.norms if n.path not in modules or isinstance(modules[n.path], Wrapper)
        ]
        if stale:
            raise ValueError(
                f"model_map does not describe this model: {stale[0]!r} is no longer the layer it "
                f"mapped ({len(stale)} such paths). Modules were replaced after discovery; "
                "rediscover with normprobe.discover(model, ...) or pass example_inputs instead"
            )

    def adds(self) -> list[ResidualAdd]:
        m = self.map
        if not m.traced:
            raise ValueError(
                f"{self.what} needs the model's residual branches, which discovery finds by "
                "running one forward pass: pass example_inputs=(...) (and example_kwargs={...}) "
                "or model_map=normprobe.discover(model, *inputs)"
            )
        if not m.residual_adds:
            raise ValueError(
                f"{self.what} needs residual branches, but discovery found no residual adds "
                f"(x + f(x)) in one forward of {type(self.model).__name__} ({len(m.stacks)} "
                f"stacks, {len(m.norms)} norms, head {m.head!r}); schemes 'kaiming' and 'xavier' "
                "work without them"
            )
        return m.residual_adds

    def refuse_doubts(self, action: Action, depth: bool, way_out: str) -> None:
        """Refuse, before any change, while a doubt about ``action`` stands; a doubt about the
        depth N (`DEPTH_DOUBTS`) stands only when ``depth``: the action counts N itself."""
        standing = [d for d in self.map.doubts_for(action) if depth or d.kind not in DEPTH_DOUBTS]
        if standing:
            raise ValueError(refusal(self.what, standing, way_out))

    def module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def weight_layers(self, embeddings: bool = True) -> list[tuple[str, nn.Module]]:
        """Leaf layers holding a matrix or kernel, and every module the traced forward applied
        a weight of (fused experts, whose module also holds an activation); never a part of a
        parametrization (weight norm's ``parametrizations.weight``)."""
        norms = {n.path for n in self.map.norms}
        used = set(self.map.weight_layers)
        parts = {
            id(part)
            for m in self.model.modules()
            if isinstance(m, parametrize.ParametrizationList)
            for part in m.modules()
        }
        return [
            (path, m)
            for path, m in self.model.named_modules()
            if path not in norms
            and id(m) not in parts
            and (is_layer(m) or path in used)
            and (embeddings or not isinstance(m, nn.Embedding | nn.EmbeddingBag))
        ]

    def layer_params(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(layer, name, parameter) of every non-embedding weight layer, each parameter once; a
        parameter tied to an embedding (a GPT-2 ``lm_head``) counts as the embedding's."""
        embedded = {
            id(p)
            for _, m in self.weight_layers()
            if isinstance(m, nn.Embedding | nn.EmbeddingBag)
            for _, p in self.applied.of(m)
        }
        seen: set[int] = set()
        found = []
        for _, m in self.weight_layers(embeddings=False):
            for name, p in self.applied.of(m):
                if id(p) not in embedded and id(p) not in seen:
                    seen.add(id(p))
                    found.append((m, name, p))
        return found

    def set_vector(self, name: str, p: torch.Tensor, scheme: str) -> None:
        """Set a weight layer's parameter ``name`` that a scheme does not draw: a bias (by its
        name) to 0; a vector that is no bias (e3nn's flat weights, which the layer reshapes
        into its matrices; RecurrentGemma's learned decay) is kept, its fan-in unknown: zeroed
        as a bias it would erase the layer."""
        if is_bias_name(name):
            nn.init.zeros_(p)
            self.rec.record(p, constant(0.0, "bias"))
        else:
            self.rec.leave(p, f"a vector of a weight layer that is no bias: {scheme} keeps it")
            self.kept_vectors.append(p)

    @staticmethod
    def drawn(name: str, p: torch.Tensor) -> bool:
        """Whether a scheme draws a weight layer's parameter ``name``: a matrix or kernel."""
        return p.ndim >= 2 and not is_bias_name(name)

    def depth(self, add: ResidualAdd) -> int:
        """Blocks in the add's stack; outside one, in the deepest stack holding residual adds,
        or the number of adds where none does (a stack without adds, a U-Net's decoder of
        plain convs, says nothing of the depth of a residual stream)."""
        m = self.map
        if add.stack is not None:
            return m.stack(add.stack).depth
        holding = {a.stack for a in m.residual_adds}
        residual = [s.depth for s in m.stacks if s.path in holding]
        return max(residual, default=len(m.residual_adds))

    def reset_norms(self) -> None:
        """Norm gains to 1 (Gemma's ``1 + weight``: weight 0) and norm biases to 0; a norm of
        unknown kind (a global response norm, whose gain starts at 0, or no norm at all) is left
        as it is."""
        for n in self.map.norms:
            if n.kind != "unknown":
                set_norm(self, n, gain=1.0)

    def require_inputs(self, why: str) -> None:
        if not self.has_inputs:
            raise ValueError(
                f"{self.what} runs the model once to {why}: pass example_inputs=(...) "
                "(and example_kwargs={...})"
            )

    def observe(self) -> None:
        """One forward on the example inputs, read-only and in eval mode."""
        with observing(self.model):
            self.model(*self.args, **self.kwargs)

    def call_order(self, paths: set[str]) -> list[str]:
        """The order in which the modules at ``paths`` run in one forward (one entry a call)."""
        self.require_inputs("see which module ends each residual branch")
        order: list[str] = []
        with removing() as handles:
            for path in paths:
                handles.append(
                    self.module(path).register_forward_hook(
                        lambda _m, _args, _out, path=path: order.append(path)
                    )
                )
            self.observe()
        return order


def gain_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters that are no bias: a norm's gain."""
    return [name for name, _ in direct_params(module) if not is_bias_name(name)]


def set_norm(t: Target, norm: NormLayer, gain: float) -> None:
    """``norm``'s gain to ``gain`` (through its offset: Gemma's ``1 + weight``), its bias to 0."""
    offset = norm.gain_offset
    if offset is None and gain_names(t.module(norm.path)):
        raise ValueError(
            f"{norm.path} ({norm.class_name}) scales by its weight or by 1 + weight, and "
            "discovery could not run it to tell which, so its gain cannot be set to "
            f"{gain:g}; pass example_inputs"
        )
    offset = offset or 0.0
    as_gain = f"norm gain {gain:g}" + (f" as {offset:g} + weight" if offset else "")
    with torch.no_grad():
        for name, p in direct_params(t.module(norm.path)):
            if is_bias_name(name):
                p.zero_()
                t.rec.record(p, constant(0.0, "norm bias"))
            else:
                p.fill_(gain - offset)
                t.rec.record(p, constant(gain - offset, as_gain))


def zero_params(t: Target, module: nn.Module, why: str) -> None:
    """Every tensor ``module`` applies to 0, recorded with ``why``."""
    with torch.no_grad():
        for _, p in t.applied.of(module):
            p.zero_()
            t.rec.record(p, constant(0.0, why))
