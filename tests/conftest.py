"""Shared fixtures: fail any test that leaves global hooks or torch function modes behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.overrides import _get_current_function_mode_stack

_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def hook_count(model: nn.Module) -> int:
    """Every forward and backward hook registered on any module of ``model``."""
    total = 0
    for m in model.modules():
        total += len(m._forward_pre_hooks) + len(m._forward_hooks)
        total += len(m._backward_pre_hooks) + len(m._backward_hooks)
    return total


@pytest.fixture(autouse=True)
def _no_global_hooks_left() -> Iterator[None]:
    before = {name: len(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}
    yield
    after = {name: len(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}
    assert after == before, f"global module hooks left behind: {after} (before {before})"
    assert not _get_current_function_mode_stack(), "a TorchFunctionMode is still active"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
