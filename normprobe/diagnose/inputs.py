"""What `diagnose` is given: the batch as the model's arguments, and the loss to backpropagate."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..nested import iter_tensors
from .result import DiagnoseInputError

Batch = torch.Tensor | tuple[Any, ...] | list[Any] | dict[str, Any]
# ``loss_fn(output)`` or ``loss_fn(output, batch)``; see `loss_caller`
LossFn = Callable[[Any], torch.Tensor] | Callable[[Any, Any], torch.Tensor]
LOSS_FN_FORMS = "loss_fn(output) or loss_fn(output, batch)"


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


def split_batch(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``batch`` as the model's (positional, keyword) arguments."""
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
