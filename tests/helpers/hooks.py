"""Counting the hooks on a model's modules: what normprobe must leave as it found."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

# Per-module hook dicts that must be back to their counts after normprobe is done.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def hooks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each module's number of hooks in every hook dict, by path."""
    return {
        path: tuple(len(getattr(m, attr)) for attr in HOOK_DICTS)
        for path, m in model.named_modules()
    }


def no_hooks(model: nn.Module, baseline: Mapping[str, tuple[int, ...]] | None = None) -> bool:
    """No hook left but the model's own (``baseline``: `hooks` of the model as built; a module
    at a path it does not name has none)."""
    own = baseline or {}
    return all(counts == own.get(path, (0,) * len(counts)) for path, counts in hooks(model).items())


def hook_count(model: nn.Module) -> int:
    """Every forward and backward hook registered on any module of ``model`` (the first four
    dicts of `HOOK_DICTS`: the other three flag hooks these hold)."""
    return sum(sum(counts[:4]) for counts in hooks(model).values())
