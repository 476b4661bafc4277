"""Tensors nested in tuples, lists and dicts (a module's inputs and outputs, a ``ModelOutput``):
walking them, reading and replacing one by its key path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

Key = tuple[str | int, ...]


def iter_tensors(obj: Any, prefix: Key = ()) -> Iterator[tuple[Key, torch.Tensor]]:
    """Yield (key path, tensor) for tensors nested in tuples, lists and dicts (ModelOutput too)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str | int):
                yield from iter_tensors(v, (*prefix, k))
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, (*prefix, i))


def get_by_key(obj: Any, key: Key) -> Any:
    """Follow a key path produced by `iter_tensors`."""
    for k in key:
        obj = obj[k]
    return obj


def replace_at(obj: Any, key: Key, value: Any) -> Any:
    """A copy of nested tuples, lists and dicts ``obj`` with the entry at ``key`` replaced."""
    if not key:
        return value
    head, rest = key[0], key[1:]
    if isinstance(obj, tuple):
        return tuple(replace_at(v, rest, value) if i == head else v for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [replace_at(v, rest, value) if i == head else v for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return {k: replace_at(v, rest, value) if k == head else v for k, v in obj.items()}
    return obj


def first_float(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in nested tuples, lists and dicts (or ``obj`` itself)."""
    first = obj  # the common case, a tensor first in (args, kwargs), without a generator
    while isinstance(first, tuple | list) and first:
        first = first[0]
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return first
    for _, t in iter_tensors(obj):
        if t.is_floating_point():
            return t
    return None
