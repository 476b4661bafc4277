"""Re-initialization schemes and residual-branch scalers, placed through discovery.

`reinit` rewrites the existing parameters in place with ``torch.nn.init`` (the same Parameter
objects, so an optimizer built earlier stays valid). `insert_branch_scale` wraps the last module
of every residual branch in a `BranchScale`. Which layers write into the residual stream, how many
blocks a stack has and how many layers a branch has all come from `normprobe.discover`; no layer
is found by its attribute name.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, cast, get_args

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils.hooks import RemovableHandle

from .common import example_call
from .discovery import (
    DiscoveryWarning,
    ModelMap,
    NormLayer,
    ResidualAdd,
    discover,
    discover_on_carried,
)
from .discovery.doubts import DEPTH_DOUBTS, refusal
from .discovery.mapping import read_only
from .discovery.model_map import Action
from .discovery.state import preserved
from .discovery.trace import first_float, iter_tensors, replace_at
from .reinit_report import (
    Recorder,
    ReinitReport,
    constant,
    kaiming,
    normal,
    scaled,
    xavier,
)

Scheme = Literal["gpt2", "fixup", "deepnorm", "kaiming", "xavier", "zero_branch"]
BranchScaleKind = Literal["rezero", "layerscale", "skipinit"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
BRANCH_SCALES: tuple[str, ...] = get_args(BranchScaleKind)

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *_TRANSPOSED_CONVS)


# --------------------------------------------------------------------------------------------
# Weight layouts
# --------------------------------------------------------------------------------------------


def _warn(message: str) -> None:
    """A UserWarning at the caller's line: the first frame outside this module."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, level)


def is_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight as ``(in, out, ...)`` rather than ``(out, in, ...)``.

    True for Hugging Face's ``Conv1D`` (GPT-2), transposed convolutions and embeddings (a table
    of ``num_embeddings`` rows: one input per row, ``embedding_dim`` outputs).
    """
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag, *_TRANSPOSED_CONVS)):
        return True
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def out_in_view(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A view of ``weight`` laid out ``(out, in, *kernel)``, as ``torch.nn.init`` assumes."""
    if weight.ndim >= 2 and is_transposed(module):
        return weight.transpose(0, 1)
    return weight


def _out_dim(module: nn.Module) -> int:
    return 1 if is_transposed(module) else 0


def _direct(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters(recurse=False))


def is_weight_layer(module: nn.Module) -> bool:
    """A leaf module holding a matrix or kernel (Linear, Conv, Conv1D, Embedding), or MHA."""
    if not any(p.ndim >= 2 for _, p in _direct(module)):
        return False
    return isinstance(module, nn.MultiheadAttention) or not any(True for _ in module.children())


# --------------------------------------------------------------------------------------------
# Parametrized weights (weight norm)
# --------------------------------------------------------------------------------------------


def _weight_norm_hooks(module: nn.Module) -> dict[str, WeightNorm]:
    """Old-style ``torch.nn.utils.weight_norm`` on ``module``: tensor name -> its hook."""
    hooks = module._forward_pre_hooks.values()
    return {h.name: h for h in hooks if isinstance(h, WeightNorm)}


def _chains(module: nn.Module) -> dict[str, parametrize.ParametrizationList]:
    """``torch.nn.utils.parametrize``'s parametrizations of ``module``, by tensor name."""
    if not parametrize.is_parametrized(module):
        return {}
    return dict(cast(nn.ModuleDict, module.parametrizations).items())  # type: ignore[arg-type]


def _parametrized(module: nn.Module) -> list[str]:
    """Names of ``module``'s tensors computed from parameters: by ``torch.nn.utils.parametrize``
    (`_chains`) or by the old ``weight_norm`` hook (from ``weight_g`` and ``weight_v``)."""
    return [*_chains(module), *_weight_norm_hooks(module)]


def _is_layer(module: nn.Module) -> bool:
    """`is_weight_layer`, also for a layer whose matrix or kernel is parametrized (new-style
    weight norm): a leaf but for its ``parametrizations``."""
    if not parametrize.is_parametrized(module):
        return is_weight_layer(module)
    leaf = all(name == "parametrizations" for name, _ in module.named_children())
    held = [*module.parameters()]  # its own and its parametrizations' originals
    return any(p.ndim >= 2 for p in held) and (leaf or isinstance(module, nn.MultiheadAttention))


def _set_weight_norm(g: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, dim: int) -> None:
    """``g`` and ``v`` with ``g * v / ||v|| = weight``: ``v = weight``, ``g`` its norms over all
    dims but ``dim``; a zero slice keeps its direction in ``v`` (its ``g`` is 0)."""
    norm = torch.norm_except_dim(weight, 2, dim)
    v.copy_(torch.where(norm > 0, weight, v))
    g.copy_(norm)


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Make ``module``'s parametrized tensor ``name`` equal ``value``: weight norm's g and v
    in place; any other parametrization through its ``right_inverse``. False (with a warning)
    where the parametrization cannot take it."""
    hooks = _weight_norm_hooks(module)
    if name in hooks:
        with torch.no_grad():
            g, v = getattr(module, f"{name}_g"), getattr(module, f"{name}_v")
            _set_weight_norm(g, v, value, hooks[name].dim)
        setattr(module, name, hooks[name].compute_weight(module))  # as the hook's next call does
        return True
    chain = _chains(module)[name]
    with torch.no_grad():
        if len(chain) == 1 and isinstance(chain[0], _WeightNorm):
            g, v = chain.original0, chain.original1
            _set_weight_norm(cast(torch.Tensor, g), cast(torch.Tensor, v), value, chain[0].dim)
            return True
        try:
            setattr(module, name, value.clone())
        except (RuntimeError, NotImplementedError) as err:
            _warn(
                f"{type(module).__name__}.{name} keeps its value: its parametrization cannot "
                f"be set to a given tensor ({err})"
            )
            return False
    return True


class _Applied:
    """The tensors weight layers apply, to overwrite in place.

    A parametrized tensor (weight norm's ``weight``) is a copy of its value; `commit` writes each
    copy that changed back through its parametrization, so that the layer applies exactly it.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[int, str], tuple[nn.Module, torch.Tensor, int]] = {}

    def of(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """``module``'s parametrized tensors, then its own parameters but weight norm's g, v."""
        hooks = _weight_norm_hooks(module)
        found = []
        for name in _parametrized(module):
            key = (id(module), name)
            if key not in self._copies:
                # reading leaves buffers as they were (spectral norm updates its own)
                with preserved(module), torch.no_grad():
                    hook = hooks.get(name)
                    value = (hook.compute_weight(module) if hook else getattr(module, name)).clone()
                self._copies[key] = (module, value, value._version)
            found.append((name, self._copies[key][1]))
        sources = {f"{name}_{part}" for name in hooks for part in "gv"}
        return found + [(n, p) for n, p in _direct(module) if n not in sources]

    def commit(self) -> list[torch.Tensor]:
        """Write the changed copies back; the copies that could not be written."""
        return [
            value
            for (_, name), (module, value, version) in self._copies.items()
            if value._version != version and not _assign(module, name, value)
        ]

    def parametrized(self, model: nn.Module) -> dict[int, tuple[str, tuple[nn.Parameter, ...]]]:
        """id of each copy -> (its path in ``model``, the parameters it is computed from)."""
        paths = {id(m): p for p, m in model.named_modules()}
        found = {}
        for (_, name), (module, value, _) in self._copies.items():
            hooks, chains = _weight_norm_hooks(module), _chains(module)
            if name in hooks:
                sources = tuple(getattr(module, f"{name}_{part}") for part in "gv")
            else:
                sources = tuple(chains[name].parameters())
            path = paths[id(module)]
            found[id(value)] = (f"{path}.{name}" if path else name, sources)
        return found


# --------------------------------------------------------------------------------------------
# Branch scalers (modules inserted by surgery)
# --------------------------------------------------------------------------------------------


class _Wrapper(nn.Module):
    """Calls ``inner`` and reads unknown attributes (``weight``, ``in_features``) from it.

    A subclass registers its own parameters and buffers before it sets ``inner``: torch
    refuses a name the module already answers to, and an inner layer may have an attribute of
    that name (timm's ``ScaledStdConv2d`` has a float ``scale``).
    """

    inner: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None:
                raise
            return getattr(inner, name)


class BranchScale(_Wrapper):
    """``inner(x) * scale``: a scalar or per-channel factor on the end of a residual branch.

    Inserted by `insert_branch_scale` (learnable ``scale`` parameter) and by
    ``reinit(model, "deepnorm")`` (a fixed ``1/alpha`` buffer). ``channel_dim`` is the dim a
    per-channel ``scale`` runs along (-1 for ``(..., C)`` outputs, 1 for ``(N, C, ...)``).
    """

    scale: torch.Tensor

    def __init__(
        self,
        inner: nn.Module,
        kind: str,
        value: torch.Tensor,
        channel_dim: int = -1,
        learnable: bool = True,
        gain_offset: float | None = None,
    ) -> None:
        super().__init__()
        if learnable:
            self.scale = nn.Parameter(value)
        else:
            self.register_buffer("scale", value)
        self.inner = inner
        self.kind = kind
        self.channel_dim = channel_dim
        self.gain_offset = gain_offset  # set when ``inner`` is a norm: how to fold into its gain

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        scale = self.scale
        if scale.ndim == 1 and self.channel_dim != -1:
            scale = scale.view(-1, *([1] * (out.ndim - 1 - self.channel_dim)))
        return out * scale

    def extra_repr(self) -> str:
        shape = "scalar" if self.scale.ndim == 0 else f"per-channel {self.scale.numel()}"
        return f"kind={self.kind}, {shape}, channel_dim={self.channel_dim}"


class FixupScalars(_Wrapper):
    """``inner(x + bias_in) * scale + bias_out``: Fixup's scalar biases and multiplier.

    Every part is optional (None where absent). A branch layer has both biases and its
    branch's writers (``last=True``) the multiplier too; the stem has ``bias_out`` only (the bias
    before the activation after it), the classifier ``bias_in`` only. A projection shortcut is
    fed the same shifted input as its branch: its ``bias_in`` is the branch's first layer's
    (``shared_in``, the same Parameter under both names).
    """

    def __init__(
        self,
        inner: nn.Module,
        last: bool = False,
        *,
        bias_in: bool = True,
        bias_out: bool = True,
        shared_in: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        like = next(inner.parameters())

        def scalar(value: float) -> nn.Parameter:
            return nn.Parameter(torch.full((), value, dtype=like.dtype, device=like.device))

        self.bias_in = shared_in if shared_in is not None else scalar(0.0) if bias_in else None
        self.bias_out = scalar(0.0) if bias_out else None
        self.scale = scalar(1.0) if last else None
        self.inner = inner

    def reset(self) -> None:
        with torch.no_grad():
            for bias in (self.bias_in, self.bias_out):
                if bias is not None:
                    bias.zero_()
            if self.scale is not None:
                self.scale.fill_(1.0)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.bias_in is not None:
            x = x + self.bias_in
        out = self.inner(x, *args, **kwargs)
        if self.scale is not None:
            out = out * self.scale
        return out if self.bias_out is None else out + self.bias_out


def branch_scales(model: nn.Module) -> dict[str, BranchScale]:
    """Every `BranchScale` in ``model``, by path.

    Example::

        >>> {p: s.kind for p, s in normprobe.branch_scales(model).items()}
    """
    return {p: m for p, m in model.named_modules() if isinstance(m, BranchScale)}


def remove_branch_scale(model: ModuleT, *, fold: bool = True) -> ModuleT:
    """Take out every `BranchScale`, putting the wrapped module back in its place.

    Args:
        model: a model with branch scalers.
        fold: multiply each scale into the wrapped layer's weight and bias (or the wrapped norm's
            gain and bias) first, so the model computes the same function, as
            ``remove_parametrizations(leave_parametrized=True)`` keeps the value. ``False`` drops
            the scale.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: ``fold=True`` and a scale sits on a module without a gain to fold into.

    Example::

        >>> model = normprobe.remove_branch_scale(model)   # after training with LayerScale
    """
    found = branch_scales(model)
    if fold:
        applied = _Applied()
        for path, wrapper in found.items():
            _fold(path, wrapper, applied)
        applied.commit()
    replacements = [(path, wrapper.inner) for path, wrapper in found.items()]
    for path, inner in replacements:
        _replace(model, path, inner)
    return model


def _fold(path: str, wrapper: BranchScale, applied: _Applied) -> None:
    inner = wrapper.inner
    scale = wrapper.scale.detach()
    with torch.no_grad():
        if _is_layer(inner):
            for _, p in applied.of(inner):
                dim = _out_dim(inner) if p.ndim >= 2 else 0
                p.mul_(scale if scale.ndim == 0 else _along(scale, dim, p.ndim))
            return
        params = _direct(inner)
        if wrapper.gain_offset is None or not params:
            raise ValueError(
                f"cannot fold the scale at {path!r} into {type(inner).__name__}, which has no "
                "gain; pass fold=False to drop the scale instead"
            )
        for name, p in params:
            if _is_bias_name(name):
                p.mul_(scale)
            else:
                offset = wrapper.gain_offset
                p.copy_((p + offset) * scale - offset)


def _along(vector: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return vector.view(shape)


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    if not path:
        raise ValueError("cannot replace the root module of the model")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, name, new)


def _is_bias_name(name: str) -> bool:
    low = name.lower()
    return "bias" in low or low in ("beta", "shift", "offset")


# --------------------------------------------------------------------------------------------
# What a scheme works on: the model, its map and (when needed) one forward
# --------------------------------------------------------------------------------------------


@contextmanager
def _observing(model: nn.Module) -> Iterator[None]:
    """Discovery's read-only context in eval mode, with the hooks reinit registers running."""
    with read_only(model, silence_hooks=False):
        model.eval()
        yield


@contextmanager
def _removing() -> Iterator[list[RemovableHandle]]:
    """A list to put hook handles in; each is removed on exit, also when the forward raises."""
    handles: list[RemovableHandle] = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


class _Target:
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
        self.applied = _Applied()  # reinit commits it after the scheme ran
        self.rec = Recorder()  # what the scheme set, for reinit_with_report
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
            or isinstance(modules[p], _Wrapper)
            or not (_is_layer(modules[p]) or p in m.weight_layers)
        ]
        stale += [
            n.path
            for n in m.norms
            if n.path not in modules or isinstance(modules[n.path], _Wrapper)
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
            and (_is_layer(m) or path in used)
            and (embeddings or not isinstance(m, nn.Embedding | nn.EmbeddingBag))
        ]

    def layer_params(self) -> list[tuple[nn.Module, torch.Tensor]]:
        """(layer, parameter) of every non-embedding weight layer, each parameter once; a
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
            for _, p in self.applied.of(m):
                if id(p) not in embedded and id(p) not in seen:
                    seen.add(id(p))
                    found.append((m, p))
        return found

    def depth(self, add: ResidualAdd) -> int:
        """Blocks in the add's stack (the deepest stack, or the number of adds, outside one)."""
        m = self.map
        if add.stack is not None:
            return m.stack(add.stack).depth
        return max((s.depth for s in m.stacks), default=len(m.residual_adds))

    def reset_norms(self) -> None:
        """Norm gains to 1 (Gemma's ``1 + weight``: weight 0) and norm biases to 0; a norm of
        unknown kind (a global response norm, whose gain starts at 0, or no norm at all) is left
        as it is."""
        for n in self.map.norms:
            if n.kind != "unknown":
                _set_norm(self, n, gain=1.0)

    def require_inputs(self, why: str) -> None:
        if not self.has_inputs:
            raise ValueError(
                f"{self.what} runs the model once to {why}: pass example_inputs=(...) "
                "(and example_kwargs={...})"
            )

    def observe(self) -> None:
        """One forward on the example inputs, read-only and in eval mode."""
        with _observing(self.model):
            self.model(*self.args, **self.kwargs)

    def call_order(self, paths: set[str]) -> list[str]:
        """The order in which the modules at ``paths`` run in one forward (one entry a call)."""
        self.require_inputs("see which module ends each residual branch")
        order: list[str] = []
        with _removing() as handles:
            for path in paths:
                handles.append(
                    self.module(path).register_forward_hook(
                        lambda _m, _args, _out, path=path: order.append(path)
                    )
                )
            self.observe()
        return order


def _set_norm(t: _Target, norm: NormLayer, gain: float) -> None:
    offset = norm.gain_offset or 0.0
    as_gain = f"norm gain {gain:g}" + (f" as {offset:g} + weight" if offset else "")
    with torch.no_grad():
        for name, p in _direct(t.module(norm.path)):
            if _is_bias_name(name):
                p.zero_()
                t.rec.record(p, constant(0.0, "norm bias"))
            else:
                p.fill_(gain - offset)
                t.rec.record(p, constant(gain - offset, as_gain))


def _zero(t: _Target, module: nn.Module, why: str) -> None:
    with torch.no_grad():
        for _, p in t.applied.of(module):
            p.zero_()
            t.rec.record(p, constant(0.0, why))


def _parent_wrapper(model: nn.Module, path: str) -> nn.Module | None:
    parent_path, dot, _ = path.rpartition(".")
    if not dot:
        return None
    parent = model.get_submodule(parent_path)
    return parent if isinstance(parent, _Wrapper) and path.endswith(".inner") else None


def _placeable(t: _Target, a: ResidualAdd) -> None:
    """Refuse a branch whose writers do not carry all it adds to the stream."""
    where = f"the residual add {a.module or '<root>'}#{a.ordinal}"
    if not a.writers:
        raise ValueError(
            f"{t.what}: {where} has no weight layer writing into the stream (only gates "
            f"{list(a.gates)}), so there is no layer to scale; leave it out with a model_map "
            "that drops this add, or scale that branch yourself"
        )
    if a.open_path:
        raise ValueError(
            f"{t.what}: a path of the branch of {where} reaches the add without passing a weight "
            f"layer, so scaling its writers {list(a.writers)} would not scale all it adds; "
            "scale that branch yourself"
        )


def _skip_gains(t: _Target, adds: Sequence[ResidualAdd], unit_ok: bool) -> None:
    """Refuse a skip multiplied by a learned gain (``x * gain + f(x)``) that the scheme cannot
    account for: any such gain (``unit_ok`` False), or one not 1 everywhere, where a scheme
    assumes an identity skip at initialization."""
    for a in adds:
        if a.skip_gain is None:
            continue
        if unit_ok and bool((t.model.get_parameter(a.skip_gain) == 1).all()):
            continue
        raise ValueError(
            f"{t.what}: the skip of the residual add {a.module or '<root>'}#{a.ordinal} is "
            f"multiplied by the learned gain {a.skip_gain!r}"
            + (" (not 1 everywhere)" if unit_ok else "")
            + (
                ", where this scheme assumes an identity skip; set it to 1 first"
                if unit_ok
                else ", which the scheme's alpha would have to replace or join; set the skip's "
                "alpha yourself, or use 'gpt2' or 'fixup' (with the gain at 1)"
            )
        )


def _branch_ends(t: _Target, adds: Sequence[ResidualAdd]) -> dict[int, list[str]]:
    """For each add (by index), the last module on each path of its branch: each writer, or the
    norm that follows it on the branch (a sandwich norm, ResNet's BatchNorm after conv2)."""
    norms = {n.path: n for n in t.map.norms}
    ends: dict[int, list[str]] = {}
    pending: list[int] = []
    for i, a in enumerate(adds):
        _placeable(t, a)
        if a.sandwich_norm is not None:
            ends[i] = [a.sandwich_norm]
        elif any(n.role == "branch" for n in norms.values()):
            pending.append(i)
        else:
            ends[i] = list(a.writers)
    if pending:
        watched = {p for p, _ in t.weight_layers()} | {
            p for p, n in norms.items() if n.role == "branch"
        }
        order = t.call_order(watched)
        for i in pending:
            ends[i] = []
            for out in adds[i].writers:
                end = out
                if out in order:
                    for path in order[order.index(out) + 1 :]:
                        if path not in norms:
                            break
                        end = path
                ends[i].append(end)
    return ends


def _channels(t: _Target, path: str) -> tuple[int, int, float | None]:
    """(channels, channel dim, gain offset if a norm) of the module output at ``path``."""
    module = t.module(path)
    norm = next((n for n in t.map.norms if n.path == path), None)
    if norm is not None:
        channel_dim = -1 if norm.layout == "channels-last" else 1
        count = norm.dims[0] if norm.dims else 0
        return count, channel_dim, norm.gain_offset
    weight = next(p for _, p in t.applied.of(module) if p.ndim >= 2)
    channel_dim = 1 if isinstance(module, _CONVS) else -1
    return weight.shape[_out_dim(module)], channel_dim, None


def _scale_value(like: torch.Tensor, value: float, channels: int | None) -> torch.Tensor:
    shape = () if channels is None else (channels,)
    return torch.full(shape, value, dtype=like.dtype, device=like.device)


# --------------------------------------------------------------------------------------------
# reinit
# --------------------------------------------------------------------------------------------

_ALIASES = {s.replace("_", ""): s for s in SCHEMES}


def reinit(
    model: ModuleT,
    scheme: Scheme,
    *,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
    **options: Any,
) -> ModuleT:
    """Re-initialize ``model`` in place with a named scheme, and return it.

    The existing tensors are overwritten with ``torch.nn.init`` (so the same Parameter objects
    stay, and an optimizer built earlier stays valid; Hugging Face's own init skips weights loaded
    by ``from_pretrained``, this does not). Weight layers are leaf modules with a matrix or kernel
    (Linear, Conv, HF's transposed ``Conv1D``, Embedding); fan-in and fan-out follow each layer's
    layout. A parametrized weight gets the scheme's values as the weight the layer applies: weight
    norm's (either torch API) as ``v = w`` and ``g = ||w||``, any other parametrization's through
    its ``right_inverse`` (one without keeps its value, with a warning). Bare parameters of
    container modules (ViT's ``pos_embed``, LayerScale gammas) are left alone.

    Schemes and their options:

    * ``gpt2`` (``std=0.02``, ``n_layers=None``): every weight N(0, std); every weight that
      writes into the residual stream (each add's ``writer_params``: both projections of a
      parallel block, every expert's down projection) N(0, std/sqrt(2N)), N the blocks of its
      stack, or the runs of a repeated block (or ``n_layers``); biases 0; norm gains 1 and
      biases 0 (a norm of unknown kind is left as it is).
    * ``fixup`` (``mode="fan_out"``, ``allow_norms=False``): Zhang et al. 2019, as the
      authors' ResNets do it. L residual branches, m weight layers on a branch: its writers (the
      last layer on each path) 0, the others He-normal times L^(-1/(2m-2)); projection shortcuts
      plain He; the head 0 (unless tied to another weight). `FixupScalars` (biases at 0,
      multipliers at 1) add a scalar bias before and after every branch layer and a multiplier on
      each writer, a bias after the stem (the weight layers that run before any branch, but
      embeddings) and before the head, and feed each projection shortcut the input shifted by
      its branch's first bias (one Parameter). A new optimizer is needed to train them (the
      authors train the scalars at a tenth of the learning rate). Fixup is for networks without
      normalization: a model with norm layers is refused unless ``allow_norms=True``
      (``normprobe.convert_norms(model, "identity")`` removes them).
    * ``deepnorm`` (``n_layers=None``, ``alpha=None``, ``beta=None``): Wang et al. 2022, for
      Post-LN stacks. Feed-forward layers, value projections (the value slice of a fused QKV
      layer) and output projections Xavier-normal with gain beta = (8N)^(-1/4), queries and keys
      gain 1, biases 0; the residual's alpha = (2N)^(1/4) is realized as a fixed 1/alpha
      `BranchScale` on each branch, since the LayerNorm after the add is scale-invariant (up to
      its eps). A skip already scaled by ``s`` gets ``s/alpha``; one multiplied by a learned
      gain (a map's ``skip_gain``) is refused (``gpt2`` and ``fixup`` take it when it is 1).
      An encoder-decoder gets the paper's encoder-decoder constants
      (`deepnorm_encoder_decoder_constants`): a stack is the decoder of an earlier one when its
      first block takes that stack's output as an input of its own (the memory of
      cross-attention) while its stream does not derive from it (told by perturbing the earlier
      stack's output in one more forward). Where that leaves the
      formulas unclear (more than two stacks, or adds outside any, with such a reader), it
      refuses; ``n_layers=`` (the single-stack formulas with that N everywhere) or ``alpha=``
      and ``beta=`` decide instead.
    * ``kaiming`` (``mode="fan_in"``, ``nonlinearity="relu"``, ``a=0.0``,
      ``distribution="normal"``) and ``xavier`` (``gain=None``, ``nonlinearity="linear"``,
      ``distribution="normal"``): every weight layer except embeddings; biases 0; norms reset.
    * ``zero_branch``: the last module of every residual branch set to 0 (its last weight layer,
      or the gain of a norm that follows it on the branch, as ResNet's ``zero_init_residual``).

    Args:
        model: the model; changed in place.
        scheme: one of ``gpt2``, ``fixup``, ``deepnorm``, ``kaiming``, ``xavier``, ``zero_branch``.
        example_inputs: positional inputs for one forward; the schemes that act on residual
            branches need them (or ``model_map``) for discovery.
        example_kwargs: keyword inputs for that forward (``{"use_cache": False}``).
        model_map: a map from ``normprobe.discover`` to use instead of discovering again.
        **options: the scheme's options, listed above.

    Returns:
        ``model``. `reinit_with_report` returns a report of what it set too.

    Raises:
        ValueError: unknown scheme or option, an option out of range, or a scheme that needs
            residual branches on a model where discovery found none, or whose map doubts what
            the scheme would change (`ModelMap.doubts`: ``gpt2``, ``fixup``, ``deepnorm`` and
            ``zero_branch`` refuse, before any change, on a doubt affecting ``reinit``; one about
            the depth N only while they count N themselves, so ``n_layers=`` lifts it).

    Example::

        >>> normprobe.reinit(model, "gpt2", example_inputs=(ids,))
        >>> normprobe.reinit(resnet, "fixup", example_inputs=(images,))
        >>> model, report = normprobe.reinit_with_report(model, "gpt2", example_inputs=(ids,))
    """
    changed, _ = reinit_with_report(
        model,
        scheme,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        model_map=model_map,
        **options,
    )
    return changed


def reinit_with_report(
    model: ModuleT,
    scheme: Scheme,
    *,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
    **options: Any,
) -> tuple[ModuleT, ReinitReport]:
    """`reinit`, also returning a report of what each tensor was set to and what was left.

    Takes the same arguments, and raises the same errors, as `reinit`. The report's numbers are
    the ones applied: each drawn tensor's std (and the formula it comes from, such as
    ``0.02/sqrt(2*12)``), each constant's value, and why every other parameter was left.

    Returns:
        ``(model, report)``: the model as `reinit` returns it, and a `ReinitReport`.

    Example::

        >>> model, report = normprobe.reinit_with_report(model, "gpt2", example_inputs=(ids,))
        >>> print(report)
    """
    key = str(scheme).lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise ValueError(f"unknown init scheme {scheme!r}; expected one of {list(SCHEMES)}")
    name = _ALIASES[key]
    allowed = _OPTIONS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"reinit scheme {name!r} has no option {unknown[0]!r}; its options are "
            f"{sorted(allowed) or 'none'}"
        )
    t = _Target(model, f"reinit(model, {name!r})", example_inputs, example_kwargs, model_map)
    chosen = {**allowed, **options}
    if name in _BRANCH_SCHEMES:
        depth = name in _DEPTH_SCHEMES and chosen["n_layers"] is None
        if name == "deepnorm" and chosen["alpha"] is not None and chosen["beta"] is not None:
            depth = False  # both constants given: N is not used
        t.refuse_doubts("reinit", depth, _REINIT_WAY_OUT[depth])
    before = {id(p) for p in model.parameters()}
    _SCHEMES[name](t, **chosen)
    for kept in t.applied.commit():
        t.rec.undo(kept, "its parametrization cannot be set to a given tensor: kept its value")
    parametrized = t.applied.parametrized(model)
    return model, t.rec.report(model, name, chosen, parametrized, before, _LeftWhy(t, name))


class _LeftWhy:
    """Why ``scheme`` left a parameter alone, from the module holding it."""

    def __init__(self, t: _Target, scheme: str) -> None:
        self.t, self.scheme = t, scheme
        self.norms = {id(_unwrapped(t.module(n.path))): n for n in t.map.norms}
        self.layers = {id(m) for _, m in t.weight_layers()}

    def __call__(self, name: str) -> str:
        owner = re.sub(r"(^|\.)parametrizations\.[^.]+$", "", name.rpartition(".")[0])
        module = self.t.module(owner)
        scheme = self.scheme
        norm = self.norms.get(id(module))
        if norm is not None:
            if norm.kind == "unknown":
                return "a norm of unknown kind: left as it is"
            return f"norm layer: {scheme} keeps norm gains and biases"
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            return f"embedding: {scheme} leaves embeddings as they are"
        if isinstance(module, _Wrapper):
            return f"the scale of a {type(module).__name__}: {scheme} leaves it"
        if id(module) in self.layers:
            return _LEFT_LAYERS.get(scheme, f"{scheme} does not re-initialize it")
        return f"a parameter of {type(module).__name__}, which is no weight layer"


_LEFT_LAYERS = {
    "zero_branch": "not the last module of a residual branch",
    "deepnorm": "not on a residual branch",
    "fixup": "neither on a residual branch, a projection shortcut nor the head",
}


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.inner if isinstance(module, _Wrapper) else module


# The schemes acting on residual branches, and those of them that scale by the depth N.
_BRANCH_SCHEMES = frozenset({"gpt2", "fixup", "deepnorm", "zero_branch"})
_DEPTH_SCHEMES = frozenset({"gpt2", "deepnorm"})
_REINIT_WAY_OUT = {
    True: "Pass n_layers= (the number of blocks) if the depth is what is in doubt, or fix the map",
    False: "Fix the map, or initialize those modules yourself after a scheme that needs no map "
    "('kaiming', 'xavier')",
}


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (number of blocks), got {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)


def _gain_for(nonlinearity: str, a: float = 0.0) -> float:
    try:
        return nn.init.calculate_gain(nonlinearity, a)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(
            f"unknown nonlinearity {nonlinearity!r} (from torch: {err}); use one of 'linear', "
            "'relu', 'leaky_relu', 'tanh', 'sigmoid', 'selu'"
        ) from None


def _scheme_gpt2(t: _Target, *, std: Any, n_layers: Any) -> None:
    std = _positive("std (sigma)", std)
    n = _count("n_layers", n_layers)
    # the weights writing into the residual stream get std/sqrt(2N), per the GPT-2 paper
    adds = t.adds()
    _skip_gains(t, adds, unit_ok=True)
    writers = {q: (n or t.depth(a)) for a in adds for q in a.writer_params}
    for a in adds:
        if a.branch_layers and (not a.writers or a.open_path):  # a weightless one has no std
            _warn(
                f"{t.what}: the branch of the residual add {a.module or '<root>'}#{a.ordinal} "
                + (
                    "has no weight layer writing into the stream"
                    if not a.writers
                    else "reaches the add on a path without a weight layer"
                )
                + "; what it adds keeps std, not std/sqrt(2N)"
            )
    seen: set[int] = set()
    with torch.no_grad():
        for path, m in t.weight_layers():
            for name, p in t.applied.of(m):
                if id(p) in seen:
                    continue  # a tied weight (lm_head = wte) is initialized once
                seen.add(id(p))
                if _is_bias_name(name):
                    nn.init.zeros_(p)
                    t.rec.record(p, constant(0.0, "bias"))
                elif p.ndim >= 2:
                    depth = writers.get(f"{path}.{name}" if path else name)
                    scale = math.sqrt(2 * depth) if depth else 1.0
                    nn.init.normal_(p, 0.0, std / scale)
                    why = f"{std:g}/sqrt(2*{depth})" if depth else f"std={std:g}"
                    t.rec.record(p, normal(std / scale, why))
                else:  # a vector that is no bias (RecurrentGemma's learned decay)
                    t.rec.leave(p, "a vector of a weight layer that is no bias: gpt2 keeps it")
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                dict(t.applied.of(m))["weight"][m.padding_idx].zero_()
                t.rec.notes.append(f"{path}.weight: row {m.padding_idx} (padding_idx) set to 0")
    t.reset_norms()


def _scheme_kaiming(t: _Target, *, mode: Any, nonlinearity: Any, a: Any, distribution: Any) -> None:
    mode = _choice("mode", mode, ("fan_in", "fan_out"))
    distribution = _choice("distribution", distribution, ("normal", "uniform"))
    gain = _gain_for(nonlinearity, a)
    init = nn.init.kaiming_normal_ if distribution == "normal" else nn.init.kaiming_uniform_
    for m, p in t.layer_params():
        if p.ndim >= 2:
            view = out_in_view(m, p)
            init(view, a=a, mode=mode, nonlinearity=nonlinearity)
            t.rec.record(p, kaiming(view, mode, gain, distribution, f"{gain:.4g}"))
        else:
            nn.init.zeros_(p)
            t.rec.record(p, constant(0.0, "bias"))
    t.reset_norms()


def _scheme_xavier(t: _Target, *, gain: Any, nonlinearity: Any, distribution: Any) -> None:
    g = _gain_for(nonlinearity) if gain is None else _positive("gain", gain)
    distribution = _choice("distribution", distribution, ("normal", "uniform"))
    init = nn.init.xavier_normal_ if distribution == "normal" else nn.init.xavier_uniform_
    for m, p in t.layer_params():
        if p.ndim >= 2:
            view = out_in_view(m, p)
            init(view, gain=g)
            t.rec.record(p, xavier(view, g, distribution, f"{g:.4g}"))
        else:
            nn.init.zeros_(p)
            t.rec.record(p, constant(0.0, "bias"))
    t.reset_norms()


def _scheme_zero_branch(t: _Target) -> None:
    adds = t.adds()
    norms = {n.path: n for n in t.map.norms}
    for path in {end for ends in _branch_ends(t, adds).values() for end in ends}:
        if path in norms:
            _set_norm(t, norms[path], gain=0.0)
        else:
            _zero(t, t.module(path), "last layer of a residual branch")


def _scheme_fixup(t: _Target, *, mode: Any, allow_norms: Any) -> None:
    fan = cast(_Fan, _choice("mode", mode, ("fan_in", "fan_out")))
    if not isinstance(allow_norms, bool):
        raise ValueError(f"allow_norms must be True or False, got {allow_norms!r}")
    adds = t.adds()
    _skip_gains(t, adds, unit_ok=True)
    for a in adds:  # every refusal before any change
        _placeable(t, a)
    if not allow_norms:
        _refuse_norms(t)
    t.require_inputs("find the stem and the first layer of each projection shortcut")
    order = t.call_order({p for p, _ in t.weight_layers(embeddings=False)})
    parts: dict[str, _FixupPart] = {}
    with torch.no_grad():
        for a in adds:
            _fixup_branch(t, a, len(adds), fan, parts)
        for a in adds:
            _fixup_shortcut(t, a, fan, order, parts)
        head = t.map.head
        if head is not None and _fixup_head(t, head):
            parts[head] = _FixupPart(bias_out=False)  # fc(x + bias)
    for path in _stem(t, order, parts):
        parts[path] = _FixupPart(bias_in=False)  # act(stem(x) + bias)
    _wrap_fixup(t, parts)


_Fan = Literal["fan_in", "fan_out"]


@dataclass(frozen=True)
class _FixupPart:
    """Which of `FixupScalars`' parts one layer gets; ``shares_in``: the layer whose
    ``bias_in`` it reads too (a projection shortcut reads its branch's first layer's)."""

    last: bool = False
    bias_in: bool = True
    bias_out: bool = True
    shares_in: str | None = None


def _refuse_norms(t: _Target) -> None:
    norms = t.map.norms
    if norms:
        first = norms[0]
        raise ValueError(
            f"{t.what}: Fixup (Zhang et al. 2019) trains residual networks without "
            f"normalization, but {type(t.model).__name__} has {len(norms)} norm layers (the "
            f"first: {first.kind} at {first.path!r}); remove them first with "
            "model = normprobe.convert_norms(model, 'identity'), or pass allow_norms=True to "
            "re-initialize around them"
        )


def _fixup_branch(
    t: _Target, a: ResidualAdd, n_branches: int, mode: _Fan, parts: dict[str, _FixupPart]
) -> None:
    """Writers 0, the other layers He times L^(-1/(2m-2)); every layer gets both biases."""
    layers = [p for p in a.branch_layers if not isinstance(t.module(p), nn.Embedding)]
    m = len(layers)
    for path in layers:
        layer = t.module(path)
        last = path in a.writers  # the last layer on each path of the branch
        parts[path] = _FixupPart(last=last)
        for _, p in t.applied.of(layer):
            if last or p.ndim < 2:
                p.zero_()
                t.rec.record(p, constant(0.0, "last layer of a branch" if last else "bias"))
                continue
            view = out_in_view(layer, p)
            nn.init.kaiming_normal_(view, mode=mode, nonlinearity="relu")
            factor = n_branches ** (-1.0 / (2 * m - 2))
            p.mul_(factor)
            he = kaiming(view, mode, math.sqrt(2.0), "normal", "sqrt(2)")
            why = f"{he.formula}*L^(-1/(2m-2)), L={n_branches}, m={m}"
            t.rec.record(p, scaled(he, factor, why))


def _fixup_shortcut(
    t: _Target, a: ResidualAdd, mode: _Fan, order: list[str], parts: dict[str, _FixupPart]
) -> None:
    """A projection shortcut's layers plain He; the first to run reads the input shifted by
    the bias before the branch's first layer, as the branch does."""
    if a.kind != "projection":
        return
    prefix = a.module + "." if a.module else ""
    shortcut = [
        path
        for path, _ in t.weight_layers(embeddings=False)
        if path.startswith(prefix) and path not in parts
    ]
    for path in shortcut:
        layer = t.module(path)
        for _, p in t.applied.of(layer):
            if p.ndim >= 2:
                view = out_in_view(layer, p)
                nn.init.kaiming_normal_(view, mode=mode, nonlinearity="relu")
                t.rec.record(p, kaiming(view, mode, math.sqrt(2.0), "normal", "sqrt(2)"))
            else:
                p.zero_()
                t.rec.record(p, constant(0.0, "bias"))
    branch = [p for p in a.branch_layers if p in parts]
    first = min((p for p in shortcut if p in order), key=order.index, default=None)
    if first is not None and branch:
        parts[first] = _FixupPart(bias_in=False, bias_out=False, shares_in=branch[0])


def _fixup_head(t: _Target, head: str) -> bool:
    """Zero the classifier; False (with a warning) where its weight is tied to another."""
    tied = _tied_elsewhere(t.model, head)
    if tied:
        _warn(
            f"fixup leaves the head {head!r} as it is: its weight is shared with "
            f"{tied!r}, and zeroing it would zero that too"
        )
        for _, p in _direct(t.module(head)):
            t.rec.leave(p, f"the head, tied to {tied!r}: fixup leaves it (zeroing it zeroes both)")
        return False
    _zero(t, t.module(head), "classifier")
    return True


def _stem(t: _Target, order: list[str], parts: dict[str, _FixupPart]) -> list[str]:
    """The weight layers that run before any residual branch or shortcut: the stem (an
    embedding table, which holds an offset per entry already, excepted)."""
    stem: list[str] = []
    for path in order:
        if path in parts:
            break
        if path not in stem:
            stem.append(path)
    return stem


def _wrap_fixup(t: _Target, parts: dict[str, _FixupPart]) -> None:
    """Wrap each layer in its `FixupScalars`, or reset the one a previous run put there."""
    wrappers: dict[str, FixupScalars] = {}
    swaps = []
    # a shortcut's wrapper takes its branch's bias_in, so the branches' come first
    for path, part in sorted(parts.items(), key=lambda item: item[1].shares_in is not None):
        wrapper = _parent_wrapper(t.model, path)
        if isinstance(wrapper, FixupScalars):
            wrapper.reset()  # fixup ran before: keep the scalars, reset them
            _record_scalars(t, wrapper)
        else:
            shared = wrappers[part.shares_in].bias_in if part.shares_in else None
            wrapper = FixupScalars(
                t.module(path),
                part.last,
                bias_in=part.bias_in,
                bias_out=part.bias_out,
                shared_in=shared,
            )
            swaps.append((path, wrapper))
            _record_scalars(t, wrapper)
        wrappers[path] = wrapper
    # inner layers first: a layer applying weights of its own around a child weight layer
    # (fused experts around their router) is wrapped with the child's wrapper inside it
    for path, new in sorted(swaps, key=lambda swap: -swap[0].count(".")):
        _replace(t.model, path, new)


def _record_scalars(t: _Target, wrapper: FixupScalars) -> None:
    for p, treatment in (
        (wrapper.bias_in, constant(0.0, "Fixup scalar bias before the layer")),
        (wrapper.bias_out, constant(0.0, "Fixup scalar bias after the layer")),
        (wrapper.scale, constant(1.0, "Fixup multiplier")),
    ):
        if p is not None:
            t.rec.record(p, treatment)


def _tied_elsewhere(model: nn.Module, path: str) -> str | None:
    mine = {id(p) for _, p in _direct(model.get_submodule(path))}
    for other, m in model.named_modules():
        if other != path and any(id(p) in mine for _, p in _direct(m)):
            return other
    return None


def deepnorm_constants(n_layers: int) -> tuple[float, float]:
    """DeepNorm's constants for an encoder-only or decoder-only stack (Wang et al. 2022).

    Args:
        n_layers: N, the number of blocks (each with an attention and a feed-forward branch).

    Returns:
        ``(alpha, beta) = ((2N)^(1/4), (8N)^(-1/4))``, as the paper and Microsoft's torchscale
        (``Encoder``/``Decoder`` without ``is_encoder_decoder``) compute them.

    Raises:
        ValueError: ``n_layers`` is not a positive integer.

    Example::

        >>> normprobe.init.deepnorm_constants(12)   # (2.2134, 0.3195)
    """
    n = _count("n_layers", n_layers)
    if n is None:
        raise ValueError("n_layers must be a positive integer (number of blocks), got None")
    return (2 * n) ** 0.25, (8 * n) ** -0.25


def deepnorm_encoder_decoder_constants(
    encoder_layers: int, decoder_layers: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """DeepNorm's constants for an encoder-decoder (Wang et al. 2022, Sec. 4).

    With N encoder and M decoder blocks: ``alpha_enc = 0.81 (N^4 M)^(1/16)``,
    ``beta_enc = 0.87 (N^4 M)^(-1/16)``, ``alpha_dec = (3M)^(1/4)``, ``beta_dec = (12M)^(-1/4)``.

    Microsoft's torchscale (0.3.0, ``architecture/encoder.py`` and ``decoder.py``) has the same
    alphas and decoder beta, but its encoder divides the scaled weights by
    ``(N^4 M)^(1/16) / 1.15``, which is ``beta_enc = 1.15 (N^4 M)^(-1/16)`` (1/0.87, not the
    paper's 0.87). It also multiplies beta into PyTorch's default ``nn.Linear`` init (std
    1/sqrt(3 fan_in); its attention's Xavier ``reset_parameters`` is not called; N(0, 0.02) with
    ``bert_init=True``) on every parameter named ``fc1``, ``fc2``, ``v_proj`` or ``out_proj``,
    biases included, and leaves queries and keys at that init, where the paper (and normprobe)
    draw Xavier-normal with gain beta on the value, output and feed-forward projections, gain 1
    on queries and keys, and zero the biases.

    Args:
        encoder_layers: N, the encoder's blocks.
        decoder_layers: M, the decoder's blocks.

    Returns:
        ``((alpha_enc, beta_enc), (alpha_dec, beta_dec))``.

    Raises:
        ValueError: a count that is not a positive integer.

    Example::

        >>> normprobe.init.deepnorm_encoder_decoder_constants(6, 6)
        ((1.4179, 0.4970), (2.0598, 0.3433))
    """
    n = _count("encoder_layers", encoder_layers)
    m = _count("decoder_layers", decoder_layers)
    if n is None or m is None:
        raise ValueError("encoder_layers and decoder_layers must be positive integers")
    depth = n**4 * m
    encoder = 0.81 * depth ** (1 / 16), 0.87 * depth ** (-1 / 16)
    return encoder, ((3 * m) ** 0.25, (12 * m) ** -0.25)


class _Constants(NamedTuple):
    """DeepNorm's alpha and beta for one stack, and the formulas they come from."""

    alpha: float
    beta: float
    alpha_from: str
    beta_from: str


def _single(n: int) -> _Constants:
    alpha, beta = deepnorm_constants(n)
    return _Constants(alpha, beta, f"(2N)^(1/4), N={n}", f"(8N)^(-1/4), N={n}")


def _deepnorm_defaults(
    t: _Target, adds: Sequence[ResidualAdd], n_layers: int | None, derive: bool
) -> dict[str | None, _Constants]:
    """DeepNorm's (alpha, beta) for the adds of each stack (None: outside any stack).

    ``n_layers`` given: the single-stack formulas with that N everywhere. Otherwise a stack
    whose first block reads an earlier stack's output through an input of its own (the memory of
    a cross-attention) while its stream does not come from that stack is a decoder, the earlier
    one its encoder (`_EncoderReads`); two such stacks get the encoder-decoder formulas, any other
    stack the single-stack ones with its own depth. Refuses where it cannot tell which formulas
    hold (``derive``: some constant is not given).
    """
    if n_layers is not None:
        return {a.stack: _single(n_layers) for a in adds}
    found = {a.stack: _single(t.depth(a)) for a in adds}
    stacks = [s for s in dict.fromkeys(a.stack for a in adds) if s is not None]
    if not derive or len(stacks) < 2:
        return found
    pairs = _EncoderReads(t).pairs(stacks)
    if not pairs:
        return found
    if len(stacks) > 2 or None in found:
        outside = [a.module for a in adds if a.stack is None][:1]
        raise ValueError(
            f"{t.what}: stack {pairs[0][1]!r} reads the output of {pairs[0][0]!r} as an "
            f"encoder-decoder does, but the model has {len(stacks)} stacks"
            + (f" and residual adds outside any ({outside[0]!r})" if outside else "")
            + ", so it is not clear which of DeepNorm's formulas hold; pass n_layers= (the "
            "single-stack formulas with that N everywhere) or alpha= and beta="
        )
    encoder, decoder = pairs[0]
    n, m = t.map.stack(encoder).depth, t.map.stack(decoder).depth
    (a_enc, b_enc), (a_dec, b_dec) = deepnorm_encoder_decoder_constants(n, m)
    sizes = f"N={n}, M={m}"
    found[encoder] = _Constants(
        a_enc, b_enc, f"0.81(N^4 M)^(1/16), {sizes}", f"0.87(N^4 M)^(-1/16), {sizes}"
    )
    found[decoder] = _Constants(a_dec, b_dec, f"(3M)^(1/4), M={m}", f"(12M)^(-1/4), M={m}")
    return found


class _EncoderReads:
    """Finds decoders by behaviour: the earlier stack's last block output is perturbed, and the
    floating-point inputs of each later stack's first block are compared with a plain run.

    A later stack reads the earlier one as a decoder reads its encoder when some input changes
    (the encoder's output, passed to cross-attention) while an input of the stream's shape (the
    block's own output shape) does not (the decoder's stream, which starts from its own
    embeddings). Where every stream-shaped input changes, the later stack continues the earlier
    one's stream (stages of one network); where none changes, the two are independent.
    """

    def __init__(self, t: _Target) -> None:
        self.t = t

    def pairs(self, stacks: list[str]) -> list[tuple[str, str]]:
        """(encoder, decoder) stack pairs, in execution order."""
        self.t.require_inputs("tell an encoder-decoder from other stacks")
        firsts = {s: self.t.map.stack(s).blocks[0] for s in stacks}
        base = self._run(firsts, None)
        found = []
        for i, earlier in enumerate(stacks[:-1]):
            moved = self._run(firsts, self.t.map.stack(earlier).blocks[-1])
            for later in stacks[i + 1 :]:
                if self._reads_aside(base[later], moved[later]):
                    found.append((earlier, later))
        return found

    @staticmethod
    def _reads_aside(
        base: tuple[list[torch.Tensor], tuple[int, ...]],
        moved: tuple[list[torch.Tensor], tuple[int, ...]],
    ) -> bool:
        (before, stream), (after, _) = base, moved
        if len(before) != len(after):
            return False
        changed = [not torch.equal(b, a) for b, a in zip(before, after, strict=True)]
        kept_stream = any(b.shape == stream and not c for b, c in zip(before, changed, strict=True))
        return any(changed) and kept_stream

    def _run(
        self, firsts: dict[str, str], perturb: str | None
    ) -> dict[str, tuple[list[torch.Tensor], tuple[int, ...]]]:
        """Each stack's first block's floating inputs and output shape, in one forward with
        the output of the block at ``perturb`` (if any) shifted by noise."""
        t = self.t
        seen: dict[str, tuple[list[torch.Tensor], tuple[int, ...]]] = {}

        def read_in(stack: str) -> Any:
            def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
                if stack not in seen:  # its first call
                    inputs = [x for _, x in iter_tensors((args, kwargs)) if x.is_floating_point()]
                    seen[stack] = ([x.detach().clone() for x in inputs], ())

            return hook

        def read_out(stack: str) -> Any:
            def hook(_m: nn.Module, _args: Any, out: Any) -> None:
                found = first_float(out)
                if not seen[stack][1] and found is not None:
                    seen[stack] = (seen[stack][0], tuple(found.shape))

            return hook

        with _removing() as handles:
            for stack, block in firsts.items():
                module = t.module(block)
                handles.append(module.register_forward_pre_hook(read_in(stack), with_kwargs=True))
                handles.append(module.register_forward_hook(read_out(stack)))
            if perturb is not None:
                handles.append(t.module(perturb).register_forward_hook(_shift_output))
            t.observe()
        missing = [s for s in firsts if s not in seen]
        if missing:
            raise ValueError(
                f"{t.what}: the first block of stack {missing[0]!r} did not run in the forward "
                "with the given inputs; pass n_layers= or alpha= and beta="
            )
        return seen


def _shift_output(_m: nn.Module, _args: Any, out: Any) -> Any:
    """The module's output with noise added to its first floating-point tensor."""
    for key, x in iter_tensors(out):
        if x.is_floating_point():
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
            return replace_at(out, key, x + noise.to(x.device, x.dtype) * (1 + x.abs().mean()))
    return out


def _scheme_deepnorm(t: _Target, *, n_layers: Any, alpha: Any, beta: Any) -> None:
    n_fixed = _count("n_layers", n_layers)
    alpha_fixed = None if alpha is None else _positive("alpha", alpha)
    beta_fixed = None if beta is None else _positive("beta", beta)
    adds = t.adds()
    m = t.map
    _skip_gains(t, adds, unit_ok=False)
    for a in adds:
        if a.post_norm is None:
            placement = m.stack(a.stack).placement if a.stack else "no stack"
            raise ValueError(
                f"deepnorm is for Post-LN stacks (x = LN(alpha*x + f(x))), but the residual add "
                f"in {a.module or '<root>'!r} has no norm after it (stack {a.stack!r}, "
                f"placement {placement!r}); use 'gpt2' or insert_branch_scale for Pre-LN models"
            )
    defaults = _deepnorm_defaults(t, adds, n_fixed, alpha_fixed is None or beta_fixed is None)
    attention = [att.path for att in m.attention]
    values = _ValueProbe(t)
    ends = _branch_ends(t, adds)
    scalers: list[tuple[str, float, str]] = []
    with torch.no_grad():
        for i, a in enumerate(adds):
            c = defaults[a.stack]
            alpha_i = alpha_fixed or c.alpha
            given = "beta given" if beta_fixed else f"beta={c.beta_from}"
            beta = _Beta(beta_fixed or c.beta, given)
            layers = [p for p in a.branch_layers if not isinstance(t.module(p), nn.Embedding)]
            in_attention = [
                p
                for p in layers
                if p not in a.writers and any(p == q or p.startswith(q + ".") for q in attention)
            ]
            value_slices = values.find(a, in_attention) if in_attention else {}
            for path in layers:
                layer = t.module(path)
                for _, p in t.applied.of(layer):
                    if p.ndim < 2:
                        p.zero_()
                        t.rec.record(p, constant(0.0, "bias"))
                    elif path in value_slices:
                        _xavier_slices(t, layer, p, value_slices[path], beta)
                    else:
                        gain = _QUERY_KEY if path in in_attention else beta
                        _xavier_draw(t, p, out_in_view(layer, p), gain)
            _xavier_mha_inputs(t, layers, beta)
            skip = "1" if a.skip_scale == 1 else f"{a.skip_scale:g}"
            why = f"{skip}/alpha, alpha=" + ("given" if alpha_fixed else c.alpha_from)
            scalers += [(end, a.skip_scale / alpha_i, why) for end in ends.get(i, [])]
    _set_fixed_scalers(t, scalers, "deepnorm")


class _Beta(NamedTuple):
    """A Xavier gain of DeepNorm and where it comes from."""

    gain: float
    why: str


_QUERY_KEY = _Beta(1.0, "")


def _xavier_draw(
    t: _Target,
    p: torch.Tensor,
    view: torch.Tensor,
    beta: _Beta,
    rows: tuple[int, int] | None = None,
) -> None:
    """Xavier-normal on ``view`` (of ``p``, or its output ``rows``), with DeepNorm's gain."""
    nn.init.xavier_normal_(view, gain=beta.gain)
    drawn = xavier(view, beta.gain, "normal", "beta" if beta.why else "1")
    why = f"{drawn.formula}, {beta.why}" if beta.why else f"{drawn.formula} (query, key)"
    t.rec.record(p, normal(drawn.std or 0.0, why), rows)


def _xavier_mha_inputs(t: _Target, layers: list[str], beta: _Beta) -> None:
    """torch's ``nn.MultiheadAttention`` applies its q, k, v projections as parameters of its
    own (the map lists its ``out_proj``): q and k Xavier gain 1, v gain beta, their bias 0."""
    for path in sorted({p.rpartition(".")[0] for p in layers if p.endswith(".out_proj")}):
        mha = t.module(path)
        if not isinstance(mha, nn.MultiheadAttention):
            continue
        for name, p in t.applied.of(mha):
            if name == "in_proj_weight":
                _xavier_slices(t, mha, p, [2], beta)
            elif name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                _xavier_draw(t, p, p, beta if name.startswith("v") else _QUERY_KEY)
            elif name == "in_proj_bias":
                p.zero_()
                t.rec.record(p, constant(0.0, "bias"))


def _xavier_slices(
    t: _Target, layer: nn.Module, p: torch.Tensor, value_parts: list[int], beta: _Beta
) -> None:
    """Xavier per q|k|v part of a fused projection: gain beta on value parts, 1 on the rest."""
    view = out_in_view(layer, p)
    if value_parts == [-1]:
        _xavier_draw(t, p, view, beta)
        return
    size = view.shape[0] // 3
    for k in range(3):
        rows = (k * size, (k + 1) * size)
        _xavier_draw(t, p, view[rows[0] : rows[1]], beta if k in value_parts else _QUERY_KEY, rows)


class _ValueProbe:
    """Tells value projections from query/key ones by behaviour.

    Doubling a value projection's output doubles the attention output exactly (attention is
    linear in V); doubling a query or key changes the softmax. Each candidate (and each third of a
    fused QKV output) is doubled in turn while the input of the branch's last layer is read.
    Blocks of one class share the answer, keyed by the layer's path inside its block.
    """

    def __init__(self, t: _Target) -> None:
        self.t = t
        self.cache: dict[tuple[type, str], list[int]] = {}

    def find(self, add: ResidualAdd, candidates: list[str]) -> dict[str, list[int]]:
        """Layer path -> value parts: ``[-1]`` whole layer, ``[2]`` its last third, ``[]`` none."""
        found: dict[str, list[int]] = {}
        todo = []
        for path in candidates:
            key = self._key(add, path)
            if key is not None and key in self.cache:
                found[path] = self.cache[key]
            else:
                todo.append(path)
        if todo:
            self.t.require_inputs("tell value projections from query/key projections")
            out = self._writer_after(add, todo)
            base = self._read(out, None, None)
            for path in todo:
                parts = self._probe(out, path, base)
                found[path] = parts
                key = self._key(add, path)
                if key is not None:
                    self.cache[key] = parts
        if not any(found.values()):
            raise ValueError(
                f"deepnorm could not find the value projection among {candidates} (doubling "
                "none of them, nor any third of a fused q|k|v output, doubled the attention "
                f"output read at {list(add.writers)}); pass beta=1.0 to skip the value scaling, "
                "or re-initialize those layers yourself"
            )
        return {p: v for p, v in found.items() if v}

    def _writer_after(self, add: ResidualAdd, candidates: list[str]) -> str:
        """The writer the attention's projections feed: the one sharing their module (the
        attention of a parallel block), else the last."""
        for w in add.writers:
            parent = w.rpartition(".")[0]
            if any(c.startswith(parent + ".") for c in candidates):
                return w
        return add.writers[-1]

    def _key(self, add: ResidualAdd, path: str) -> tuple[type, str] | None:
        if add.stack is None or add.block is None:
            return None
        block = self.t.map.stack(add.stack).blocks[add.block]
        if not path.startswith(block + "."):
            return None
        return type(self.t.module(block)), path[len(block) :]

    def _probe(self, out_path: str, path: str, base: torch.Tensor) -> list[int]:
        if self._linear(self._read(out_path, path, None), base):
            return [-1]
        size = self._width(path)
        if size % 3:
            return []
        return [k for k in range(3) if self._linear(self._read(out_path, path, k), base)]

    def _width(self, path: str) -> int:
        layer = self.t.module(path)
        weight = next(p for _, p in self.t.applied.of(layer) if p.ndim >= 2)
        return weight.shape[_out_dim(layer)]

    @staticmethod
    def _linear(doubled: torch.Tensor, base: torch.Tensor) -> bool:
        # doubling is exact in floating point, so a linear path gives 2 * base up to rounding
        return bool(
            torch.allclose(doubled, 2 * base, rtol=1e-4, atol=1e-6 * float(base.abs().max()))
        )

    def _read(self, out_path: str, double: str | None, part: int | None) -> torch.Tensor:
        t = self.t
        seen: list[torch.Tensor] = []

        def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not seen:
                seen.append(args[0].detach().clone())

        def scale(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            if part is None:
                return out * 2
            size = out.shape[-1] // 3
            out = out.clone()
            out[..., part * size : (part + 1) * size] *= 2
            return out

        with _removing() as handles:
            handles.append(t.module(out_path).register_forward_pre_hook(capture))
            if double is not None:
                handles.append(t.module(double).register_forward_hook(scale))
            t.observe()
        return seen[0]


def _set_fixed_scalers(t: _Target, scalers: list[tuple[str, float, str]], kind: str) -> None:
    swaps = []
    for path, value, why in scalers:
        wrapper = _parent_wrapper(t.model, path)
        if isinstance(wrapper, BranchScale) and wrapper.kind == kind:
            wrapper.scale.fill_(value)  # ran before: update the factor in place
            t.rec.record(wrapper.scale, constant(value, why))
            continue
        if abs(value - 1.0) < 1e-6:
            t.rec.notes.append(f"{path}: the skip already carries alpha, no scaler added")
            continue
        like = next(t.module(path).parameters())
        _, channel_dim, offset = _channels(t, path)
        new = BranchScale(
            t.module(path),
            kind,
            _scale_value(like, value, None),
            channel_dim,
            learnable=False,
            gain_offset=offset,
        )
        t.rec.record(new.scale, constant(value, why))
        swaps.append((path, new))
    for path, new in swaps:
        _replace(t.model, path, new)


_SCHEMES: dict[str, Any] = {
    "gpt2": _scheme_gpt2,
    "fixup": _scheme_fixup,
    "deepnorm": _scheme_deepnorm,
    "kaiming": _scheme_kaiming,
    "xavier": _scheme_xavier,
    "zero_branch": _scheme_zero_branch,
}

_OPTIONS: dict[str, dict[str, Any]] = {
    "gpt2": {"std": 0.02, "n_layers": None},
    "fixup": {"mode": "fan_out", "allow_norms": False},
    "deepnorm": {"n_layers": None, "alpha": None, "beta": None},
    "kaiming": {"mode": "fan_in", "nonlinearity": "relu", "a": 0.0, "distribution": "normal"},
    "xavier": {"gain": None, "nonlinearity": "linear", "distribution": "normal"},
    "zero_branch": {},
}


# --------------------------------------------------------------------------------------------
# insert_branch_scale
# --------------------------------------------------------------------------------------------


def cait_init(depth: int) -> float:
    """CaiT's LayerScale starting value for a model of ``depth`` blocks (Touvron et al. 2021).

    Args:
        depth: the number of blocks.

    Returns:
        0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 beyond.

    Example::

        >>> normprobe.init.cait_init(36)   # 1e-06
    """
    if depth <= 18:
        return 0.1
    return 1e-5 if depth <= 24 else 1e-6


def insert_branch_scale(
    model: ModuleT,
    kind: BranchScaleKind,
    *,
    init: float | Literal["cait"] | None = None,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
) -> ModuleT:
    """Put a learnable scale on the end of every residual branch: ``x + scale * f(x)``.

    The last module of each branch (its last weight layer, or the norm that follows it on the
    branch: Gemma's sandwich norm, ResNet's BatchNorm) is wrapped in a `BranchScale`, so the scale
    acts on exactly what the branch adds to the stream. The wrapped module keeps its parameters
    and hooks; its state_dict keys gain ``.inner`` and the scale is ``.scale``.

    * ``rezero`` (Bachlechner et al. 2020) and ``skipinit`` (De & Smith 2020): one scalar per
      branch, ``init`` 0 by default, so the model starts as the identity on its residual stream.
    * ``layerscale`` (CaiT, Touvron et al. 2021): one factor per channel, ``init`` 1e-5 by
      default; ``init="cait"`` picks 0.1 / 1e-5 / 1e-6 for up to 18 / 24 / more blocks.

    Args:
        model: the model; changed in place.
        kind: ``rezero``, ``layerscale`` or ``skipinit``.
        init: the starting value (a finite number), or ``"cait"`` for LayerScale.
        example_inputs: positional inputs for one forward (discovery needs them).
        example_kwargs: keyword inputs for that forward.
        model_map: a map from ``normprobe.discover`` to use instead of discovering again.

    Returns:
        ``model``. Build the optimizer afterwards: the scales are new parameters.

    Raises:
        ValueError: unknown kind, a bad ``init``, no residual branches found, or a doubt of the
            map affecting ``insert_branch_scale`` (one about the depth only with
            ``init="cait"``), before any change.
        RuntimeError: the model already has branch scalers.

    Example::

        >>> model = normprobe.insert_branch_scale(model, "rezero", example_inputs=(ids,))
        >>> model = normprobe.insert_branch_scale(vit, "layerscale", init="cait",
        ...                                       example_inputs=(images,))
    """
    if kind not in BRANCH_SCALES:
        raise ValueError(f"unknown branch scale {kind!r}; expected one of {list(BRANCH_SCALES)}")
    if init == "cait":
        if kind != "layerscale":
            raise ValueError(f"init='cait' is CaiT's LayerScale rule; {kind!r} takes a number")
    elif init is not None and (
        isinstance(init, bool) or not isinstance(init, int | float) or not math.isfinite(init)
    ):
        raise ValueError(f"init must be a finite number or 'cait', got {init!r}")
    existing = branch_scales(model) if isinstance(model, nn.Module) else {}
    if existing:
        path, first = next(iter(existing.items()))
        raise RuntimeError(
            f"the model already has {len(existing)} branch scalers ({first.kind} at {path!r}); "
            "inserting more would stack them. Remove them first with "
            "normprobe.remove_branch_scale(model, fold=True), which keeps the function"
        )
    t = _Target(
        model, f"insert_branch_scale(model, {kind!r})", example_inputs, example_kwargs, model_map
    )
    way_out = (
        "Fix the map" if init != "cait" else "Give init= a number if only the depth is in doubt"
    )
    t.refuse_doubts("insert_branch_scale", init == "cait", way_out)
    adds = t.adds()
    ends = _branch_ends(t, adds)
    swaps: dict[str, BranchScale] = {}
    for i, path in ((i, path) for i, paths in ends.items() for path in paths):
        if path in swaps:
            continue
        if init == "cait":
            value = cait_init(t.depth(adds[i]))
        elif init is None:
            value = 1e-5 if kind == "layerscale" else 0.0
        else:
            value = float(init)
        module = t.module(path)
        like = next(module.parameters(), None)
        if like is None:
            raise ValueError(
                f"the branch of the add in {adds[i].module!r} ends in {path!r}, which has no "
                "parameters to take a dtype and device from"
            )
        channels, channel_dim, offset = _channels(t, path)
        per_channel = channels if kind == "layerscale" else None
        swaps[path] = BranchScale(
            module, kind, _scale_value(like, value, per_channel), channel_dim, True, offset
        )
    for path, new in swaps.items():
        _replace(model, path, new)
    return model
