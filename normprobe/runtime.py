"""The probe runtime: hooks at the places discovery found, a logging schedule, and statistics
kept on the device until one transfer per logged step.

On a step that is not logged every hook returns at once: no statistic is computed, no tensor is
kept, nothing is read back. On a logged step, hooks reduce what they see to float32 scalars on
the device; after the optimizer step those are concatenated and copied to the host in one go.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils.hooks import RemovableHandle

from . import probes
from .discovery import Attention, DiscoveryWarning, ModelMap, NormLayer, discover
from .discovery.attention import LOGIT_MASK_OPS, LOGIT_OPS, LOGIT_SCALE_OPS
from .discovery.trace import (
    ADD_OPS,
    MATMUL_OPS,
    SDPA_OPS,
    SOFTMAX_OPS,
    get_by_key,
    iter_tensors,
)
from .sinks import Chart, Record, Sink, TensorBoardSink, chart_regex

METRICS: dict[str, str] = {
    "resid_rms": "RMS of the residual stream after each block (the output of the block's last "
    "residual add, or of the norm right after it in Post-LN); per stack also its growth "
    "(last block / first) and the slope of log RMS against log depth (0.5 for sqrt(l) growth)",
    "resid_cos": "cosine similarity of consecutive blocks' residual streams along the feature "
    "axis, averaged over positions; near 1 when blocks stop changing the representation",
    "norm_rms": "RMS of each norm layer's input and output",
    "norm_gain": "mean and std of each norm layer's effective gain (1 + weight for Gemma's norms)",
    "grad_norm": "L2 norm of each block's parameter gradients just before the optimizer step "
    "(after accumulation and AMP unscaling); per stack also the top/bottom ratio "
    "(last block / first block)",
    "update_ratio": "||new - old|| / ||old|| of each block's parameters across the optimizer "
    "step (exact up to 4096 entries per tensor; beyond, from an evenly strided sample of 0.5% "
    "of the entries, so the copy it needs stays small)",
    "logits": "the output head's logits: max |logit|, RMS and mean log-sum-exp (z)",
    "attn_logits": "per attention module, max |q.k| * scale as the model forms it from q and k "
    "(soft-capping included, additive masks and biases left out), also when attention is fused "
    "(scaled_dot_product_attention) or an nn.MultiheadAttention",
    "bn_stats": "per BatchNorm: how far the batch's mean and variance are from the running ones "
    "(normalized), and the train-vs-eval output gap on the logged batch",
    "nonfinite": "number of modules whose output holds NaN or Inf, and the first of them in "
    "execution order (warned once)",
}
PREFIX = "normprobe"
# the custom-scalars dashboard shows the families in this order, most telling first
_FAMILY_ORDER = (
    "resid_rms", "resid_growth", "resid_slope", "grad_norm", "grad_ratio", "resid_cos",
    "attn_logit_max", "logits", "update_ratio", "norm_in_rms", "norm_out_rms",
    "norm_gain_mean", "norm_gain_std", "bn_mean_drift", "bn_var_drift", "bn_gap", "nonfinite",
)  # fmt: skip
UPDATE_SAMPLE_FRACTION = 0.005
UPDATE_SAMPLE_MIN = 4096


def _sample_budget(numel: int) -> int:
    return max(UPDATE_SAMPLE_MIN, int(numel * UPDATE_SAMPLE_FRACTION))


def _check_metrics(metrics: Iterable[str] | None) -> tuple[str, ...]:
    if metrics is None:
        return tuple(METRICS)
    if isinstance(metrics, str):
        metrics = [metrics]
    chosen = tuple(metrics)
    unknown = [m for m in chosen if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {sorted(METRICS)}")
    return chosen


def tagged_blocks(depth: int, cap: int) -> list[int]:
    """Blocks that get their own scalar tags: all up to ``cap``, else ``cap`` spread evenly."""
    if depth <= cap:
        return list(range(depth))
    return sorted({round(i * (depth - 1) / (cap - 1)) for i in range(cap)})


def tagged_paths(paths: Iterable[str], cap: int) -> set[str]:
    """Module paths that get their own scalar tags, at most ``cap`` per group of paths that
    differ only in their indices (``blocks.{0..999}.ln_1``), spread evenly like blocks."""
    groups: dict[tuple[str, ...], list[tuple[tuple[int, ...], str]]] = {}
    for path in paths:
        parts = path.split(".")
        template = tuple("#" if part.isdigit() else part for part in parts)
        index = tuple(int(part) for part in parts if part.isdigit())
        groups.setdefault(template, []).append((index, path))
    kept: set[str] = set()
    for members in groups.values():
        members.sort()
        kept.update(members[i][1] for i in tagged_blocks(len(members), cap))
    return kept


class _InertHook:
    """What a probe's hook becomes in a copy of the model: does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Hook:
    """A probe callback registered on a module or optimizer.

    Pickling, deep-copying or ``torch.save``-ing the model turns it into an `_InertHook`: a
    copy of a probed model does not carry the probe (or its event writer) along.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _InertHook, ()


Key = tuple[str | int, ...]


@dataclass(frozen=True)
class _Slot:
    """Where one statistic lives in the step's packed vector, and how ranks combine it."""

    offset: int
    size: int
    reduce: str  # "mean" | "rms" | "max" | "min" | "sum"


@dataclass
class _Read:
    """Read one tensor at a module boundary on a given call and hand it to ``action``."""

    call: int
    key: tuple[str | int, ...] | None  # None: the first floating-point tensor
    action: Callable[[torch.Tensor], None]


@dataclass
class _StreamRead:
    """One block's residual stream on a logged forward, reduced to its per-position norms
    (and for cosines, its dot products with the previous block's stream)."""

    block: int
    numel: int
    norms: torch.Tensor
    dots: torch.Tensor | None = None
    prev_norms: torch.Tensor | None = None


@dataclass(frozen=True)
class _DeviceConsts:
    """What the batched reductions index with, made once per device."""

    param_block: torch.Tensor  # int64: the block of each parameter
    strides: torch.Tensor  # float32: each parameter's update-sample stride
    order: torch.Tensor  # float32: 0, 1, 2, ... over the model's modules
    zero: torch.Tensor  # stands in for a missing gradient


@dataclass(frozen=True)
class _GainGroup:
    """Norms whose weights share shape, dtype, device and gain offset: reduced in one go."""

    modules: list[nn.Module]
    positions: list[int]  # their (mean, std) slot positions, in order
    offset: float


@dataclass
class _Sites:
    pre: list[_Read] = field(default_factory=list)
    post: list[_Read] = field(default_factory=list)
    inside: dict[int, dict[int, Callable[[torch.Tensor], None]]] = field(default_factory=dict)
    attention: Callable[[torch.Tensor], None] | None = None
    batchnorm: Callable[[torch.Tensor], None] | None = None


class _AddCounter(TorchFunctionMode):
    """Active inside one module call on logged steps: reads the n-th tensor add it sees."""

    def __init__(self, targets: dict[int, Callable[[torch.Tensor], None]]) -> None:
        super().__init__()
        self.targets = targets
        self.count = 0

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if (
            name in ADD_OPS
            and len(args) >= 2
            and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.Tensor)
        ):
            action = self.targets.get(self.count)
            if action is not None and isinstance(out, torch.Tensor):
                action(out)
            self.count += 1
        return out


# (the q·k product or what it became, its max |logit| once a mask or bias met it, the constant
# factor applied since)
_Logits = tuple["weakref.ref[torch.Tensor]", torch.Tensor | None, torch.Tensor | float]
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class _AttentionLogits(TorchFunctionMode):
    """Active inside one attention module on logged steps: max |logit| as the module forms its
    logits from q and k, additive masks and biases left out.

    Eager attention: each product of a matmul of two tensors is followed through `LOGIT_OPS`;
    its max |.| is taken where a mask or bias first meets it (at the softmax if none does),
    times the constant factors applied after that, and read when a softmax takes it. Fused
    attention: from q and k (`probes.sdpa_logit_max`); ``nn.MultiheadAttention``: from its
    input and in-projection weights (`probes.mha_logit_max`).
    """

    def __init__(self, action: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.action = action
        self.logits: dict[int, _Logits] = {}  # by id of the tensor

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SDPA_OPS and len(args) >= 2:
            self.action(
                probes.sdpa_logit_max(
                    args[0],
                    args[1],
                    attn_mask=kwargs.get("attn_mask", args[3] if len(args) > 3 else None),
                    is_causal=bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False)),
                    scale=kwargs.get("scale", args[6] if len(args) > 6 else None),
                )
            )
        elif name == "multi_head_attention_forward":
            self.action(_mha_logit_max(args, kwargs))
        found = self._find(args, kwargs) if self.logits else None
        best: torch.Tensor | None = None
        factor: torch.Tensor | float = 1.0
        if found is not None:
            t, best, factor = found
            if best is None and (name in SOFTMAX_OPS or name in LOGIT_MASK_OPS):
                best = probes.abs_max(t)  # before the op: an in-place mask overwrites t
            if best is not None and name in SOFTMAX_OPS:
                self.action(best * factor)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if name in MATMUL_OPS:
            operands = [t for _, t in iter_tensors(args) if not isinstance(t, nn.Parameter)]
            if len(operands) >= 2:
                self.logits[id(out)] = (weakref.ref(out), None, 1.0)
        elif found is not None and name in LOGIT_OPS:
            if best is not None and name in LOGIT_SCALE_OPS:
                factor = _scaled(factor, name, args, found[0])
            self.logits[id(out)] = (weakref.ref(out), best, factor)
        elif found is not None and out is found[0]:  # changed in place into something else
            del self.logits[id(out)]
        return out

    def _find(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | float] | None:
        """The first argument on its way from a q·k product, with its state."""
        for _, t in iter_tensors((args, kwargs)):
            entry = self.logits.get(id(t))
            if entry is not None and entry[0]() is t:
                return t, entry[1], entry[2]
        return None


def _scaled(
    factor: torch.Tensor | float, name: str, args: Sequence[Any], logits: torch.Tensor
) -> torch.Tensor | float:
    """``factor`` times |c| for ``logits * c`` (divided for ``logits / c``), c a number or a
    one-element tensor; unchanged for other operands."""
    others = [a for a in args if a is not logits]
    if len(others) != 1:
        return factor
    c = others[0]
    if isinstance(c, torch.Tensor) and c.numel() == 1:
        c = c.detach().float().abs().reshape(())  # stays on the device: no host sync
    elif isinstance(c, int | float) and not isinstance(c, bool):
        c = abs(c)
    else:
        return factor
    return factor / c if name.startswith(("div", "__truediv__", "__itruediv__")) else factor * c


def _mha_logit_max(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """`probes.mha_logit_max` from the arguments of ``F.multi_head_attention_forward``."""
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    e = a["query"].shape[-1]
    if a["use_separate_proj_weight"]:
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = a["in_proj_weight"][:e], a["in_proj_weight"][e : 2 * e]
    b = a["in_proj_bias"]
    b_q, b_k = (None, None) if b is None else (b[:e], b[e : 2 * e])
    return probes.mha_logit_max(
        a["query"], a["key"], a["num_heads"], w_q, b_q, w_k, b_k, a["bias_k"], a["static_k"]
    )


class Probe:
    """Hooks on one model that log normalization, residual and gradient statistics.

    Create it with `attach`. Steps advance with the optimizer's step (or `step` without an
    optimizer); step 0 and every step with ``step % every == phase`` are logged. Between logged
    steps only the root module carries a hook; the reading hooks are registered when a logged
    forward starts and removed when it ends. With ``persistent_hooks`` they stay registered
    and return at once on other steps (what a compiled model needs: no hook added later).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        sinks: Sequence[Sink] = (),
        every: int = 50,
        metrics: Iterable[str] | None = None,
        max_block_tags: int = 64,
        start_step: int = 0,
        persistent_hooks: bool = False,
        param_reduce: str = "mean",
        phase: int = 0,
        name_prefix: str = "",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__qualname__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be a positive integer number of steps, got {every!r}")
        if max_block_tags < 2:
            raise ValueError(f"`max_block_tags` must be at least 2, got {max_block_tags}")
        if _attached_probe(model) is not None:
            raise RuntimeError(
                f"a normprobe probe is already attached to this {type(model).__name__}; call "
                "probe.remove() on it first (or keep using it: one probe logs every metric)"
            )
        self.model = model
        self.optimizer = optimizer
        self.sinks = list(sinks)
        self.every = every
        self.metrics = _check_metrics(metrics)
        self.max_block_tags = max_block_tags
        self.step_count = start_step
        self.phase = phase % every
        self.name_prefix = name_prefix
        self.model_map: ModelMap | None = None
        self._norms: list[NormLayer] = []  # the norms and attention modules read (tagged_paths)
        self._attention: list[Attention] = []
        self.latest: Record | None = None
        self._handles: list[RemovableHandle] = []
        self._logged = self._is_logged(start_step)
        self._recording = False
        # what the current logged step measured, on the device: whole slots by key, and
        # pieces of slots at given positions of the packed vector
        self._pending: dict[Key, torch.Tensor] = {}
        self._parts: list[tuple[Sequence[int], torch.Tensor]] = []
        self._streams: dict[str, list[_StreamRead]] = {}
        self._finite: list[torch.Tensor] = []  # float32 sums of module outputs, in order
        self._finite_modules: list[int] = []  # and whose they are (indices into _module_paths)
        self._slots: dict[Key, _Slot] = {}
        self._slots_size = 0  # the packed layout's length
        self._finite_seen: set[int] = set()
        self._device_cache: dict[torch.device, _DeviceConsts] = {}
        self._positions_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self._reduce_cache: tuple[torch.device, dict[str, torch.Tensor]] | None = None
        self._validating = False
        self.paused = False
        self.param_reduce = param_reduce
        self._calls: dict[str, int] = {}
        self._modes: dict[str, list[TorchFunctionMode]] = {}
        self._prev_stream: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._update_before: list[torch.Tensor] = []
        self._layout_written = False
        self._warned_nonfinite = False
        self._removed = False
        self._step_depth = 0  # optimizer step hooks entered, not yet left (_before_optimizer)
        self._tags: dict[str, str] = {}
        self.persistent_hooks = persistent_hooks
        self._plan: list[Callable[[], RemovableHandle]] = []
        self._armed: list[RemovableHandle] = []
        self._handles.append(model.register_forward_pre_hook(_Hook(self._root_pre)))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(_Hook(self._before_optimizer)))
            self._handles.append(optimizer.register_step_post_hook(_Hook(self._after_optimizer)))

    # set-up ----------------------------------------------------------------------------------
    def discover_now(self, *args: Any, **kwargs: Any) -> None:
        """Map the model on these inputs and install the hooks."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DiscoveryWarning)  # one summary warning instead
            model_map = discover(self.model, *args, **kwargs)
        self._install(model_map)

    def discover_lazily(self) -> None:
        """Map the model on its first real forward, then record that forward already."""

        def first(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._discovery_hook.remove()
            self.discover_now(*args, **kwargs)
            self._begin_forward()

        self._discovery_hook = self.model.register_forward_pre_hook(
            _Hook(first), with_kwargs=True, prepend=True
        )
        self._handles.append(self._discovery_hook)

    def _install(self, model_map: ModelMap) -> None:
        self.model_map = model_map
        modules = dict(self.model.named_modules(remove_duplicate=False))
        # norm and attention statistics of deep models: scalar tags for at most
        # max_block_tags layers of each kind (blocks.*.ln_1), the rest is not read
        kept = tagged_paths([n.path for n in model_map.norms], self.max_block_tags)
        self._norms = [n for n in model_map.norms if n.path in kept]
        kept = tagged_paths([a.path for a in model_map.attention], self.max_block_tags)
        self._attention = [a for a in model_map.attention if a.path in kept]
        self._tags = self._module_tags(model_map, modules)
        self._module_paths = [path for path, _ in self.model.named_modules()]
        # every block's parameters in one list, each with its block's index over all stacks
        self._params: list[nn.Parameter] = []
        self._param_block: list[int] = []
        self._stack_blocks: dict[str, slice] = {}  # each stack's blocks in that numbering
        self._blocks = 0
        # a repeated block (one module run N times) has one set of weights: no per-block value
        for s in (s for s in model_map.stacks if not s.repeated):
            for block in s.blocks:
                params = list(modules[block].parameters())
                self._params += params
                self._param_block += [self._blocks] * len(params)
                self._blocks += 1
            self._stack_blocks[s.path] = slice(self._blocks - len(s.blocks), self._blocks)
        # update ratios compare parameters across the step: keep a copy of at most
        # UPDATE_SAMPLE_FRACTION of each (and at least UPDATE_SAMPLE_MIN entries)
        self._strides = [
            probes.sample_stride(p.shape, _sample_budget(p.numel())) for p in self._params
        ]
        sites: dict[str, _Sites] = {}

        def at(path: str) -> _Sites:
            return sites.setdefault(path, _Sites())

        streamed = {}
        if {"resid_rms", "resid_cos"} & set(self.metrics):
            streamed = self._plan_streams(model_map, at)
        if self.param_reduce == "mean" and probes.is_sharded(self.model):
            self.param_reduce = "sum"  # FSDP: each rank holds a shard of the parameters
        self._layout_slots(model_map, streamed)
        self._gain_groups = self._group_gains(modules)
        if "norm_rms" in self.metrics:
            for n in self._norms:
                at(n.path).pre.append(_Read(0, None, self._setter(("norm_in_rms", n.path))))
                at(n.path).post.append(_Read(0, None, self._setter(("norm_out_rms", n.path))))
        if "logits" in self.metrics and model_map.head is not None:
            at(model_map.head).post.append(_Read(0, None, self._logits))
        if "attn_logits" in self.metrics:
            for a in self._attention:
                at(a.path).attention = self._attention_reader(a.path)
        if "bn_stats" in self.metrics:
            for n in self._norms:
                m = modules[n.path]
                if isinstance(m, _BatchNorm) and m.running_mean is not None:
                    at(n.path).batchnorm = self._batchnorm_reader(n.path, m)
        if self.persistent_hooks:
            # torch function modes would break a compiled graph: no attention logits, and no
            # residual read from inside a forward, on compiled models
            for site in sites.values():
                site.attention, site.inside = None, {}
        plan = [
            thunk
            for path, site in sites.items()
            for thunk in self._hooks(modules[path], site, path)
        ]
        if "nonfinite" in self.metrics:
            for index, m in enumerate(self.model.modules()):
                plan.append(partial(m.register_forward_hook, _Hook(self._finite_reader(index))))
        # last, so that it runs after every read of the root's own output
        root_post = _Hook(self._root_post)
        plan.append(partial(self.model.register_forward_hook, root_post, always_call=True))
        self._plan = plan
        if self.persistent_hooks or self._logged:
            self._arm()
        self._warn_missing(model_map)

    def _group_gains(self, modules: dict[str, nn.Module]) -> list[_GainGroup]:
        groups: dict[tuple[Any, ...], _GainGroup] = {}
        for n in self._norms:
            slot = self._slots.get(("gain", n.path))
            if slot is None:
                continue
            w = getattr(modules[n.path], "weight", None)
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                continue
            offset = float(n.gain_offset or 0)
            group = groups.setdefault(
                (w.numel(), w.dtype, w.device, offset), _GainGroup([], [], offset)
            )
            group.modules.append(modules[n.path])
            group.positions.extend(range(slot.offset, slot.offset + slot.size))
        return list(groups.values())

    def _plan_streams(
        self, model_map: ModelMap, at: Callable[[str], _Sites]
    ) -> dict[str, list[int]]:
        """One read per block: the stream its last residual add leaves (after a Post-LN norm).

        Returns the blocks read, per stack.
        """
        streamed: dict[str, list[int]] = {}
        for stack in model_map.stacks:
            last = {a.block: a for a in model_map.adds_in(stack.path) if a.block is not None}
            for block, add in sorted(last.items()):
                action = self._stream_reader(stack.path, block)
                streamed.setdefault(stack.path, []).append(block)
                if add.post_norm is not None:
                    at(add.post_norm).post.append(_Read(0, None, action))
                elif add.anchor is None:
                    continue
                elif add.anchor.hook == "inside":
                    targets = at(add.anchor.module).inside.setdefault(add.anchor.call, {})
                    targets[int(add.anchor.key[0])] = action
                else:
                    read = _Read(add.anchor.call, add.anchor.key, action)
                    site = at(add.anchor.module)
                    (site.pre if add.anchor.hook == "pre" else site.post).append(read)
        return streamed

    def _hooks(
        self, module: nn.Module, site: _Sites, path: str
    ) -> list[Callable[[], RemovableHandle]]:
        """The registrations that read ``site`` on ``module`` (run when the probe arms)."""

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._recording:
                return
            call = self._calls[path] = self._calls.get(path, -1) + 1
            for read in site.pre:
                if read.call == call:
                    self._read(read, (args, kwargs))
            if site.batchnorm is not None and call == 0:
                x = _first_float((args, kwargs))
                if x is not None:
                    site.batchnorm(x)
            modes: list[TorchFunctionMode] = []
            if site.inside.get(call):
                modes.append(_AddCounter(site.inside[call]))
            if site.attention is not None:
                modes.append(_AttentionLogits(site.attention))
            for mode in modes:
                mode.__enter__()  # type: ignore[no-untyped-call]
            if modes:
                self._modes[path] = modes

        def post(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            for mode in reversed(self._modes.pop(path, [])):
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            if not self._recording:
                return
            call = self._calls.get(path, 0)
            for read in site.post:
                if read.call == call:
                    self._read(read, out)

        return [
            partial(module.register_forward_pre_hook, _Hook(pre), with_kwargs=True),
            partial(module.register_forward_hook, _Hook(post), with_kwargs=True, always_call=True),
        ]

    @staticmethod
    def _read(read: _Read, container: Any) -> None:
        t = _first_float(container) if read.key is None else get_by_key(container, read.key)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            read.action(t)

    # readers (run on logged steps only) ---------------------------------------------------
    def _setter(self, key: Key) -> Callable[[torch.Tensor], None]:
        def set_rms(t: torch.Tensor) -> None:
            self._pending[key] = probes.rms(t)

        return set_rms

    def _stream_reader(self, stack: str, block: int) -> Callable[[torch.Tensor], None]:
        """Reduce the stream to per-position norms (and dot products with the previous one);
        `_finish_streams` turns a forward's worth of them into statistics at once."""
        cosines = "resid_cos" in self.metrics

        def read(t: torch.Tensor) -> None:
            t = t.detach()
            here = _StreamRead(block, t.numel(), probes.row_norms(t))
            self._streams.setdefault(stack, []).append(here)
            if not cosines:
                return
            prev = self._prev_stream.get(stack)
            if prev is not None and prev[0] == block - 1 and prev[1].shape == t.shape:
                here.dots, here.prev_norms = probes.row_dots(prev[1], t), prev[2]
            self._prev_stream[stack] = (block, t, here.norms)

        return read

    def _finish_streams(self) -> None:
        """The logged forward's stream statistics, a few batched operations per stack."""
        for stack, reads in self._streams.items():
            rms_slot = self._slots.get(("resid_rms", stack))
            if rms_slot is not None and reads:
                self._parts.append(([rms_slot.offset + r.block for r in reads], _stream_rms(reads)))
            cos_slot = self._slots.get(("resid_cos", stack))
            pairs = [r for r in reads if r.dots is not None]
            if cos_slot is not None and pairs:
                rows = [[r.dots, r.prev_norms, r.norms] for r in pairs]
                cos = _rowwise(probes.cosines_from_rows, rows)  # type: ignore[arg-type]
                self._parts.append(([cos_slot.offset + r.block for r in pairs], cos))

    def _logits(self, t: torch.Tensor) -> None:
        max_abs, rms, z = probes.logit_stats(t)
        self._pending.update({("logits_max",): max_abs, ("logits_rms",): rms, ("logits_z",): z})

    def _attention_reader(self, path: str) -> Callable[[torch.Tensor], None]:
        key = ("attn_logit_max", path)

        def read(value: torch.Tensor) -> None:
            old = self._pending.get(key)
            self._pending[key] = value if old is None else torch.maximum(old, value)

        return read

    def _batchnorm_reader(self, path: str, m: _BatchNorm) -> Callable[[torch.Tensor], None]:
        def read(x: torch.Tensor) -> None:
            assert m.running_mean is not None and m.running_var is not None
            self._pending[("bn", path)] = probes.batchnorm_stats(
                x, m.running_mean, m.running_var, m.weight, m.bias, m.eps
            )

        return read

    def _finite_reader(self, index: int) -> Callable[..., None]:
        """Keeps the sum of the module's output on its first call (NaN/Inf if it holds one);
        `_finish_finite` turns the forward's sums into execution positions at once."""

        def read(mod: nn.Module, args: Any, out: Any) -> None:
            if not self._recording or index in self._finite_seen:
                return
            if isinstance(out, torch.Tensor):
                if not out.is_floating_point():
                    return
                total = probes.finite_sum(out)
            else:
                sums = [probes.finite_sum(t) for _, t in iter_tensors(out) if t.is_floating_point()]
                if not sums:
                    return
                total = torch.stack(sums).sum() if len(sums) > 1 else sums[0]
            self._finite_seen.add(index)
            self._finite.append(total)
            self._finite_modules.append(index)

        return read

    def _finish_finite(self) -> None:
        """Per module: its position in execution order if its output was not finite, else inf
        (ranks keep the minimum)."""
        slot = self._slots.get(("nonfinite",))
        if slot is not None and self._finite:
            sums = torch.stack(self._finite)
            order = self._consts(sums.device).order[: len(sums)]
            position = torch.where(torch.isfinite(sums), math.inf, order)
            self._parts.append(([slot.offset + i for i in self._finite_modules], position))

    # the schedule ------------------------------------------------------------------------------
    def _is_logged(self, step: int) -> bool:
        return step == 0 or step % self.every == self.phase

    def _root_pre(self, *_: Any) -> None:
        # no forward runs inside an optimizer step's hooks but a closure's (LBFGS): a count
        # left by a step that raised must not swallow the next step
        self._step_depth = 0
        self._begin_forward()

    def _begin_forward(self) -> None:
        if self._recording and not self.persistent_hooks:
            # the last recorded forward never reached its end (a KeyboardInterrupt skips even
            # always_call hooks): drop what it measured and the modes it left entered
            self._clear_measured()
            self._exit_modes()
        if self.persistent_hooks:
            # Compiled models: every forward runs the same hooks on the same Python state, so
            # the graph never changes; only the logged steps' values are read back.
            self._recording = self.model_map is not None and not self._removed
            self._clear_measured()
        else:
            wanted = self._validating or (self._logged and not self.paused)
            self._recording = wanted and not self._removed and self.model_map is not None
        if self._recording:  # of several forwards in a step (accumulation), the last counts
            self._calls.clear()
            self._prev_stream.clear()
            self._clear_forward_reads()
            if not self.persistent_hooks:
                self._arm()

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._validating = False
        self._prev_stream.clear()
        if out is None and sys.exc_info()[0] is not None and not self.persistent_hooks:
            # the forward raised (torch runs always_call hooks with no output): what it
            # measured must not mix with a retried forward's; what earlier steps logged is
            # put on disk, in case this ends the training
            self._clear_measured()
            if self._is_writer():
                for sink in self.sinks:
                    sink.flush()
        if not self.persistent_hooks:
            self._recording = False
            self._exit_modes()
            if self.every > 1:  # logging every step: keep the hooks for the next one
                self._disarm()

    def _clear_measured(self) -> None:
        self._pending.clear()
        self._parts.clear()
        self._clear_forward_reads()

    def _clear_forward_reads(self) -> None:
        # cleared in place: a compiled graph's guards see the same objects at every forward
        self._streams.clear()
        self._finite.clear()
        self._finite_modules.clear()
        self._finite_seen.clear()

    def _arm(self) -> None:
        """Register the reading hooks (once; a no-op while armed)."""
        if not self._armed:
            self._armed = [register() for register in self._plan]

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed = []

    # An optimizer subclass whose step() calls super().step() runs the step hooks twice, nested
    # (torch wraps every class's step): only the outermost pair is one training step.
    def _before_optimizer(self, *_: Any) -> None:
        self._step_depth += 1
        if self._step_depth == 1:
            self.before_optimizer_step()

    def _after_optimizer(self, *_: Any) -> None:
        self._step_depth = max(self._step_depth - 1, 0)
        if self._step_depth == 0:
            self.end_step()
            self._advance()

    def begin_step(self, step: int) -> None:
        """Start training step ``step`` (for drivers that count steps themselves).

        A logged step gets its hooks now, before its forward starts: a hook added to the root
        module while the root's own hooks run would miss that call.
        """
        self.step_count = step
        self._logged = self._is_logged(step)
        if self._logged and self.model_map is not None and not self._removed:
            self._arm()

    def before_optimizer_step(self) -> None:
        """Read gradients and gains, and keep what the update ratio compares against."""
        if not self._logged or self.model_map is None:
            return
        self._record_parameters()
        if "update_ratio" in self.metrics and self._params:
            with torch.no_grad():
                self._update_before = probes.strided_samples(self._params, self._strides)

    def end_step(self) -> None:
        """After the optimizer step: measure the update and write the step (if logged)."""
        if not self._logged or self.model_map is None:
            return
        if self._update_before:
            consts = self._consts(self._update_before[0].device)
            with torch.no_grad():
                change, old = probes.update_squares(
                    self._params,
                    self._strides,
                    self._update_before,
                    consts.strides,
                    consts.param_block,
                    self._blocks,
                )
            for s, blocks in self._stack_blocks.items():
                self._pending[("update_sq", s)] = change[blocks]
                self._pending[("weight_sq", s)] = old[blocks]
            self._update_before = []
        self.flush()

    def validate_next_forward(self) -> None:
        """Record BatchNorm statistics on the next forward; `flush_validation` writes them."""
        self._validating = True
        if self.model_map is not None and not self._removed:
            self._arm()

    def flush_validation(self) -> None:
        """Write what the validation forward measured, as ``normprobe/val_bn_*`` tags."""
        bn = {k: v for k, v in self._pending.items() if k[0] == "bn"}
        self._clear_measured()
        self._pending.update(bn)
        self.flush(validation=True)

    def _record_parameters(self) -> None:
        """Gradients and gains as they are before the optimizer step."""
        if "grad_norm" in self.metrics and self._params:
            consts = self._consts(self._params[0].device)
            grads = [consts.zero if p.grad is None else p.grad for p in self._params]
            with torch.no_grad():
                squares = probes.group_sums(
                    probes.squared_norms(grads), consts.param_block, self._blocks
                )
            for s, blocks in self._stack_blocks.items():
                self._pending[("grad_sq", s)] = squares[blocks]
        if "norm_gain" in self.metrics:
            with torch.no_grad():
                for group in self._gain_groups:
                    if self.param_reduce == "sum":  # shards of any size: sums, over ranks too
                        gains = [_weight(m) for m in group.modules]
                        stats = torch.stack([probes.gain_moments(w, group.offset) for w in gains])
                    else:
                        weights = torch.stack([_weight(m).reshape(-1) for m in group.modules])
                        stats = probes.gain_stats(weights, group.offset)
                    self._parts.append((group.positions, stats.reshape(-1)))

    def _advance(self) -> None:
        self.begin_step(self.step_count + 1)

    def step(self) -> None:
        """End a step by hand (training without an optimizer passed to `attach`).

        On a logged step, reads the gradients present now and writes the step's statistics.
        """
        if self.optimizer is not None:
            raise RuntimeError(
                "this probe advances with its optimizer's step(); don't call probe.step() too"
            )
        if self._logged and self.model_map is not None:
            self._record_parameters()
            self.flush()
        self._advance()

    # writing -------------------------------------------------------------------------------------
    def flush(self, validation: bool = False) -> None:
        """Copy the step's statistics to the host (one transfer) and hand them to the sinks.

        Under ``torch.distributed`` every rank must call it on the same steps: the ranks' values
        are combined with one collective (mean of squares for RMS, max of maxima, ...), and
        only global rank zero writes.
        """
        if self.model_map is None:
            return
        self._finish_streams()
        self._finish_finite()
        positions, packed = self._pack()
        total = self._slots_size
        if _world_size() > 1:
            combined = self._combine_ranks(positions, packed, total).tolist()  # the one transfer
            values, present = combined[:total], combined[total:]
        elif positions:
            values, present = [0.0] * total, [0.0] * total
            for position, value in zip(positions, packed.tolist(), strict=True):  # one transfer
                values[position], present[position] = value, 1.0
        else:
            self._clear_measured()
            return
        record = self._record(values, present, validation)
        self._clear_measured()
        if not validation:
            self.latest = record
        if self._is_writer():
            if not self._layout_written:
                charts = self._charts(record)
                for sink in self.sinks:
                    sink.layout(charts)
            for sink in self.sinks:
                sink.write(record)
        self._layout_written = True

    def _pack(self) -> tuple[list[int], torch.Tensor]:
        """What the step measured as one float32 vector on the device, and the position of
        each of its values in the slot layout."""
        device = self._device()
        scalar_positions: list[int] = []
        scalars: list[torch.Tensor] = []
        positions: list[int] = []
        vectors: list[torch.Tensor] = []
        for key, value in self._pending.items():
            slot = self._slots[key]
            if value.dim() == 0:
                scalar_positions.append(slot.offset)
                scalars.append(value)
            else:
                positions += range(slot.offset, slot.offset + slot.size)
                vectors.append(value.reshape(-1))
        for where, value in self._parts:
            positions += where
            vectors.append(value)
        pieces = ([torch.stack(_moved(scalars, device))] if scalars else []) + vectors
        if not pieces:
            return [], torch.zeros(0, device=device)
        return scalar_positions + positions, torch.cat(_moved(pieces, device)).float()

    def _combine_ranks(
        self, positions: list[int], packed: torch.Tensor, total: int
    ) -> torch.Tensor:
        """Every rank's values in the full slot layout, each followed by a presence flag per
        value (so that a measured NaN stays a NaN), combined across ranks in one collective."""
        import torch.distributed as dist

        index = self._position_index(positions, packed.device)
        full = torch.cat(
            [
                packed.new_zeros(total).index_copy_(0, index, packed),
                packed.new_zeros(total).index_fill_(0, index, 1.0),
            ]
        )
        gathered = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, full)  # the one collective of a logged step
        ranks = torch.stack(gathered)
        values, present = ranks[:, :total], ranks[:, total:] > 0.5
        count = present.sum(dim=0)
        kept = torch.where(present, values, torch.zeros((), device=values.device))
        mean_of = count.clamp_min(1)
        combined = {
            "mean": kept.sum(dim=0) / mean_of,
            "rms": (kept.pow(2).sum(dim=0) / mean_of).sqrt(),
            "sum": kept.sum(dim=0),
            "max": values.masked_fill(~present, -math.inf).amax(dim=0),
            "min": values.masked_fill(~present, math.inf).amin(dim=0),
        }
        out = torch.zeros(total, device=values.device)
        for kind, where in self._reduce_index(packed.device).items():
            out[where] = combined[kind][where]
        return torch.cat([out, (count > 0).float()])

    def _position_index(self, positions: list[int], device: torch.device) -> torch.Tensor:
        """``positions`` as an index tensor, reused while a step measures what the last did."""
        key = (device, tuple(positions))
        if self._positions_cache is None or self._positions_cache[0] != key:
            index = torch.tensor(positions, dtype=torch.long, device=device)
            self._positions_cache = (key, index)
        return self._positions_cache[1]

    def _reduce_index(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._reduce_cache is None or self._reduce_cache[0] != device:
            positions: dict[str, list[int]] = {}
            for slot in self._slots.values():
                positions.setdefault(slot.reduce, []).extend(
                    range(slot.offset, slot.offset + slot.size)
                )
            index = {k: torch.tensor(v, device=device) for k, v in positions.items()}
            self._reduce_cache = (device, index)
        return self._reduce_cache[1]

    def _consts(self, device: torch.device) -> _DeviceConsts:
        consts = self._device_cache.get(device)
        if consts is None:
            consts = self._device_cache[device] = _DeviceConsts(
                param_block=torch.tensor(self._param_block, dtype=torch.long, device=device),
                strides=torch.tensor(self._strides, dtype=torch.float32, device=device),
                order=torch.arange(len(self._module_paths), dtype=torch.float32, device=device),
                zero=torch.zeros((), device=device),
            )
        return consts

    def _device(self) -> torch.device:
        for value in self._pending.values():
            return value.device
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _is_writer(self) -> bool:
        import torch.distributed as dist

        return _world_size() == 1 or dist.get_rank() == 0

    def _layout_slots(self, model_map: ModelMap, streamed: dict[str, list[int]]) -> None:
        """Fix each statistic's place in the packed vector, the same on every rank."""
        chosen = set(self.metrics)
        modules = dict(self.model.named_modules())
        entries: list[tuple[Key, int, str]] = []
        depth = {s.path: s.depth for s in model_map.stacks}
        for stack in streamed:  # a block's value is present if its stream was read
            if "resid_rms" in chosen:
                entries.append((("resid_rms", stack), depth[stack], "rms"))
            if "resid_cos" in chosen:
                entries.append((("resid_cos", stack), depth[stack], "mean"))
        for n in self._norms:
            if "norm_rms" in chosen:
                entries += [
                    (("norm_in_rms", n.path), 1, "rms"),
                    (("norm_out_rms", n.path), 1, "rms"),
                ]
            weight = getattr(modules.get(n.path), "weight", None)
            if "norm_gain" in chosen and isinstance(weight, torch.Tensor):
                sharded = self.param_reduce == "sum"  # summed probes.gain_moments
                entries.append((("gain", n.path), 3 if sharded else 2, self.param_reduce))
            m = modules.get(n.path)
            if "bn_stats" in chosen and isinstance(m, _BatchNorm) and m.running_mean is not None:
                entries.append((("bn", n.path), 3, "mean"))
        if "logits" in chosen and model_map.head is not None:
            entries += [(("logits_max",), 1, "max"), (("logits_rms",), 1, "rms")]
            entries.append((("logits_z",), 1, "mean"))
        if "attn_logits" in chosen:
            entries += [(("attn_logit_max", a.path), 1, "max") for a in self._attention]
        for s in (s for s in model_map.stacks if not s.repeated):
            if "grad_norm" in chosen:
                entries.append((("grad_sq", s.path), s.depth, self.param_reduce))
            if "update_ratio" in chosen:
                entries.append((("update_sq", s.path), s.depth, self.param_reduce))
                entries.append((("weight_sq", s.path), s.depth, self.param_reduce))
        if "nonfinite" in chosen:  # per module: its position in execution order, or inf
            entries.append((("nonfinite",), len(self._module_paths), "min"))
        offset = 0
        for key, size, reduce in entries:
            self._slots[key] = _Slot(offset, size, reduce)
            offset += size
        self._slots_size = offset

    def _record(
        self, values: list[float], present: list[float], validation: bool = False
    ) -> Record:
        assert self.model_map is not None
        record = Record(self.step_count)
        out = record.scalars
        per_block: dict[tuple[str, str], dict[int, float]] = {}
        bad: list[tuple[float, str]] = []
        for key, slot in self._slots.items():
            family = str(key[0])
            if validation and family != "bn":
                continue
            vals = values[slot.offset : slot.offset + slot.size]
            if family in ("resid_rms", "resid_cos", "nonfinite"):  # measured value by value
                seen = [i for i in range(slot.size) if present[slot.offset + i]]
                if family == "nonfinite":
                    paths = self._module_paths
                    bad += [(vals[i], paths[i]) for i in seen if vals[i] != math.inf]
                elif seen:
                    per_block[(family, str(key[1]))] = {b: vals[b] for b in seen}
                continue
            if not present[slot.offset]:  # not measured on this step
                continue
            if family == "grad_sq":
                per_block[("grad_norm", str(key[1]))] = {
                    b: math.sqrt(v) for b, v in enumerate(vals)
                }
            elif family == "update_sq":
                old = values[self._slots[("weight_sq", key[1])].offset :][: slot.size]
                per_block[("update_ratio", str(key[1]))] = {
                    b: math.sqrt(v / o)
                    for b, (v, o) in enumerate(zip(vals, old, strict=True))
                    if o > 0
                }
            elif family in ("norm_in_rms", "norm_out_rms", "attn_logit_max"):
                out[f"{PREFIX}/{family}/{self._norm_tag(str(key[1]))}"] = vals[0]
            elif family == "gain":
                tag = self._norm_tag(str(key[1]))
                if slot.size == 3:
                    vals = list(probes.gain_from_moments(*vals))
                out[f"{PREFIX}/norm_gain_mean/{tag}"] = vals[0]
                out[f"{PREFIX}/norm_gain_std/{tag}"] = vals[1]
            elif family == "bn":
                tag = self._norm_tag(str(key[1]))
                for name, v in zip(("bn_mean_drift", "bn_var_drift", "bn_gap"), vals, strict=True):
                    out[f"{PREFIX}/{'val_' if validation else ''}{name}/{tag}"] = v
            elif family.startswith("logits_"):
                name = {"logits_max": "max_abs", "logits_rms": "rms", "logits_z": "z"}[family]
                out[f"{PREFIX}/logits/{name}"] = vals[0]
        self._stack_scalars(record, per_block)
        if "nonfinite" in self.metrics and not validation:
            self._nonfinite(record, sorted(bad))
        return record

    def _stack_scalars(
        self, record: Record, per_block: dict[tuple[str, str], dict[int, float]]
    ) -> None:
        """Per-block tags (up to the cap), depth profiles, and per-stack summaries."""
        assert self.model_map is not None
        out = record.scalars
        stacks = {s.path: s for s in self.model_map.stacks}
        for (family, stack_path), blocks in per_block.items():
            stack = stacks[stack_path]
            name = self._name(stack_path)
            tag = f"{PREFIX}/{family}/{name}"
            width = len(str(stack.depth - 1))
            for b in tagged_blocks(stack.depth, self.max_block_tags):
                if b in blocks:
                    out[f"{tag}/{b:0{width}d}"] = blocks[b]
            record.profiles[tag] = [blocks.get(b, math.nan) for b in range(stack.depth)]
            first, last = blocks.get(0), blocks.get(stack.depth - 1)
            if not first or last is None:
                continue
            if family == "grad_norm":
                out[f"{PREFIX}/grad_ratio/{name}"] = last / first
            if family == "resid_rms":
                out[f"{PREFIX}/resid_growth/{name}"] = last / first
                ordered = [blocks[b] for b in sorted(blocks)]
                out[f"{PREFIX}/resid_slope/{name}"] = probes.loglog_slope(ordered)

    def _nonfinite(self, record: Record, bad: list[tuple[float, str]]) -> None:
        record.scalars[f"{PREFIX}/nonfinite/modules"] = float(len(bad))
        if not bad:
            return
        first = bad[0][1] or "<root>"
        record.texts[f"{PREFIX}/nonfinite/first"] = first
        if not self._warned_nonfinite and self._is_writer():
            self._warned_nonfinite = True
            warnings.warn(
                f"normprobe: NaN/Inf first appeared in the output of {first} "
                f"at step {self.step_count} ({len(bad)} modules affected)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _norm_tag(self, path: str) -> str:
        tag = self._tags.get(path)
        if tag is None:  # a module outside every block: named by its path, once
            tag = self._tags[path] = self._name(path)
        return tag

    def _name(self, path: str) -> str:
        """A module path as tags show it: under ``name_prefix``, ``root`` for the model."""
        return _unwrapped(self.name_prefix + path) or "root"

    def _module_tags(self, model_map: ModelMap, paths: Iterable[str]) -> dict[str, str]:
        """``<stack>/<block>.<rest>`` for modules inside a stack block (innermost block)."""
        blocks = {
            block: f"{self._name(s.path)}/{b:0{len(str(s.depth - 1))}d}"
            for s in model_map.stacks
            if not s.repeated
            for b, block in enumerate(s.blocks)
        }
        tags = {}
        for path in paths:
            parts = path.split(".")
            for i in range(len(parts) - 1, 0, -1):
                prefix = ".".join(parts[:i])
                if prefix in blocks:
                    tags[path] = f"{blocks[prefix]}.{_unwrapped('.'.join(parts[i:]))}"
                    break
        return tags

    def _charts(self, record: Record) -> list[Chart]:
        """One multi-line chart per family and stack (or per norm position within a stack)."""
        charts: dict[tuple[str, str], str] = {}
        for tag in record.scalars:
            parts = tag.split("/")
            family = parts[1]
            rest = "/".join(parts[2:])
            if len(parts) >= 4 and re.fullmatch(r"\d+", parts[-1]):  # .../<stack>/<block>
                title = "/".join(parts[2:-1])
                charts[(family, title)] = chart_regex("/".join(parts[:-1]))
            elif len(parts) >= 4 and re.fullmatch(r"\d+\..+", parts[-1]):  # .../<block>.<norm>
                position = parts[-1].split(".", 1)[1]
                title = "/".join(parts[2:-1]) + f" {position}"
                prefix = re.escape("/".join(parts[:-1]))
                charts[(family, title)] = f"^{prefix}/\\d+\\.{re.escape(position)}$"
            else:
                charts[(family, rest)] = "^" + re.escape(tag) + "$"
        order = {family: i for i, family in enumerate(_FAMILY_ORDER)}
        ranked = sorted(charts.items(), key=lambda item: order.get(item[0][0], len(order)))
        return [(f"{PREFIX} {family}", title, regex) for (family, title), regex in ranked]

    def _warn_missing(self, model_map: ModelMap) -> None:
        missing = []
        if not model_map.residual_adds and {"resid_rms", "resid_cos"} & set(self.metrics):
            missing.append("no residual adds (resid_rms, resid_cos)")
        if not model_map.norms and {"norm_rms", "norm_gain"} & set(self.metrics):
            missing.append("no norm layers (norm_rms, norm_gain)")
        if not model_map.stacks and {"grad_norm", "update_ratio"} & set(self.metrics):
            missing.append("no stacks of blocks (grad_norm, update_ratio)")
        if missing and self._is_writer():
            warnings.warn(
                f"normprobe: {model_map.model_type} has {'; '.join(missing)}: "
                "logging the other metrics",
                DiscoveryWarning,
                stacklevel=5,  # attach's caller (through discover_now and _install)
            )

    def _exit_modes(self) -> None:
        """Take the modes a forward that raised midway left entered off torch's mode stack.

        By identity, wherever they sit: after a KeyboardInterrupt other modes may have been
        entered above them (or theirs left), so popping the top could remove someone else's.
        """
        stale = {id(mode) for modes in self._modes.values() for mode in modes}
        self._modes.clear()
        if not stale:
            return
        stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
        if not any(id(mode) in stale for mode in stack):
            return
        popped = [_pop_mode() for _ in stack]  # type: ignore[no-untyped-call]
        for mode in reversed(popped):
            if id(mode) not in stale:
                _push_mode(mode)  # type: ignore[no-untyped-call]

    # lifetime ------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove every hook, write what is pending and close what the probe opened. Idempotent."""
        if self._removed:
            return
        self._removed = True
        self._recording = False
        self._exit_modes()
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for sink in self.sinks:
            sink.close()

    @property
    def attached(self) -> bool:
        return not self._removed

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _rowwise(
    fn: Callable[..., torch.Tensor], rows: Sequence[Sequence[torch.Tensor]]
) -> torch.Tensor:
    """``fn`` of the rows' columns stacked (one result per row), or row by row when the rows'
    lengths differ."""
    if len({tuple(t.shape for t in row) for row in rows}) == 1:
        return fn(*(torch.stack(column) for column in zip(*rows, strict=True)))
    return torch.stack([fn(*row) for row in rows])


def _stream_rms(reads: Sequence[_StreamRead]) -> torch.Tensor:
    """Each read stream's RMS, from its per-position norms."""
    if len({(r.numel, r.norms.shape) for r in reads}) == 1:
        return probes.rms_from_row_norms(torch.stack([r.norms for r in reads]), reads[0].numel)
    return torch.stack([probes.rms_from_row_norms(r.norms, r.numel) for r in reads])


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _moved(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t if t.device == device else t.to(device) for t in tensors]


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _unwrapped(path: str) -> str:
    """A module path without the wrappers FSDP1 and activation checkpointing insert."""
    return _WRAPPERS.sub("", path).rstrip(".")


_WRAPPERS = re.compile(r"(?<![^.])(?:_fsdp_wrapped_module|_checkpoint_wrapped_module)(?:\.|$)")


def _first_float(container: Any) -> torch.Tensor | None:
    first = container  # the common case, a tensor first in (args, kwargs), without a generator
    while isinstance(first, tuple | list) and first:
        first = first[0]
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return first
    for _, t in iter_tensors(container):
        if t.is_floating_point():
            return t
    return None


def _attached_probe(model: nn.Module) -> Probe | None:
    for hook in model._forward_pre_hooks.values():
        fn = getattr(hook, "fn", None)
        owner = getattr(fn, "__self__", None)
        if isinstance(hook, _Hook) and isinstance(owner, Probe) and owner.attached:
            return owner
    return None


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    log_dir: str | None = None,
    writer: Any = None,
    every: int = 50,
    metrics: Iterable[str] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    max_block_tags: int = 64,
) -> Probe:
    """Attach a probe that logs the model's norm, residual and gradient statistics.

    The model is mapped with `normprobe.discover` on ``example_inputs`` if given, else on its
    first forward. Every ``every``-th step (the first included) is logged to TensorBoard under
    ``normprobe/<metric family>/...``, with a custom-scalars layout and depth histograms.

    Metrics (all by default; choose with ``metrics=[...]``):

    {metrics}

    Args:
        model: the model to watch.
        optimizer: its optimizer; steps advance with ``optimizer.step()`` and gradients are read
            just before it. Without one, call ``probe.step()`` after each step.
        log_dir: where to write TensorBoard event files.
        writer: an existing ``SummaryWriter`` to write to instead (left open on removal).
        every: log every this many steps.
        metrics: names from ``normprobe.METRICS``.
        example_inputs, example_kwargs: inputs to map the model now instead of on its first
            forward.
        max_block_tags: deeper stacks get scalar tags for this many evenly spread blocks only
            (depth histograms always hold every block); norm and attention layers repeated
            more often (``blocks.*.ln_1``) are measured at this many evenly spread ones.

    Returns:
        A `Probe`, also a context manager; ``probe.remove()`` is idempotent.

    Raises:
        ValueError: unknown metric names or a bad ``every``.
        RuntimeError: a probe is already attached to the model.

    Example::

        with normprobe.attach(model, optimizer=opt, log_dir="runs/a", every=50):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
    """
    probe = Probe(  # checks the arguments before any file is created
        model,
        optimizer=optimizer,
        every=every,
        metrics=metrics,
        max_block_tags=max_block_tags,
    )
    try:
        if probe._is_writer():  # under torch.distributed, rank 0 alone opens event files
            probe.sinks.append(TensorBoardSink(writer=writer, log_dir=log_dir))
        if example_inputs is not None or example_kwargs is not None:
            probe.discover_now(*(example_inputs or ()), **(example_kwargs or {}))
        else:
            probe.discover_lazily()
    except BaseException:
        probe.remove()
        raise
    return probe


if attach.__doc__:
    attach.__doc__ = attach.__doc__.replace(
        "{metrics}", "\n    ".join(f"* ``{k}``: {v}." for k, v in METRICS.items())
    )
