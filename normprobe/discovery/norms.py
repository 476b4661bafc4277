"""Recognize normalization layers: by torch class, by class name, and by behaviour.

The behaviour probe calls a candidate module on its own captured input (parameters swapped for
random ones through `torch.func.functional_call`, buffers and modes restored afterwards) and asks:
is the output unchanged when the input is scaled but changed by noise (a normalizer)? unchanged by
a constant shift (re-centering: LayerNorm) or not (RMSNorm)? which elements share statistics with a
perturbed one (last dim, channels, batch)? is the output non-zero with zeroed parameters (a
Gemma-style ``1 + weight`` gain)? and, given eps, does it sit inside the square root?
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.utils import parametrizations, parametrize

from ..nested import first_float, iter_tensors, replace_at
from .model_map import EpsPlacement, NormKind
from .state import preserved

TORCH_KINDS: tuple[tuple[type[nn.Module], NormKind], ...] = (
    (nn.modules.instancenorm._InstanceNorm, "instancenorm"),
    (_NormBase, "batchnorm"),
    (nn.LayerNorm, "layernorm"),
    (nn.RMSNorm, "rmsnorm"),
    (nn.GroupNorm, "groupnorm"),
    (nn.LocalResponseNorm, "unknown"),
    (nn.CrossMapLRN2d, "unknown"),
)
# A class (or a base class) named like a norm: LayerNorm, RmsNorm, LayerNorm2d, BatchNormAct2d,
# a global response norm (GRN)
NAME_PATTERN = re.compile(r"(?i)(norm|grn)(\d?d)?(act)?(\d?d)?(fp32|nobias|gated|1p)?$")
# Names that say there is no norm (MobileBERT's NoNorm: an elementwise affine map).
NOT_A_NORM = re.compile(r"(?i)^no_?norm")
# Names that say the wrong thing about what the class computes.
MISLEADING_NAMES: dict[str, NormKind] = {"T5LayerNorm": "rmsnorm", "MT5LayerNorm": "rmsnorm"}
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "eps_")
# Norm replacements that compute no statistics (Dynamic Tanh), known by class name.
TANH_NAMES = frozenset({"DyT", "DynamicTanh"})


@dataclass(frozen=True)
class Behaviour:
    """What the probe measured on one module."""

    centering: bool
    layout: str  # "channels-last" | "channels-first" | "batch" | "spatial" | "groups"
    dims: tuple[int, ...]
    gain_offset: float | None
    eps_placement: EpsPlacement
    kind: NormKind
    varying: tuple[int, ...] = ()  # the input dims sharing statistics with one element


def torch_kind(module: nn.Module) -> NormKind | None:
    for cls, kind in TORCH_KINDS:
        if isinstance(module, cls):
            return kind
    return None


def is_parametrization(module: nn.Module) -> bool:
    """A ``torch.nn.utils.parametrize`` container or one of torch's parametrizations
    (``_WeightNorm``, ``_SpectralNorm``, ``_Orthogonal``): they transform a layer's weight, not
    activations."""
    return isinstance(module, parametrize.ParametrizationList) or (
        type(module).__module__ == parametrizations.__name__
    )


def name_match(module: nn.Module) -> str | None:
    """The first class in the MRO named like a norm, if any (never a parametrization, nor a
    class named for having none)."""
    if is_parametrization(module):
        return None
    for cls in type(module).__mro__:
        if cls in (nn.Module, object):
            break
        if NOT_A_NORM.match(cls.__name__):
            return None
        if NAME_PATTERN.search(cls.__name__):
            return cls.__name__
    return None


def tanh_replacement(module: nn.Module) -> str | None:
    """The class name if ``module`` is a Dynamic Tanh layer standing in for a norm."""
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in TANH_NAMES), None)


def kind_from_name(class_name: str) -> NormKind:
    if class_name in MISLEADING_NAMES:
        return MISLEADING_NAMES[class_name]
    lowered = class_name.lower()
    for token, kind in (
        ("rms", "rmsnorm"),
        ("batch", "batchnorm"),
        ("group", "groupnorm"),
        ("instance", "instancenorm"),
        ("layer", "layernorm"),
    ):
        if token in lowered:
            return kind  # type: ignore[return-value]
    return "unknown"


def has_param_children(module: nn.Module) -> bool:
    return any(any(True for _ in c.parameters()) for c in module.children())


def is_probe_candidate(module: nn.Module) -> bool:
    """Leaf-like modules that may be normalizers: not a known non-norm torch class."""
    if has_param_children(module) or isinstance(module, nn.ModuleList | nn.ModuleDict):
        return False
    # torch's own classes are known; their subclasses elsewhere (timm's LayerNorm2d) may differ
    return not type(module).__module__.startswith("torch.")


def eps_of(module: nn.Module) -> tuple[float | None, str | None]:
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value), attr
    return None, None


def torch_dims(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return tuple(module.normalized_shape)
    if isinstance(module, nn.GroupNorm):
        return (module.num_groups, module.num_channels)
    if isinstance(module, _NormBase):
        return (module.num_features,)
    if isinstance(module, nn.LocalResponseNorm | nn.CrossMapLRN2d):
        return (module.size,)
    return ()


# timm's norm classes by the axis their statistics run over (matched by class, not by name)
_TIMM_LAYOUTS = {
    "channels-first": ("LayerNorm2d", "LayerNorm2dFp32", "LayerNormExp2d", "RmsNorm2d",
                       "RmsNorm2dFp32", "SimpleNorm2d", "SimpleNorm2dFp32"),
    "channels-last": ("LayerNorm", "LayerNormFp32", "RmsNorm", "RmsNormFp32", "SimpleNorm",
                      "SimpleNormFp32"),
}  # fmt: skip


def runs_torch_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward is that of the torch.nn class it derives from."""
    base = next((c for c in type(module).__mro__ if c.__module__.startswith("torch.nn")), None)
    return base is not None and type(module).forward is cast(type[nn.Module], base).forward


def declared_layout(module: nn.Module) -> str:
    """The statistics layout the module itself declares, without running it; ``""`` if none.

    A ``data_format`` attribute (``"channels_first"``/``"channels_last"``: Hugging Face's
    ConvNeXt LayerNorm, normprobe's own layers), timm's norm classes, a torch norm class whose
    forward is torch's own, or a subclass of a torch group or batch norm.
    """
    fmt = getattr(module, "data_format", None)
    if fmt in ("channels_first", "channels_last"):
        return str(fmt).replace("_", "-")
    timm_norm = sys.modules.get("timm.layers.norm")
    for layout, names in _TIMM_LAYOUTS.items():
        classes = tuple(c for n in names if isinstance(c := getattr(timm_norm, n, None), type))
        if classes and isinstance(module, classes):
            return layout
    if runs_torch_forward(module) or isinstance(module, nn.GroupNorm | _NormBase):
        return _class_layout(module)  # a group or batch norm's own attributes say its layout
    return ""


def torch_layout(module: nn.Module) -> str:
    """The layout of a torch norm class; for a subclass with a forward of its own, only what it
    declares (`declared_layout`)."""
    if not type(module).__module__.startswith("torch.") and not runs_torch_forward(module):
        return declared_layout(module)
    return _class_layout(module)


def _class_layout(module: nn.Module) -> str:
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return "spatial"
    if isinstance(module, _NormBase):
        return "batch"
    if isinstance(module, nn.GroupNorm):
        return "groups"
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return "channels-last"
    return ""


# ---------------------------------------------------------------------------------------------
# behaviour probe


def float_inputs(args: Any, kwargs: Any) -> Iterator[tuple[tuple[str | int, ...], torch.Tensor]]:
    """The key and value of each floating input of 4+ entries in a call's arguments."""
    for key, t in iter_tensors((args, kwargs)):
        if t.is_floating_point() and t.numel() >= 4:
            yield key, t


def first_float_input(args: Any, kwargs: Any) -> tuple[tuple[str | int, ...], torch.Tensor] | None:
    """The key and value of the first of `float_inputs`."""
    return next(float_inputs(args, kwargs), None)


def own_gain(module: nn.Module) -> torch.Tensor | None:
    """The module's first floating-point parameter of its own: a norm's gain, if it has one."""
    return next((p for p in module.parameters(recurse=False) if p.is_floating_point()), None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


class _SizeChanged(ValueError):
    """The module's output is not of its input's size."""


class _Prober:
    """Calls one module on variations of its captured input, leaving no trace on it."""

    def __init__(
        self, module: nn.Module, args: Any, kwargs: Any, eps: float | None, fresh: bool = False
    ) -> None:
        self.module = module
        found = first_float_input(args, kwargs)
        if found is None:
            raise ValueError("no floating-point input")
        self.key, x = found
        self.inputs = (args, kwargs)
        x = x.detach().double()
        gen = torch.Generator(device="cpu").manual_seed(0)
        # all zeros (a branch zero at init) or one value show nothing; ``fresh``: rows near eps
        # (tiny heads of a multi-head norm) would hide the invariance a Gaussian input shows
        if fresh or _constant(x):
            x = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
        # probe at a size where eps is negligible: every test below is relative to it (a
        # vanishing input, 1e-16 after many layers without norms, too)
        self.size = max(10.0, 100 * math.sqrt(eps)) if eps else 10.0
        x = x * self.size / x.pow(2).mean().sqrt().clamp_min(1e-300)
        # half-precision modules are probed in float32: their rounding (bf16's 0.4%) would hide
        # a scale invariance measured to 0.1%
        wide = torch.promote_types(found[1].dtype, torch.float32)
        self.x = x.to(wide)
        noise = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        noise -= (noise * x).sum() / x.pow(2).sum() * x  # never parallel to x
        self.noise = (self.size * noise / noise.pow(2).mean().sqrt()).to(self.x)
        self.params = {
            name: (1 + 0.1 * torch.randn(p.shape, generator=gen)).to(p.device, wide)
            if p.is_floating_point()
            else p
            for name, p in module.named_parameters()
        }
        self.buffers = {
            name: b.to(wide) if b.is_floating_point() else b for name, b in module.named_buffers()
        }
        self.train = False

    def __call__(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> Any:
        args, kwargs = replace_at(self.inputs, self.key, x)
        torch.manual_seed(0)  # identical dropout masks across calls
        tensors = {**self.buffers, **(params if params is not None else self.params)}
        out = torch.func.functional_call(self.module, tensors, tuple(args), kwargs)
        y = first_float(out)
        if y is None or y.numel() != x.numel():
            raise _SizeChanged("output size differs from input")
        return y.reshape(x.shape).double()  # heads merged into one axis (xLSTM's head norm)

    def gain_offset(self) -> float | None:
        """1.0 when the output stays non-zero with every parameter zero (``1 + weight``), 0.0
        when it vanishes, None without parameters."""
        if not self.params:
            return None
        zeros = {n: torch.zeros_like(t) for n, t in self.params.items()}
        return 0.0 if float(self(self.x, zeros).abs().max()) < 1e-6 else 1.0


def probe(
    module: nn.Module, args: Any, kwargs: Any, eps: float | None, fresh: bool = False
) -> Behaviour | None:
    """Measure whether ``module`` behaves like a normalizer on its input, and which one.

    A constant captured input (all zeros behind a branch that is zero at initialization) is
    replaced by a random one, and scale invariance must also hold on the input plus noise: a
    module that merely adds something to its input (``x + residual``) looks scale invariant on
    zeros, and one that centers over a dim the input is constant along outputs zeros. ``fresh``:
    a Gaussian input of the captured one's shape in its place.
    """
    try:
        with preserved(module), torch.no_grad():
            p = _Prober(module, args, kwargs, eps, fresh)
            for train in (False, True):  # batch statistics only show in train mode
                module.train(train)
                y = p(p.x)
                if _rel(y, p(p.x * 7.3)) >= 1e-3:
                    continue
                noisy = p.x + 0.5 * p.noise
                y_noisy = p(noisy)
                if _rel(y, y_noisy) > 1e-2 and _rel(y_noisy, p(noisy * 7.3)) < 1e-3:
                    return _describe(p, y, eps)
            return None
    except Exception:  # the module refuses variations of its input: not something we can probe
        return None


def probe_alone(module: nn.Module, eps: float | None) -> Behaviour | None:
    """`probe` on a Gaussian input made for ``module`` alone (no traced call to take one from):
    its gain's shape as the features, last (batch, 7, *F) or first (batch, *F, 5, 7), the
    layout the module declares tried first. None when it runs on neither."""
    weight = own_gain(module)
    like = weight if weight is not None else torch.empty(0)
    features = tuple(weight.shape) if weight is not None else (16,)
    shapes = [(2, 7, *features), (2, *features, 5, 7)]
    if declared_layout(module) == "channels-first":
        shapes.reverse()
    for shape in shapes:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(like)
        found = probe(module, (x,), {}, eps)
        if found is not None:
            return found
    return None


def gain_offset(module: nn.Module, args: Any, kwargs: Any) -> float | None:
    """1.0 when ``module`` still outputs something with every parameter zero (a ``1 + gain``),
    0.0 when its output vanishes, None when it cannot be called on variations of its input."""
    try:
        with preserved(module), torch.no_grad():
            module.eval()
            return _Prober(module, args, kwargs, None).gain_offset()
    except Exception:  # the module refuses variations of its input
        return None


def invariant_as_is(module: nn.Module, args: Any, kwargs: Any, eps: float | None) -> bool:
    """Whether ``module`` with its own parameters, not the probe's random ones, is scale
    invariant too (on its input or a Gaussian one, in eval or train mode). Parameters inside
    the statistics can make a normalizer of it under random values only: GDN's
    ``x / sqrt(beta + gamma @ x^2)`` at its init (beta = 1, gamma = 0.1 I) is elementwise."""
    try:
        with preserved(module), torch.no_grad():
            for fresh in (False, True):
                p = _Prober(module, args, kwargs, eps, fresh)
                own = {  # the module's own parameters, in the probe's dtype
                    n: q.detach().to(p.x.dtype) if q.is_floating_point() else q
                    for n, q in module.named_parameters()
                }
                for train in (False, True):
                    module.train(train)
                    if not _rel(p(p.x, own), p(p.x * 7.3, own)) >= 1e-3:  # NaN: no evidence
                        return True
            return False
    except Exception:  # ran with random parameters but not its own: no evidence against
        return True


def no_normalization(module: nn.Module, args: Any, kwargs: Any) -> bool:
    """Whether ``module``'s output on its input is no normalization of it whatever its name:
    of another size (e3nn's ``o3.Norm``, the magnitude of each irrep) or, in eval and in train
    mode, the input itself (neuralforecast's ``MaybeLayerNorm`` holding an ``nn.Identity``)."""
    try:
        with preserved(module), torch.no_grad():
            p = _Prober(module, args, kwargs, None)
            same = []
            for train in (False, True):
                module.train(train)
                same.append(torch.equal(p(p.x), p.x.double()))
            return all(same)
    except _SizeChanged:
        return True
    except Exception:  # the module refuses variations of its input: nothing measured
        return False


def _constant(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` holds the same value (zero included)."""
    return float(x.max() - x.min()) <= 1e-6 * float(x.abs().max())


def _describe(p: _Prober, y: torch.Tensor, eps: float | None) -> Behaviour:
    centering = _rel(y, p(p.x + 3.0 * p.size)) < 1e-3
    layout, dims, varying = _statistics_layout(p, y)
    kind: NormKind
    if layout == "batch":
        kind = "batchnorm"
    elif layout == "spatial":
        kind = "instancenorm"
    elif layout == "groups":
        kind = "groupnorm"
    elif layout in ("channels-last", "channels-first"):
        kind = "layernorm" if centering else "rmsnorm"
    else:
        kind = "unknown"
    placement = _eps_placement(p, eps)
    return Behaviour(centering, layout, dims, p.gain_offset(), placement, kind, varying)


# How many channels `_statistics_layout` perturbs, the ends included.
_CENTERS = 8


def _statistics_layout(p: _Prober, y: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Perturb one element and see which others move: they share its statistics. The element is
    the largest, then others of its row along the channel axis (the last dim channels-last,
    else dim 1), the ends included: a layout only some channels share (e3nn's BatchNorm, each
    vector's components jointly, each scalar alone) is no known one. The row is the largest
    element's: a zero row of the input (a padding token's embedding) would stay zero around it
    whatever it shares."""
    shape = p.x.shape
    center = tuple(int(i) for i in torch.unravel_index(p.x.abs().argmax(), shape))
    found = _shared_with(p, y, center)
    if not found[0]:
        return found
    axis = len(shape) - 1 if found[0] == "channels-last" else 1
    n = shape[axis]
    for i in sorted({round(k * (n - 1) / (_CENTERS - 1)) for k in range(_CENTERS)}):
        other = (*center[:axis], i, *center[axis + 1 :])
        if other != center and _shared_with(p, y, other) != found:
            return "", (), ()
    return found


def _shared_with(
    p: _Prober, y: torch.Tensor, center: tuple[int, ...]
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The layout, dims and varying input dims of the elements that move with ``center``."""
    x = p.x.clone()
    shape = x.shape
    x[center] = x[center] + 5.0 * p.size
    moved = ((p(x) - y).abs() > 1e-6 * y.abs().max().clamp_min(1e-30)).nonzero()
    varying = {d for d in range(len(shape)) if (moved[:, d] != center[d]).any()}
    layout, dims = _classify(shape, moved, varying)
    if layout == "channels-last":  # the whole row: each element moves, or is 0 (an RMSNorm's)
        covered = p.x[center[:-1]] == 0
        covered[moved[:, -1]] = True
        if not covered.all():
            return "", (), tuple(sorted(varying))
    return layout, dims, tuple(sorted(varying))


def _classify(
    shape: torch.Size, moved: torch.Tensor, varying: set[int]
) -> tuple[str, tuple[int, ...]]:
    nd = len(shape)
    if not varying:
        return "", ()
    if 0 in varying and nd >= 2:  # statistics across samples: per channel, or no known norm
        return ("batch", (shape[1],)) if 1 not in varying else ("", ())
    if varying == {nd - 1}:
        return "channels-last", (shape[-1],)
    if nd >= 3 and varying == {1}:
        return "channels-first", (shape[1],)
    if nd >= 3 and 1 not in varying:
        return "spatial", (shape[1],)
    if nd >= 3 and 1 in varying:
        channels = int(torch.unique(moved[:, 1]).numel())
        if channels == shape[1] and varying == set(range(1, nd)):
            return "channels-first", tuple(shape[1:])
        return "groups", (shape[1] // channels, shape[1])
    return "", ()


def _eps_placement(p: _Prober, eps: float | None) -> EpsPlacement:
    """Compare sqrt(ms + eps) with sqrt(ms) + eps on inputs whose mean square equals eps.

    With every element +-c, any statistic group has mean square c^2. The odd part of the output
    ``f(c s) - f(-c s)`` drops any bias; its size at c^2 = eps against c >> sqrt(eps) is 1/sqrt(2)
    when eps is inside the root and about 1 when it is outside.
    """
    if eps is None or eps <= 0:
        return "unknown"
    gen = torch.Generator(device="cpu").manual_seed(1)
    signs = (torch.randint(0, 2, p.x.shape, generator=gen) * 2 - 1).to(p.x)
    small, large = math.sqrt(eps), 1e3 * math.sqrt(eps)

    def odd(c: float) -> float:
        return float((p(signs * c) - p(-signs * c)).abs().mean())

    ratio = odd(small) / max(odd(large), 1e-30)
    if abs(ratio - 2**-0.5) < 0.05:
        return "inside-sqrt"
    if ratio > 0.9:
        return "outside-sqrt"
    return "unknown"
