"""A norm module's forward and backward hooks: carried over to its replacement, or kept quiet
while the module runs on made-up inputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

HOOK_ATTRS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def carry_hooks(old: nn.Module, new: nn.Module) -> int:
    """Move forward/backward hooks by sharing the hook dicts, so old handles still remove them."""
    count = 0
    for attr in HOOK_ATTRS:
        hooks = getattr(old, attr)
        if attr in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_pre_hooks",
            "_backward_hooks",
        ):
            count += len(hooks)
        setattr(new, attr, hooks)
    new._is_full_backward_hook = old._is_full_backward_hook
    return count


@contextmanager
def quiet(m: nn.Module) -> Iterator[None]:
    """``m`` without its hooks for the duration: they stay quiet on made-up inputs."""
    hooks = {attr: getattr(m, attr) for attr in HOOK_ATTRS}
    try:
        for attr, value in hooks.items():
            setattr(m, attr, type(value)())
        yield
    finally:
        for attr, value in hooks.items():
            setattr(m, attr, value)
