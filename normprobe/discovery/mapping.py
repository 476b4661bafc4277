"""`discover`: one read-only call that maps a model's norms, stacks, residual adds and heads."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import norms as norm_rules
from .builder import build_map
from .graph import Graph
from .model_map import ModelMap
from .stacks import skipped_blocks, structural_stacks
from .state import preserved
from .trace import trace


def discover(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> ModelMap:
    """Map what ``model`` contains, without changing it.

    With example inputs, observes one forward pass (under ``no_grad``, in the model's current
    train/eval mode; a second one in eval mode when a block of a container was skipped, as
    LayerDrop does in training) to find residual adds, norm roles, attention, the output head
    and the behaviour of norm classes it does not know. Without them, reports what the module
    tree alone shows. Parameters, buffers, hooks, training modes and the random number
    generators are the same afterwards.

    Args:
        model: any ``nn.Module``.
        *example_args: positional inputs for one forward call.
        **example_kwargs: keyword inputs for it (``input_ids=...`` for HF models).

    Returns:
        A `ModelMap`; ``print()`` it for a table.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        Exception: whatever the model's forward raises on the example inputs, with a note that
            discovery was running.

    Example::

        >>> m = normprobe.discover(model, torch.randint(0, 100, (2, 16)))
        >>> print(m)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"discover() needs a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}"
        )
    traced = bool(example_args or example_kwargs)
    candidates = {
        id(m) for m in model.modules() if norm_rules.is_probe_candidate(m) or _named_norm(m)
    }
    g: Graph | None = None
    # behaviour probes call modules too: an attached probe's hooks stay silent until the end
    with read_only(model):  # modes restored on exit
        start = time.perf_counter()
        if traced:
            try:
                g = trace(model, example_args, example_kwargs, lambda m: id(m) in candidates)
                if model.training and skipped_blocks(structural_stacks(model), g):
                    # LayerDrop or stochastic depth skipped a block: in eval mode every one runs
                    model.eval()
                    g = trace(model, example_args, example_kwargs, lambda m: id(m) in candidates)
            except Exception as err:
                err.add_note(
                    "(raised while normprobe.discover ran one forward pass of "
                    f"{type(model).__name__} on the example inputs it was given; "
                    "pass inputs that model(*args, **kwargs) accepts)"
                )
                raise
        trace_ms = (time.perf_counter() - start) * 1e3
        return build_map(model, g, trace_ms)


def discover_on_carried(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ModelMap:
    """`discover` on inputs the model carries (transformers' ``dummy_inputs``, which the user
    did not choose): the module tree alone when the model does not run on them, as an
    encoder-decoder's dummy inputs without decoder ids or a dual encoder's without images."""
    try:
        return discover(model, *args, **kwargs)
    except Exception:
        return discover(model)


def _named_norm(m: nn.Module) -> bool:
    return norm_rules.name_match(m) is not None and not norm_rules.has_param_children(m)


def discover_on_first_forward(
    model: nn.Module, callback: Callable[[ModelMap], None]
) -> RemovableHandle:
    """Discover ``model`` on the inputs of its next forward call, then pass the map on.

    The forward itself then runs as usual. Returns the handle of the one-shot hook, to cancel
    it before that forward happens.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__qualname__}")

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        callback(discover(module, *args, **kwargs))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return handle


@contextmanager
def read_only(model: nn.Module, silence_hooks: bool = True) -> Iterator[None]:
    """No grad, forked RNGs; buffers (BatchNorm statistics) and modes restored on exit.

    The model's own forward hooks run (a forward may need them: transformers collects hidden
    states with hooks); normprobe's own hooks (an attached probe's) are silenced meanwhile,
    unless ``silence_hooks`` is False. FSDP2 modules are resharded on exit, as they were before.
    """
    # (live hook dict, its key order, normprobe's hooks taken out): edited in place, so hooks
    # the forward itself installs (transformers' output capturing) stay installed
    silenced: list[tuple[dict[int, Any], list[int], dict[int, Any]]] = []
    if silence_hooks:
        for m in model.modules():
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                live = getattr(m, name)
                ours = {k: h for k, h in live.items() if _is_normprobe_hook(h)}
                if ours:
                    silenced.append((live, list(live), ours))
                    for k in ours:
                        del live[k]
    try:
        with preserved(model), torch.no_grad():
            yield
    finally:
        for live, order, ours in silenced:
            rank = {k: i for i, k in enumerate(order)}
            items = sorted({**live, **ours}.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            live.clear()
            live.update(items)
        _reshard(model)


def _is_normprobe_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", None)).startswith("normprobe.")


def _reshard(model: nn.Module) -> None:
    """Register FSDP2's sharded parameters again (a forward leaves the root's unsharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module exists
    if fsdp is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()
