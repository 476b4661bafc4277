"""What `diagnose`'s own hooks read during its one forward (and backward).

The batch size at each BatchNorm layer in training mode, the input of the first norm of each
class (for the low-precision rerun), each weight layer's gains (`normprobe.diagnose.layers`) and
the Linear/Conv→ReLU pairs with the second moment in and out, chained where one pair feeds the
next.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..discovery import ModelMap
from ..nested import first_float
from .layers import LayerCapture, capture_layers
from .weights import fan_in_gain, weight_layer_paths


@dataclass
class ReluPair:
    """A weight layer whose output went straight into a ReLU."""

    layer: str
    ms_in: float
    ms_out: float
    gain: float  # fan_in * Var(W)
    x_in: torch.Tensor | None  # the layer's input, to chain pairs (dropped after the forward)
    y_out: torch.Tensor | None


@dataclass
class Capture:
    """What diagnose's own hooks read during the forward."""

    bn_batch: dict[str, int] = field(default_factory=dict)
    norm_inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    layer_calls: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    pairs: list[ReluPair] = field(default_factory=list)
    chains: list[list[ReluPair]] = field(default_factory=list)
    layers: LayerCapture = field(default_factory=LayerCapture)

    def chain_pairs(self) -> None:
        """Chain the ReLU pairs, then drop their activations (none kept alive in the result)."""
        self.chains = relu_chains(self.pairs)
        for pair in self.pairs:
            pair.x_in = pair.y_out = None


_RELU = {"relu", "relu_"}


def _ms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean())


class _ReluWatch(TorchFunctionMode):
    """Pairs each ReLU with the weight layer whose output it received, if any."""

    def __init__(self, cap: Capture, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.cap = cap
        self.modules = modules

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _RELU or not args:
            return func(*args, **kwargs)
        x = args[0]
        source = next(
            (c for c in reversed(self.cap.layer_calls[-4:]) if c[2] is x), None
        )  # the layer that just produced x
        ms_in = _ms(source[1]) if source is not None else math.nan
        out = func(*args, **kwargs)
        if source is not None and isinstance(out, torch.Tensor):
            self.cap.pairs.append(
                ReluPair(
                    source[0],
                    ms_in,
                    _ms(out),
                    fan_in_gain(self.modules[source[0]]),
                    source[1],
                    out,
                )
            )
        return out


def _norm_hooks(
    modules: dict[str, nn.Module], model_map: ModelMap, cap: Capture
) -> list[RemovableHandle]:
    """BatchNorm's batch size, and the input of the first norm of each other class."""
    handles = []
    first_of_class: dict[type, str] = {}
    for n in model_map.norms:
        m = modules.get(n.path)
        if m is None:
            continue
        if isinstance(m, _BatchNorm):

            def bn_pre(mod: nn.Module, args: tuple[Any, ...], path: str = n.path) -> None:
                x = first_float(args)
                if mod.training and x is not None and x.ndim >= 2:
                    cap.bn_batch.setdefault(path, int(x.shape[0]))

            handles.append(m.register_forward_pre_hook(bn_pre))
        elif n.kind != "dyt" and type(m) not in first_of_class:
            first_of_class[type(m)] = n.path

            def norm_pre(
                mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = n.path
            ) -> None:
                cap.norm_inputs.setdefault(path, (args, kwargs))

            handles.append(m.register_forward_pre_hook(norm_pre, with_kwargs=True))
    return handles


def _layer_hooks(
    modules: dict[str, nn.Module], paths: list[str], cap: Capture
) -> list[RemovableHandle]:
    """Each weight layer's (input, output), for `_ReluWatch` to find a ReLU's source."""
    handles = []
    for path in paths:

        def layer_post(mod: nn.Module, args: tuple[Any, ...], out: Any, path: str = path) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                cap.layer_calls.append((path, args[0], out))

        handles.append(modules[path].register_forward_hook(layer_post))
    return handles


@contextmanager
def capturing(model: nn.Module, model_map: ModelMap, cap: Capture) -> Iterator[None]:
    """Fill ``cap`` during the forward run inside; the gradient hooks stay until
    ``cap.layers.release()``."""
    modules = dict(model.named_modules())
    weight_layers = weight_layer_paths(modules)
    handles = _norm_hooks(modules, model_map, cap) + _layer_hooks(modules, weight_layers, cap)
    try:
        with (
            _ReluWatch(cap, modules),
            capture_layers(model, weight_layers, cap.layers),
        ):
            yield
    finally:
        for h in handles:
            h.remove()
        cap.layer_calls.clear()


def relu_chains(pairs: list[ReluPair]) -> list[list[ReluPair]]:
    """Runs of pairs where each layer's input is the previous pair's ReLU output."""
    chains: list[list[ReluPair]] = []
    for pair in pairs:
        last = chains[-1][-1] if chains else None
        if last is not None and pair.x_in is not None and _same(pair.x_in, last.y_out):
            chains[-1].append(pair)
        else:
            chains.append([pair])
    return chains


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` is ``b``, or the whole-tensor view of it a layer is handed
    (`capture_layers`)."""
    if b is None or a is b:
        return a is b
    base = b._base if b._base is not None else b
    return (
        a._base is base
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
