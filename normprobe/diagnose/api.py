"""`diagnose`: one forward/backward on a batch, then the checks of `normprobe.diagnose.checks`.

Every check reads what `normprobe.discover` maps and what a `normprobe.Probe` measures on that
step (gradient ratios, residual growth, attention logits), plus what diagnose's own hooks capture
(`normprobe.diagnose.capture`). The model is left as it was found.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import common
from ..discovery import DiscoveryWarning, ModelMap, preserved
from ..runtime import Probe
from .capture import Capture, capturing
from .checks import REGISTRY, Context
from .inputs import Batch, LossFn, loss_caller, split_batch
from .result import DiagnoseInputError, Diagnosis, Finding


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
    in the other blocks (`normprobe.diagnose.layers`), norm placement (a Pre-LN stack without a
    final norm), gradient and residual-stream profiles over depth, attention logits, BatchNorm batch
    sizes, norm numerics in float16/bfloat16, eps placement, and initialization (ReLU chains, GPT-2
    residual scaling). Each check's thresholds are constants in its file of
    `normprobe.diagnose.checks`. How the low-precision check works: each norm class is rerun on its
    captured input's shape, once in float16 with inputs of RMS 1024 (squares overflow float16
    unless accumulated in float32) and once in bfloat16 with inputs whose mean is 64 times their
    spread (a mean held in bfloat16 loses the spread); the output is compared with the same module
    run in float64 on the same rounded input. A norm that computes its statistics in float32
    differs only by the output's rounding.

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
    args, kwargs = split_batch(batch)
    compute_loss = loss_caller(loss_fn)
    if world_size is None:
        world_size = common.world_size()
    cap = Capture()
    with _restored(model, train):
        step = _step(model, args, kwargs, lambda output: compute_loss(output, batch), cap)
        cap.chain_pairs()
        ctx = Context(
            model,
            step.model_map,
            step.scalars,
            cap,
            world_size,
            step.attention_tags,
            loss_fn is not None,
        )
        findings, checks = _run_checks(ctx)
    return Diagnosis(
        type(model).__name__,
        findings,
        checks,
        {**step.scalars, **ctx.extra},
        step.model_map,
        step.loss,
    )


@contextmanager
def _restored(model: nn.Module, train: bool) -> Iterator[None]:
    """Run with no gradients and in ``train`` mode; restore grads, modes, buffers and RNG."""
    with preserved(model, grads=True):
        model.train(train)
        yield


@dataclass
class _Step:
    """What the probe read on the one step."""

    model_map: ModelMap
    scalars: dict[str, float]
    attention_tags: dict[str, str]  # attention path -> its ``attn_logit_max`` tag
    loss: float


def _step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compute_loss: Callable[[Any], torch.Tensor],
    cap: Capture,
) -> _Step:
    """Discover the model, then one forward (captured into ``cap``) and backward, probed."""
    probe = Probe(model, every=1, sinks=[], max_block_tags=sys.maxsize)  # every layer
    try:
        with warnings.catch_warnings():
            # what the model lacks shows in the report as checks that do not apply
            warnings.simplefilter("ignore", DiscoveryWarning)
            probe.discover_now(*args, **kwargs)
        assert probe.model_map is not None
        model_map = probe.model_map
        with capturing(model, model_map, cap):
            output = model(*args, **kwargs)
        loss = _checked_loss(compute_loss(output))
        torch.autograd.backward(loss.float().reshape(()))
        probe.step()
        record = probe.latest
        scalars = dict(record.scalars) if record is not None else {}
        logit_tags = {a.path: probe.tag("attn_logit_max", a.path) for a in model_map.attention}
    finally:
        probe.remove()
        cap.layers.release()
    return _Step(model_map, scalars, logit_tags, float(loss.detach()))


def _checked_loss(loss: Any) -> torch.Tensor:
    """``loss`` when it is a scalar tensor that depends on a parameter."""
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
    return loss


def _run_checks(ctx: Context) -> tuple[list[Finding], dict[str, str]]:
    """Every registered check in order: the findings, and each check's state."""
    checks: dict[str, str] = {}
    findings: list[Finding] = []
    for check in REGISTRY:
        found, na = check.run(ctx)
        findings += found
        checks[check.code] = "found" if found else (f"n/a: {na}" if na else "ok")
    return findings, checks
