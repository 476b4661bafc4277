"""Small helpers several parts of normprobe share."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# the defaults every way in shares: a logged step every 50, and at most 64 per-block scalar tags
EVERY = 50
MAX_BLOCK_TAGS = 64


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_writer() -> bool:
    """Whether this process writes: the only one, or global rank zero."""
    import torch.distributed as dist

    return world_size() == 1 or dist.get_rank() == 0


def check_every(every: Any) -> None:
    """Raise a ValueError naming ``every`` unless it is a positive integer number of steps."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"`every` must be a positive integer number of steps, got {every!r}")


def spread(n: int, cap: int) -> list[int]:
    """Indices ``0..n-1``: all of them up to ``cap``, else ``cap`` spread evenly (first and
    last included)."""
    if n <= cap:
        return list(range(n))
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns, or was compiled in place
    (``module.compile()``, or by Lightning)."""
    return (
        hasattr(module, "_orig_mod")
        or getattr(module, "_compiled_call_impl", None) is not None
        or getattr(module, "_compiler_ctx", None) is not None
    )


def example_call(
    model: nn.Module,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    own: bool = True,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional, keyword) inputs for one forward of ``model``, from what a user passed.

    A tensor is the one positional input; a mapping (a tokenizer's output) holds keyword inputs.
    With neither given and ``own``, the inputs the model carries are used: transformers'
    ``dummy_inputs``, Lightning's ``example_input_array``, moved to the model's device.
    """
    if isinstance(example_inputs, Mapping):
        if example_kwargs:
            raise TypeError(
                "example_inputs is a mapping (keyword inputs) and example_kwargs is given too: "
                "pass the keyword inputs once, as example_kwargs={...}"
            )
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    if args or kwargs or not own:
        return args, kwargs
    carried = getattr(model, "example_input_array", None)
    if carried is None:
        carried = _dummy_inputs(model)
    if carried is None:
        return (), {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if isinstance(carried, Mapping):
        return (), {k: _moved(v, device) for k, v in carried.items()}
    carried = carried if isinstance(carried, tuple | list) else (carried,)
    return tuple(_moved(x, device) for x in carried), {}


def _dummy_inputs(model: nn.Module) -> Any:
    """transformers' ``dummy_inputs``, when the model's forward names every one of them (the
    generic ones are token ids, which a vision model does not take)."""
    try:
        dummy = getattr(model, "dummy_inputs", None)
    except Exception:  # a property that cannot build its inputs for this config
        return None
    if not isinstance(dummy, Mapping):
        return None
    named = inspect.signature(model.forward).parameters
    return dummy if all(k in named for k in dummy) else None


def _moved(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x
