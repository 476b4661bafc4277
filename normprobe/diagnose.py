"""`diagnose`: one forward/backward on a batch, and a short report of what looks wrong.

Every check reads what `normprobe.discover` maps and what a `normprobe.Probe` measures on that
step (gradient ratios, residual growth, attention logits), plus a few measurements of its own
(batch sizes at BatchNorm layers, each norm class rerun in float16/bfloat16, the second moment
through Linear→ReLU chains, weight spreads). The model is left as it was found.

The command line: ``normprobe diagnose module:function`` (see `add_cli`). With ``--json`` it
prints one JSON document (`Diagnosis.to_dict`) instead of the report:

* ``schema``: ``"normprobe.diagnose/1"``; a change that breaks readers changes the number;
* ``model``: the model's class name; ``loss``: the loss the backward ran from;
* ``findings``: ``{"code", "title", "evidence", "suggestion", "paths"}``, in the order of
  `CHECKS` (``evidence``: lines of measured numbers; ``paths``: the module paths concerned);
* ``checks``: per code of `CHECKS`, ``{"status", "reason"}``: status ``ok``, ``found`` or
  ``n/a``, with why it does not apply as the reason (else ``null``);
* ``measurements``: tag -> number, the probe's ``normprobe/...`` scalars of the step and the
  checks' own ``diagnose/...`` values.

Non-finite numbers are ``null``. Exit status as without ``--json``; on bad input (2) nothing is
printed to stdout, the error goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from . import common, diagnose_layers, probes, tags
from .discovery import DiscoveryWarning, ModelMap
from .discovery.state import preserved
from .discovery.table import collapse_indices
from .discovery.trace import first_float, iter_tensors, replace_at
from .metrics import attn_logits, grad_norm, resid_rms
from .reinit import branch_scales, is_weight_layer, out_in_view
from .report import dumps, json_number
from .runtime import Probe

# --- thresholds ---------------------------------------------------------------------------------

# The checks that watch a logged metric compare against that metric family's thresholds
# (normprobe/metrics/<family>.py), the same ones `normprobe report` flags with.
POSTLN_GRAD_RATIO_MAX = grad_norm.TOP_LIMIT
RESID_SLOPE_MAX = resid_rms.SLOPE_LIMIT
RESID_MIN_DEPTH = resid_rms.MIN_DEPTH
ATTN_LOGIT_MAX = attn_logits.SOFT_CAP

# BatchNorm's batch statistics come from m samples with a variance ∝ 1/m; batches of 2-4 per
# device are where BN degrades badly and GroupNorm takes over (Wu & He 2018, "Group
# Normalization"). 8 keeps a margin above that.
BN_MIN_BATCH = 8

# Low-precision norms: relative RMS error of a norm run in float16/bfloat16 against the same
# computation in float64 on the same rounded input. Norms that accumulate in float32 measure only
# the output's rounding (bfloat16 0.0017, float16 0.0002 here); one squaring in float16 overflows
# (error 1.0), one centering in bfloat16 misses the mean (0.09).
LOWP_ERROR_MAX = 0.01
# inputs of RMS 1024: squares near 1e6 overflow float16 (largest finite value 65504)
LOWP_FP16_SCALE = 1024.0
# inputs with a mean of 64 spreads: bfloat16 resolves 64 only to 0.5, the spread needs float32
LOWP_BF16_OFFSET = 64.0

# Linear→ReLU init: per layer E[y²]/E[x²] is 1 with Kaiming and 0.5 with Xavier or 1/fan_in
# (sanity check [e], examples/check_e_kaiming.py: 1.000 and 0.499). Flag outside [0.7, 1/0.7],
# around the geometric midpoint of 0.5 and 1, when at least 3 such layers follow each other
# (0.5³: 1/8 of the signal left).
RELU_RATIO_MIN = 0.7
RELU_CHAIN_MIN = 3

# GPT-2 residual scaling: layers writing into the stream get std/sqrt(2N) (Radford et al. 2019;
# nanoGPT's `c_proj` init). From 6 blocks on (12 writes) an unscaled stream's std grows by
# sqrt(1 + 12) = 3.6x (sanity check [f]: the variance grows linearly with the writes). Flag a
# write/other std ratio above (2N)^(-1/4): the geometric midpoint of 1 (unscaled) and
# (2N)^(-1/2) (GPT-2).
GPT2_MIN_DEPTH = 6

CHECKS: dict[str, str] = {
    "layer-jump": "one layer or block whose output or gradient jumps against its peers",
    "no-final-norm": "Pre-LN stack without a final norm before the output",
    "post-ln-top-heavy": "Post-LN stack with top-heavy gradients",
    "post-ln-warmup": "Post-LN stack needing a warmup (no DeepNorm init, or top-heavy gradients)",
    "residual-growth": "residual stream growing with depth",
    "attention-logits": "large attention logits",
    "batchnorm-batch": "BatchNorm on a small per-device batch, or unsynced across ranks",
    "low-precision-norm": "norm computing its statistics in float16/bfloat16",
    "eps-outside-sqrt": "eps outside the square root",
    "relu-init": "Linear→ReLU layers not initialized for ReLU",
    "no-residual-scaling": "no residual-projection scaling on a deep Pre-LN stack",
}

# the ``schema`` of ``normprobe diagnose --json``
DIAGNOSE_SCHEMA = "normprobe.diagnose/1"

Batch = torch.Tensor | tuple[Any, ...] | list[Any] | dict[str, Any]
# ``loss_fn(output)`` or ``loss_fn(output, batch)``; see `loss_caller`
LossFn = Callable[[Any], torch.Tensor] | Callable[[Any, Any], torch.Tensor]
LOSS_FN_FORMS = "loss_fn(output) or loss_fn(output, batch)"


class DiagnoseInputError(ValueError):
    """An entry point, batch or loss that `diagnose` cannot work with."""


@dataclass(frozen=True)
class Finding:
    """One problem `diagnose` found.

    Attributes:
        code: the check that found it (a key of `CHECKS`).
        title: one line saying what is wrong.
        evidence: the measured numbers and layer paths, one line each.
        suggestion: what to do about it.
        paths: the module paths concerned.
    """

    code: str
    title: str
    evidence: tuple[str, ...]
    suggestion: str
    paths: tuple[str, ...] = ()


@dataclass
class Diagnosis:
    """What `diagnose` found; ``print()`` it for the report.

    Attributes:
        model_type: the model's class name.
        findings: the problems found, in the order of `CHECKS`.
        checks: per check of `CHECKS`: ``"ok"``, ``"found"`` or ``"n/a: <why>"``.
        measurements: the probe's scalars for the step (``normprobe/...``) and diagnose's own
            (``diagnose/...``).
        model_map: what discovery found.
        loss: the loss the backward ran from.
    """

    model_type: str
    findings: list[Finding]
    checks: dict[str, str]
    measurements: dict[str, float]
    model_map: ModelMap
    loss: float

    @property
    def codes(self) -> list[str]:
        """The codes of the findings, in order."""
        return [f.code for f in self.findings]

    def __str__(self) -> str:
        lines = [
            f"normprobe diagnose: {self.model_type}, one forward/backward (loss {self.loss:.4g})"
        ]
        if not self.findings:
            lines.append("No problems found.")
        else:
            n = len(self.findings)
            lines.append(f"{n} finding{'s' if n > 1 else ''}:")
        for i, f in enumerate(self.findings, 1):
            lines.append("")
            lines.append(f"{i}. {f.title}  [{f.code}]")
            for e in f.evidence:
                lines += textwrap.wrap(e, 96, initial_indent="   ", subsequent_indent="     ")
            lines += textwrap.wrap(
                f"-> {f.suggestion}", 96, initial_indent="   ", subsequent_indent="      "
            )
        ok = [c for c, s in self.checks.items() if s == "ok"]
        na = [f"{c} ({s[5:]})" for c, s in self.checks.items() if s.startswith("n/a")]
        lines.append("")
        if self.model_map.doubts:
            lines.append("The model's map is unsure (the actions named refuse while it is):")
            for d in self.model_map.doubts:
                lines += textwrap.wrap(
                    f"- {d.kind} at {d.path or '<root>'}: {d.reason} [{', '.join(d.affects)}]",
                    96,
                    initial_indent="  ",
                    subsequent_indent="    ",
                )
            lines.append("")
        if ok:
            lines += textwrap.wrap("Passed: " + ", ".join(ok), 100, subsequent_indent="  ")
        if na:
            lines += textwrap.wrap("Not applicable: " + "; ".join(na), 100, subsequent_indent="  ")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (`DIAGNOSE_SCHEMA`; keys in the module's docstring)."""
        checks = {}
        for code, state in self.checks.items():
            status, _, reason = state.partition(": ")
            checks[code] = {"status": status, "reason": reason or None}
        return {
            "schema": DIAGNOSE_SCHEMA,
            "model": self.model_type,
            "loss": json_number(self.loss),
            "findings": [
                {
                    "code": f.code,
                    "title": f.title,
                    "evidence": list(f.evidence),
                    "suggestion": f.suggestion,
                    "paths": list(f.paths),
                }
                for f in self.findings
            ],
            "checks": checks,
            "measurements": {tag: json_number(v) for tag, v in self.measurements.items()},
        }


# --- the one step ---------------------------------------------------------------------------------


def default_loss(output: Any) -> torch.Tensor:
    """The scalar `diagnose` backpropagates when no ``loss_fn`` is given.

    ``output.loss`` (or ``output["loss"]``) when the model computed one; otherwise the mean of
    squares, in float32, of the logits: ``output.logits``/``output["logits"]`` (Hugging Face),
    the output itself, or the first floating-point tensor in it. Sanity check [d]
    (``examples/check_d_grad_ratio.py``) uses the same ``out.pow(2).mean()``.

    Example::

        >>> default_loss(torch.tensor([[1.0, 3.0]]))
        tensor(5.)
    """
    for name in ("loss", "logits"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value if name == "loss" else value.float().pow(2).mean()
    for _, t in iter_tensors(output):
        if t.is_floating_point():
            return t.float().pow(2).mean()
    raise DiagnoseInputError(
        f"the model returned {type(output).__name__}, with no floating-point tensor to make a "
        "loss from; pass loss_fn=lambda output: <a scalar tensor>"
    )


def loss_caller(loss_fn: LossFn | None) -> Callable[[Any, Batch], torch.Tensor]:
    """``loss_fn`` as a function of (output, batch), by the parameters it requires.

    One required positional parameter: called as ``loss_fn(output)``; two, or only ``*args``:
    ``loss_fn(output, batch)``, ``batch`` being what `diagnose` was given. ``None``:
    `default_loss`.

    Raises:
        DiagnoseInputError: ``loss_fn`` is not callable, or requires other parameters.
    """
    if loss_fn is None:
        return lambda output, batch: default_loss(output)
    if not callable(loss_fn):
        raise DiagnoseInputError(
            f"loss_fn must be callable as {LOSS_FN_FORMS}, got {type(loss_fn).__name__}"
        )
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the documented default
        params = [inspect.Parameter("output", inspect.Parameter.POSITIONAL_ONLY)]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    keyword = [p.name for p in params if p.default is p.empty and p.kind == p.KEYWORD_ONLY]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if not keyword and len(required) == 1:
        return lambda output, batch: loss_fn(output)  # type: ignore[call-arg]
    if not keyword and (len(required) == 2 or (varargs and not required)):
        return lambda output, batch: loss_fn(output, batch)  # type: ignore[call-arg]
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    bare = [p.replace(annotation=p.empty) for p in params]
    raise DiagnoseInputError(
        f"loss_fn must be callable as {LOSS_FN_FORMS} (batch: what diagnose was given), got "
        f"{name}{inspect.Signature(bare)}; wrap it, e.g. "
        "loss_fn=lambda output, batch: my_loss(output, targets)"
    )


def _split_batch(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    if isinstance(batch, dict):
        if not all(isinstance(k, str) for k in batch):
            raise DiagnoseInputError(
                f"a dict batch is passed as keyword arguments, so its keys must be strings; got "
                f"{[k for k in batch if not isinstance(k, str)][:5]}"
            )
        return (), dict(batch)
    raise DiagnoseInputError(
        f"batch must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
        f"got {type(batch).__name__}"
    )


@contextmanager
def _restored(model: nn.Module, train: bool) -> Iterator[None]:
    """Run with no gradients and in ``train`` mode; restore grads, modes, buffers and RNG."""
    with preserved(model, grads=True):
        model.train(train)
        yield


@dataclass
class _Pair:
    """A weight layer whose output went straight into a ReLU."""

    layer: str
    ms_in: float
    ms_out: float
    gain: float  # fan_in * Var(W)
    x_in: torch.Tensor | None  # the layer's input, to chain pairs (dropped after the forward)
    y_out: torch.Tensor | None


@dataclass
class _Capture:
    """What diagnose's own hooks read during the forward."""

    bn_batch: dict[str, int] = field(default_factory=dict)
    norm_inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    layer_calls: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    pairs: list[_Pair] = field(default_factory=list)
    chains: list[list[_Pair]] = field(default_factory=list)
    layers: diagnose_layers.LayerCapture = field(default_factory=diagnose_layers.LayerCapture)


_RELU = {"relu", "relu_"}


def _ms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean())


def _fan_in_gain(layer: nn.Module) -> float:
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim < 2:
        return math.nan
    return float(out_in_view(layer, w)[0].numel() * w.detach().float().var())


class _ReluWatch(TorchFunctionMode):
    """Pairs each ReLU with the weight layer whose output it received, if any."""

    def __init__(self, cap: _Capture, modules: dict[str, nn.Module]) -> None:
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
                _Pair(
                    source[0],
                    ms_in,
                    _ms(out),
                    _fan_in_gain(self.modules[source[0]]),
                    source[1],
                    out,
                )
            )
        return out


@contextmanager
def _capturing(model: nn.Module, model_map: ModelMap, cap: _Capture) -> Iterator[None]:
    modules = dict(model.named_modules())
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

    weight_layers = [
        p for p, m in modules.items() if is_weight_layer(m) and not isinstance(m, nn.Embedding)
    ]
    for path in weight_layers:

        def layer_post(mod: nn.Module, args: tuple[Any, ...], out: Any, path: str = path) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                cap.layer_calls.append((path, args[0], out))

        handles.append(modules[path].register_forward_hook(layer_post))
    try:
        with (
            _ReluWatch(cap, modules),
            diagnose_layers.capture_layers(model, weight_layers, cap.layers),
        ):
            yield
    finally:
        for h in handles:
            h.remove()
        cap.layer_calls.clear()


def diagnose(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn | None = None,
    *,
    train: bool = True,
    world_size: int | None = None,
) -> Diagnosis:
    """Run one forward/backward on ``batch`` and report what looks wrong with the model.

    The checks (`CHECKS`) cover single layers whose output or gradient jumps against the same layer
    in the other blocks (`normprobe.diagnose_layers`), norm placement (a Pre-LN stack without a
    final norm), gradient and residual-stream profiles over depth, attention logits, BatchNorm batch
    sizes, norm numerics in float16/bfloat16, eps placement, and initialization (ReLU chains, GPT-2
    residual scaling). Thresholds are this module's constants. How the low-precision check works:
    each norm class is rerun on its captured input's shape, once in float16 with inputs of RMS 1024
    (squares overflow float16 unless accumulated in float32) and once in bfloat16 with inputs whose
    mean is 64 times their spread (a mean held in bfloat16 loses the spread); the output is compared
    with the same module run in float64 on the same rounded input. A norm that computes its
    statistics in float32 differs only by the output's rounding.

    The model runs in training mode (``train=False``: as it is) with its own RNG state restored
    afterwards; gradients, train/eval modes and buffers (BatchNorm running statistics) are put
    back as they were, and no hook is left.

    Args:
        model: the model, on the device of ``batch``.
        batch: one input tensor, a tuple of positional inputs, or a dict of keyword inputs.
        loss_fn: the scalar to backpropagate, as ``loss_fn(output)`` or ``loss_fn(output,
            batch)`` (``batch`` as given here; chosen by the parameters it requires, see
            `loss_caller`); default `default_loss` (the model's own ``.loss``, else the mean of
            squares of its logits).
        train: run the step in training mode (dropout on, BatchNorm on batch statistics).
        world_size: data-parallel ranks the model trains on, for the BatchNorm check; default
            ``torch.distributed``'s world size when a process group exists, else 1.

    Returns:
        A `Diagnosis`: ``print()`` it; ``.findings`` and ``.codes`` hold the problems.

    Raises:
        DiagnoseInputError: a batch of the wrong type, a ``loss_fn`` of neither form, or a loss
            that is not a scalar depending on the model's parameters.
        Exception: whatever the model's forward raises on ``batch``.

    Example::

        >>> from normprobe.models import ResidualStack
        >>> result = normprobe.diagnose(ResidualStack(48, 64), torch.randn(16, 64))
        >>> print(result)  # the report
        >>> result.codes
        ['no-final-norm', 'residual-growth']
    """
    if not isinstance(model, nn.Module):
        raise DiagnoseInputError(f"diagnose() needs a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = _split_batch(batch)
    compute_loss = loss_caller(loss_fn)
    if world_size is None:
        world_size = common.world_size()
    cap = _Capture()
    with _restored(model, train):
        probe = Probe(model, every=1, sinks=[], max_block_tags=sys.maxsize)  # every layer
        try:
            with warnings.catch_warnings():
                # what the model lacks shows in the report as checks that do not apply
                warnings.simplefilter("ignore", DiscoveryWarning)
                probe.discover_now(*args, **kwargs)
            assert probe.model_map is not None
            model_map = probe.model_map
            with _capturing(model, model_map, cap):
                output = model(*args, **kwargs)
            loss = compute_loss(output, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise DiagnoseInputError(
                    f"the loss must be a scalar tensor, got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                )
            if not loss.requires_grad:
                raise DiagnoseInputError(
                    "the loss does not depend on any parameter that requires grad: diagnose "
                    "needs one backward pass (unfreeze the model, or pass a loss_fn that uses "
                    "the output)"
                )
            torch.autograd.backward(loss.float().reshape(()))
            probe.step()
            record = probe.latest
            scalars = dict(record.scalars) if record is not None else {}
            logit_tags = {a.path: probe.tag("attn_logit_max", a.path) for a in model_map.attention}
        finally:
            probe.remove()
            cap.layers.release()
        cap.chains = _relu_chains(cap.pairs)
        for pair in cap.pairs:  # keep no activation alive in the result
            pair.x_in = pair.y_out = None
        loss_value = float(loss.detach())
        ctx = _Context(model, model_map, scalars, cap, world_size, logit_tags, loss_fn is not None)
        checks: dict[str, str] = {}
        findings: list[Finding] = []
        for code, check in _CHECKS.items():
            found, na = check(ctx)
            findings += found
            checks[code] = "found" if found else (f"n/a: {na}" if na else "ok")
    return Diagnosis(
        type(model).__name__, findings, checks, {**scalars, **ctx.extra}, model_map, loss_value
    )


# --- the checks -----------------------------------------------------------------------------------


@dataclass
class _Context:
    model: nn.Module
    model_map: ModelMap
    scalars: dict[str, float]
    cap: _Capture
    world_size: int
    attention_tags: dict[str, str]
    own_loss: bool
    extra: dict[str, float] = field(default_factory=dict)
    _jumps: list[diagnose_layers.Jump] | None = None

    def jumps(self) -> list[diagnose_layers.Jump]:
        """Layers and blocks jumping against their peers (`normprobe.diagnose_layers`)."""
        if self._jumps is None:
            found = diagnose_layers.layer_jumps(
                self.model, self.cap.layers, self.model_map, self.extra
            )
            for s in self.model_map.stacks:
                profile = self.stream_rms(s)
                found += diagnose_layers.stream_jumps(s.path, s.blocks, profile, self.extra)
            self._jumps = found
        return self._jumps

    def stream_rms(self, s: Any) -> list[float | None]:
        """The RMS of stack ``s``'s stream after each block."""
        name = s.path or "root"
        return [
            self.scalars.get(tags.format("resid_rms", name, b, depth=s.depth))
            for b in range(s.depth)
        ]

    def scalar(self, family: str, path: str) -> float | None:
        return self.scalars.get(tags.format(family, path or "root"))

    def add_stacks(self, placements: tuple[str, ...]) -> list[Any]:
        """Top-level stacks of these placements that carry residual adds."""
        return [
            s
            for s in self.model_map.stacks
            if s.norm_placement in placements
            and s.parent is None
            and self.model_map.adds_in(s.path)
        ]


CheckResult = tuple[list[Finding], str | None]


def _paths(paths: Sequence[str]) -> str:
    """``blocks.{0..11}.attn`` for runs of block indices."""
    rows = collapse_indices([(p or "<root>",) for p in paths], (0,))
    return ", ".join(r[0] for r in rows)


def _check_layer_jump(ctx: _Context) -> CheckResult:
    jumps = ctx.jumps()
    if not any(t.startswith("diagnose/jump_max/") for t in ctx.extra):
        return [], "no layer or block repeated 3+ times to compare with its peers"
    return [
        Finding("layer-jump", *d) for d in diagnose_layers.describe(jumps, ctx.model, _paths)
    ], None


def _check_final_norm(ctx: _Context) -> CheckResult:
    stacks = ctx.add_stacks(("pre-ln", "sandwich"))
    if not stacks:
        return [], "no Pre-LN stack"
    if any(n.role == "final" for n in ctx.model_map.norms):
        return [], None
    evidence = []
    for s in stacks:
        growth = ctx.scalar("resid_growth", s.path)
        grows = (
            f"; its stream grows {growth:.2f}x from the first block to the last" if growth else ""
        )
        evidence.append(f"stack `{s.path or '<root>'}`: {s.depth} {s.placement} blocks{grows}")
    head = ctx.model_map.head
    evidence.append(
        "no norm has the role 'final'"
        + (f": the output layer `{head}` reads the residual stream unnormalized" if head else "")
    )
    return [
        Finding(
            "no-final-norm",
            "Pre-LN stack without a final norm",
            tuple(evidence),
            "add a LayerNorm/RMSNorm after the last block, before the head: in Pre-LN the stream "
            "is never normalized, and its magnitude grows with depth (about sqrt(depth)).",
            tuple(s.path for s in stacks),
        )
    ], None


def _top_heavy(ctx: _Context, s: Any) -> float | None:
    """Stack ``s``'s last/first block gradient ratio when above the limit, else None."""
    ratio = ctx.scalar("grad_ratio", s.path)
    measurable = ctx.model_map.head is not None or ctx.own_loss
    return ratio if measurable and ratio is not None and ratio > POSTLN_GRAD_RATIO_MAX else None


def _check_post_ln(ctx: _Context) -> CheckResult:
    # a stack discovery calls "deepnorm" already carries the fix
    stacks = ctx.add_stacks(("post-ln",))
    if not stacks:
        return [], "no Post-LN stack"
    if ctx.model_map.head is None and not ctx.own_loss:
        # mean(out²) of a freshly normalized output is about constant (why check [d]'s stack
        # ends in a linear head)
        return [], "no output head: pass loss_fn, the default loss flattens Post-LN gradients"
    found = []
    for s in stacks:
        ratio = _top_heavy(ctx, s)
        if ratio is None:
            continue
        found.append(
            Finding(
                "post-ln-top-heavy",
                f"Post-LN gradients pile up at the top of `{s.path or '<root>'}`",
                (
                    f"gradient norm of block {s.depth - 1} / block 0 = {ratio:.2f} over {s.depth} "
                    f"{s.placement} blocks (threshold {POSTLN_GRAD_RATIO_MAX}; a 48-block Post-LN "
                    "ResidualStack: 2.35, after DeepNorm init: 1.02)",
                ),
                "train with a learning-rate warmup, or re-initialize for DeepNorm: "
                "normprobe.reinit(model, 'deepnorm', example_inputs=...); or move to Pre-LN.",
                (s.path,),
            )
        )
    return found, None


def _check_post_ln_warmup(ctx: _Context) -> CheckResult:
    """A Post-LN stack trained from a standard init needs a learning-rate warmup (Xiong et
    al. 2020); DeepNorm's init (its fixed branch scales) removes that need, unless the gradients
    are top-heavy all the same (then post-ln-top-heavy flags the stack too)."""
    stacks = ctx.add_stacks(("post-ln",))
    if not stacks:
        return [], "no Post-LN stack"
    deepnorm = {p for p, b in branch_scales(ctx.model).items() if b.kind == "deepnorm"}
    found = []
    for s in stacks:
        writers = {w for a in ctx.model_map.adds_in(s.path) for w in a.writers}
        scaled = any(w == d or w.startswith(d + ".") for w in writers for d in deepnorm)
        top_heavy = _top_heavy(ctx, s)
        if scaled and top_heavy is None:
            continue
        ratio = ctx.scalar("grad_ratio", s.path)
        norms = [
            ctx.scalars.get(tags.format("grad_norm", s.path or "root", b, depth=s.depth))
            for b in range(s.depth)
        ]
        profile = ", ".join("-" if v is None else f"{v:.3g}" for v in norms)
        name = s.path or "<root>"
        evidence = [
            f"{s.depth} {s.placement} blocks at `{name}`, "
            + ("with DeepNorm's scales" if scaled else "no DeepNorm scales")
        ]
        if ratio is not None:
            evidence.append(
                f"gradient norm per block at this batch: {profile} (last / first {ratio:.3g}"
                + (", top-heavy: post-ln-top-heavy)" if top_heavy else ")")
                + "; Post-LN renormalizes after every add, so each block's share of the gradient "
                "depends on its depth and shifts as training moves the weights"
            )
        found.append(
            Finding(
                "post-ln-warmup",
                f"Post-LN stack `{name}` "
                + (
                    "needs a warmup despite DeepNorm's scales"
                    if scaled
                    else "without DeepNorm's initialization"
                ),
                tuple(evidence),
                "train with a learning-rate warmup (Post-LN without one stalls or diverges: "
                "Xiong et al. 2020), or re-initialize for DeepNorm: "
                "normprobe.reinit(model, 'deepnorm', example_inputs=...), which trains without "
                "one; or move the norms in front of the branches (Pre-LN).",
                (s.path,),
            )
        )
    return found, None


def _check_residual_growth(ctx: _Context) -> CheckResult:
    stacks = ctx.add_stacks(("pre-ln", "sandwich", "mixed", "no-norm", "in-branch"))
    stacks = [s for s in stacks if s.depth >= RESID_MIN_DEPTH]
    if not stacks:
        return [], f"no stack of {RESID_MIN_DEPTH}+ blocks whose stream is left unnormalized"
    found = []
    for s in stacks:
        slope = ctx.scalar("resid_slope", s.path)
        growth = ctx.scalar("resid_growth", s.path)
        if slope is None or growth is None or not slope > RESID_SLOPE_MAX:
            continue
        name = s.path or "<root>"
        title = f"residual stream grows with depth in `{name}`"
        evidence = [
            f"RMS of the stream after block {s.depth - 1} / after block 0 = {growth:.2f}; "
            f"log-log slope against depth {slope:.2f} (sqrt(depth) is 0.5; threshold "
            f"{RESID_SLOPE_MAX})"
        ]
        suggestion = (
            "deep blocks add ever less to a growing stream: scale the residual writes "
            "(normprobe.reinit(model, 'gpt2')), start branches small "
            "(normprobe.insert_branch_scale(model, 'layerscale')), or use sandwich norms."
        )
        jumps = [j for j in ctx.jumps() if not j.layer and j.block and j.block[0] == s.path]
        if jumps:
            rest = probes.loglog_slope(diagnose_layers.without_jumps(ctx.stream_rms(s), jumps))
            at = ", ".join(f"x{j.factor:.3g} at block {j.block[1]}" for j in jumps if j.block)
            evidence.append(f"of that, {at} [layer-jump]; without it the slope is {rest:.2f}")
            if not rest > RESID_SLOPE_MAX:
                blocks = {j.block for j in jumps}
                culprits = list(
                    dict.fromkeys(j.path for j in ctx.jumps() if j.layer and j.block in blocks)
                )
                at = ", ".join(f"block {j.block[1]}" for j in jumps if j.block)
                title = f"residual stream of `{name}` jumps at {at}, it does not grow with depth"
                suggestion = (
                    f"the growth comes from one place, not from depth: fix "
                    f"{_paths(culprits or [j.path for j in jumps])} (see layer-jump); a global "
                    "re-init or branch scaling would not remove it."
                )
        found.append(Finding("residual-growth", title, tuple(evidence), suggestion, (s.path,)))
    return found, None


def _check_attention(ctx: _Context) -> CheckResult:
    if not ctx.model_map.attention:
        return [], "no attention modules"
    big = []
    for a in ctx.model_map.attention:
        value = ctx.scalars.get(ctx.attention_tags[a.path])
        if value is not None and value > ATTN_LOGIT_MAX:
            big.append((a.path, value))
    if not big:
        return [], None
    qk = {s.path: s.qk_norm for s in ctx.model_map.stacks}
    has_qk = any(qk.get(a.stack or "", False) for a in ctx.model_map.attention)
    worst = max(big, key=lambda pv: pv[1])
    suggestion = (
        "the queries and keys are already normalized: check the QK-norm gains and the "
        "attention scale, and lower the learning rate."
        if has_qk
        else "normalize queries and keys before the dot product (QK-norm: a LayerNorm/RMSNorm "
        "over each head's q and k), or soft-cap the logits."
    )
    return [
        Finding(
            "attention-logits",
            "large attention logits",
            (
                f"max |q·k|·scale = {worst[1]:.1f} at {worst[0]} (threshold {ATTN_LOGIT_MAX:g}); "
                f"{len(big)} of {len(ctx.model_map.attention)} attention modules above: "
                f"{_paths([p for p, _ in big])}",
            ),
            suggestion,
            tuple(p for p, _ in big),
        )
    ], None


def _check_batchnorm(ctx: _Context) -> CheckResult:
    if not ctx.cap.bn_batch:
        return [], "no BatchNorm in training mode"
    modules = dict(ctx.model.named_modules())
    synced = {p for p in ctx.cap.bn_batch if isinstance(modules[p], nn.SyncBatchNorm)}
    small = {
        p: b
        for p, b in ctx.cap.bn_batch.items()
        if b * (ctx.world_size if p in synced else 1) < BN_MIN_BATCH
    }
    found = []
    if small:
        batch = min(small.values())
        ctx.extra["diagnose/bn_batch"] = float(batch)
        found.append(
            Finding(
                "batchnorm-batch",
                "BatchNorm normalizes over a tiny batch",
                (
                    f"{len(small)} BatchNorm layers see a batch of {batch} per device (below "
                    f"{BN_MIN_BATCH}): {_paths(sorted(small))}",
                ),
                "batch statistics from so few samples are noisy and differ from the running "
                "ones used in eval: use GroupNorm (normprobe.convert_norms(model, 'groupnorm')), "
                "a larger batch, or SyncBatchNorm across devices.",
                tuple(sorted(small)),
            )
        )
    unsynced = sorted(p for p in ctx.cap.bn_batch if p not in synced)
    if ctx.world_size > 1 and unsynced:
        found.append(
            Finding(
                "batchnorm-batch",
                "BatchNorm is not synchronized across data-parallel ranks",
                (
                    f"{ctx.world_size} ranks; {len(unsynced)} BatchNorm layers normalize over "
                    f"their own rank's {min(ctx.cap.bn_batch[p] for p in unsynced)} samples: "
                    f"{_paths(unsynced)}",
                ),
                "convert them before wrapping the model in DDP: "
                "normprobe.convert_norms(model, 'syncbatchnorm') (or torch's "
                "SyncBatchNorm.convert_sync_batchnorm), or use GroupNorm.",
                tuple(unsynced),
            )
        )
    return found, None


def _rerun(
    module: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], dtype: torch.dtype
) -> float:
    """Relative RMS error of ``module`` run in ``dtype`` against float64 on the same input."""
    args, kwargs = inputs
    key, x = next(((k, t) for k, t in iter_tensors((args, kwargs)) if t.is_floating_point()))
    gen = torch.Generator(device="cpu").manual_seed(0)
    z = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    z = z * LOWP_FP16_SCALE if dtype == torch.float16 else z + LOWP_BF16_OFFSET
    low = z.to(x.device, dtype)

    def run(t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        params = {n: p.detach().to(to) for n, p in module.named_parameters()}
        a, k = replace_at((args, kwargs), key, t)
        out = torch.func.functional_call(module, params, tuple(a), k)
        y = next(t for _, t in iter_tensors(out) if t.is_floating_point())
        return y.double()

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        y = run(low, dtype)
        torch.manual_seed(0)
        ref = run(low.double(), torch.float64)
    err = (y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return float(err.nan_to_num(nan=math.inf))


def _check_low_precision(ctx: _Context) -> CheckResult:
    if not ctx.cap.norm_inputs:
        return [], "no LayerNorm/RMSNorm/GroupNorm-like layers ran"
    modules = dict(ctx.model.named_modules())
    found = []
    for path, inputs in ctx.cap.norm_inputs.items():
        module = modules[path]
        errors: dict[str, float] = {}
        for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            try:
                errors[name] = _rerun(module, inputs, dtype)
            except Exception:  # an op without a kernel for this dtype: not judged
                continue
            ctx.extra[f"diagnose/lowp_error/{name}/{path}"] = errors[name]
        bad = {k: v for k, v in errors.items() if v > LOWP_ERROR_MAX}
        if not bad:
            continue
        cls = type(module)
        same = [p for p, m in modules.items() if type(m) is cls and p]
        how = []
        if "float16" in bad:
            how.append(
                f"float16, inputs of RMS {LOWP_FP16_SCALE:g}: error {bad['float16']:.1%} "
                "(squares above 65504 overflow)"
            )
        if "bfloat16" in bad:
            how.append(
                f"bfloat16, mean {LOWP_BF16_OFFSET:g}x the spread: error {bad['bfloat16']:.1%}"
            )
        found.append(
            Finding(
                "low-precision-norm",
                f"{cls.__name__} computes its statistics in the input's precision",
                (
                    f"{path} rerun against float64 on the same rounded input: " + "; ".join(how),
                    f"a norm that accumulates in float32 is off by its output rounding only "
                    f"(below {LOWP_ERROR_MAX:.0%}); {len(same)} layers of this class: "
                    f"{_paths(same)}",
                ),
                "upcast inside the norm (x32 = x.float(); statistics and scaling in float32; "
                "return y.to(x.dtype)), or replace the class with torch's: "
                "normprobe.convert_norms(model, 'rmsnorm' or 'layernorm').",
                tuple(same),
            )
        )
    return found, None


def _check_eps(ctx: _Context) -> CheckResult:
    custom = [n for n in ctx.model_map.norms if n.eps is not None]
    if not custom:
        return [], "no norm with an eps"
    outside = [n for n in custom if n.eps_placement == "outside-sqrt"]
    if not outside:
        return [], None
    eps = sorted({n.eps for n in outside if n.eps is not None})
    return [
        Finding(
            "eps-outside-sqrt",
            "eps outside the square root",
            (
                f"{len(outside)} norms compute x / (sqrt(var) + eps) with eps "
                f"{', '.join(f'{e:g}' for e in eps)}: {_paths([n.path for n in outside])}",
            ),
            "use sqrt(var + eps), the convention of torch, HF and the papers: eps outside the "
            "root acts like eps² inside (far too small to guard float16 against var ≈ 0), and "
            "weights moved to a standard norm change output on small inputs. "
            "normprobe.convert_norms(model, 'rmsnorm' or 'layernorm') swaps in torch's layers.",
            tuple(n.path for n in outside),
        )
    ], None


def _relu_chains(pairs: list[_Pair]) -> list[list[_Pair]]:
    """Runs of pairs where each layer's input is the previous pair's ReLU output."""
    chains: list[list[_Pair]] = []
    for pair in pairs:
        last = chains[-1][-1] if chains else None
        if last is not None and pair.x_in is not None and pair.x_in is last.y_out:
            chains[-1].append(pair)
        else:
            chains.append([pair])
    return chains


def _check_relu(ctx: _Context) -> CheckResult:
    chains = [c for c in ctx.cap.chains if len(c) >= RELU_CHAIN_MIN]
    if not chains:
        return [], f"no chain of {RELU_CHAIN_MIN}+ Linear/Conv→ReLU layers"
    found = []
    for chain in chains:
        ratios = [p.ms_out / p.ms_in for p in chain if p.ms_in > 0]
        if not ratios or any(r <= 0 for r in ratios):
            continue
        per_layer = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        first, last = chain[0], chain[-1]
        ctx.extra[f"diagnose/relu_ratio/{first.layer}"] = per_layer
        if RELU_RATIO_MIN <= per_layer <= 1 / RELU_RATIO_MIN:
            continue
        gains = [p.gain for p in chain if p.gain == p.gain]
        gain = sum(gains) / len(gains) if gains else math.nan
        way = "shrinks" if per_layer < 1 else "grows"
        found.append(
            Finding(
                "relu-init",
                f"signal {way} x{per_layer:.2f} per Linear→ReLU layer: not initialized for ReLU",
                (
                    f"{len(chain)} layers {_paths([p.layer for p in chain])}: E[x²] "
                    f"{first.ms_in:.3g} into `{first.layer}`, {last.ms_out:.3g} out of the "
                    "last ReLU",
                    f"fan_in·Var(W) = {gain:.2f} on average (Kaiming for ReLU: 2, keeping E[x²]; "
                    "Xavier or 1/fan_in: 1, halving it per layer)",
                ),
                "re-initialize for ReLU: normprobe.reinit(model, 'kaiming') "
                "(He normal, fan_in, gain sqrt(2)).",
                tuple(p.layer for p in chain),
            )
        )
    return found, None


def _check_residual_scaling(ctx: _Context) -> CheckResult:
    modules = dict(ctx.model.named_modules())
    found = []
    seen = False
    for s in ctx.add_stacks(("pre-ln",)):
        if s.depth < GPT2_MIN_DEPTH:
            continue
        writes: list[str] = []
        others: list[str] = []
        for a in ctx.model_map.adds_in(s.path):
            if not a.writers or len(a.branch_layers) < 2:
                continue
            writes += a.writers
            others += [p for p in a.branch_layers if p not in a.writers and p not in a.gates]
        if not writes:
            continue
        seen = True
        # a layer that jumps against its peers would swamp the pooled std (layer-jump names it)
        odd = {j.path for j in ctx.jumps() if j.layer}
        write_std = _pooled_std([modules[p] for p in writes if p not in odd])
        other_std = _pooled_std([modules[p] for p in others if p not in odd])
        if not other_std > 0:
            continue
        ratio = write_std / other_std
        gpt2 = 1 / math.sqrt(2 * s.depth)
        ctx.extra[f"diagnose/write_std_ratio/{s.path or 'root'}"] = ratio
        if ratio <= math.sqrt(gpt2):
            continue
        found.append(
            Finding(
                "no-residual-scaling",
                f"residual writes of `{s.path or '<root>'}` are not scaled down for depth",
                (
                    f"weight std {write_std:.4g} in the {len(writes)} layers writing into the "
                    f"stream ({_paths(writes)}) against {other_std:.4g} in the other branch "
                    f"layers: ratio {ratio:.2f}; GPT-2's 1/sqrt(2N) with N = {s.depth} gives "
                    f"{gpt2:.3f}",
                ),
                "scale the stream-writing layers by 1/sqrt(2N) so the stream's variance stays "
                "O(1) after 2N writes: normprobe.reinit(model, 'gpt2', example_inputs=...).",
                tuple(writes),
            )
        )
    if not seen:
        return [], (
            f"no Pre-LN stack of {GPT2_MIN_DEPTH}+ blocks with multi-layer residual branches"
        )
    return found, None


def _pooled_std(layers: list[nn.Module]) -> float:
    ws = [
        w.detach().float().reshape(-1)
        for m in layers
        if isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.ndim >= 2
    ]
    if not ws:
        return math.nan
    return float(torch.cat(ws).std())


_CHECKS: dict[str, Callable[[_Context], CheckResult]] = {
    "layer-jump": _check_layer_jump,
    "no-final-norm": _check_final_norm,
    "post-ln-top-heavy": _check_post_ln,
    "post-ln-warmup": _check_post_ln_warmup,
    "residual-growth": _check_residual_growth,
    "attention-logits": _check_attention,
    "batchnorm-batch": _check_batchnorm,
    "low-precision-norm": _check_low_precision,
    "eps-outside-sqrt": _check_eps,
    "relu-init": _check_relu,
    "no-residual-scaling": _check_residual_scaling,
}


# --- command line ---------------------------------------------------------------------------------

_EPILOG = """\
ENTRY names a function, module:function, returning (model, batch) or (model, batch, loss_fn);
batch is what diagnose() takes: a tensor, a tuple of positional inputs or a dict of keyword
inputs. loss_fn is called as loss_fn(output), or as loss_fn(output, batch) when it requires two
parameters (output: what the model returned on batch) and returns the scalar tensor to
backpropagate; without it the loss is the model's own .loss, else the mean of squares of its
logits. Exit status: 0 no finding, 1 findings, 2 bad input (entry not found, wrong return
value, a loss_fn of another signature, the model failing on the batch). --json prints the
report as JSON (schema normprobe.diagnose/1: model, loss, findings, checks, measurements).
"""


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``diagnose`` subcommand on an argparse ``add_subparsers()`` object.

    The subcommand's ``run`` default takes the parsed arguments and returns the exit status:
    0 without findings, 1 with findings, 2 for bad input.

    Example::

        parser = argparse.ArgumentParser(prog="normprobe")
        commands = parser.add_subparsers(dest="command", required=True)
        add_cli(commands)
        args = parser.parse_args(["diagnose", "mymodels:build", "--path", "src"])
        raise SystemExit(args.run(args))
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "diagnose",
        help="one forward/backward on a batch, and a report of what looks wrong",
        description="Run one forward/backward of a model on a batch and report problems with "
        "its normalization, residual stream and initialization, with the evidence and a fix.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("entry", metavar="ENTRY", help="module:function building the model")
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="directory to import ENTRY's module from (repeatable; the current directory is "
        "always searched)",
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="run the step in the model's current mode instead of training mode",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON document ({DIAGNOSE_SCHEMA}) instead of the report",
    )
    parser.set_defaults(run=run_cli)
    return parser


def load_entry(entry: str, paths: Sequence[str] = ()) -> tuple[nn.Module, Batch, LossFn | None]:
    """Import ``module:function``, call it and check what it returns.

    Raises:
        DiagnoseInputError: a malformed entry, a module or function that is not there, or a
            return value that is not ``(model, batch)`` / ``(model, batch, loss_fn)``.
    """
    module_name, sep, func_name = entry.partition(":")
    if not sep or not module_name or not func_name:
        raise DiagnoseInputError(
            f"ENTRY must be module:function, like mymodels:build, got {entry!r}"
        )
    for p in [*paths, "."][::-1]:
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise DiagnoseInputError(
                f"no module {module_name!r} on the import path (from ENTRY {entry!r}); run from "
                "its directory or add it with --path DIR"
            ) from err
        raise
    func = getattr(module, func_name, None)
    if not callable(func):
        known = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and n[:1] != "_"
        )
        raise DiagnoseInputError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
            f"{func_name!r}; functions there: {known[:10]}"
        )
    result = func()
    ok = (
        isinstance(result, tuple)
        and len(result) in (2, 3)
        and isinstance(result[0], nn.Module)
        and (len(result) == 2 or result[2] is None or callable(result[2]))
    )
    if not ok:
        got = (
            f"a tuple of ({', '.join(type(r).__name__ for r in result)})"
            if isinstance(result, tuple)
            else type(result).__name__
        )
        raise DiagnoseInputError(
            f"{entry} must return (model, batch) or (model, batch, loss_fn) with model an "
            f"nn.Module, got {got}"
        )
    model, batch, *rest = result
    loss_fn = rest[0] if rest else None
    try:  # a bad batch type or loss_fn fails here, naming the entry
        _split_batch(batch)
        loss_caller(loss_fn)
    except DiagnoseInputError as err:
        raise DiagnoseInputError(f"{entry}: {err}") from err
    return model, batch, loss_fn


def run_cli(args: argparse.Namespace) -> int:
    """``normprobe diagnose``: print the report; 0 no finding, 1 findings, 2 bad input."""
    try:
        model, batch, loss_fn = load_entry(args.entry, args.path)
        result = diagnose(model, batch, loss_fn, train=not args.eval)
    except DiagnoseInputError as err:
        print(f"normprobe diagnose: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        traceback.print_exc()
        print(
            f"normprobe diagnose: error: {args.entry} failed: {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 2
    print(dumps(result.to_dict()) if args.json else result)
    return 1 if result.findings else 0
