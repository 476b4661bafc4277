"""The ends of residual branches: where a scale or a zero goes, and the branches refused.

`branch_ends` finds the last module of each branch (a writer, or the norm after it on the
branch); `check_placeable` and `check_skip_gains` refuse, before any change, a branch a scheme
cannot act on; `channels_of` tells how a scale on a module's output is laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..discovery import ResidualAdd
from ..layers.branch_scale import Wrapper
from .target import Target
from .weights import CONVS, out_dim


def parent_wrapper(model: nn.Module, path: str) -> nn.Module | None:
    """The `Wrapper` holding the module at ``path`` as its ``inner``, if one does."""
    parent_path, dot, _ = path.rpartition(".")
    if not dot:
        return None
    parent = model.get_submodule(parent_path)
    return parent if isinstance(parent, Wrapper) and path.endswith(".inner") else None


def check_placeable(t: Target, a: ResidualAdd) -> None:
    """Refuse a branch whose writers do not carry all it adds to the stream."""
    where = f"the residual add {a.module or '<root>'}#{a.ordinal}"
    if not a.writers:
        raise ValueError(
            f"{t.what}: {where} has no weight layer writing into the stream (only gates "
            f"{list(a.gates)}), so there is no layer to scale; leave it out with a model_map "
            "that drops this add, or scale that branch yourself"
        )
    if a.open_path:
        raise ValueError(
            f"{t.what}: a path of the branch of {where} reaches the add without passing a weight "
            f"layer, so scaling its writers {list(a.writers)} would not scale all it adds; "
            "scale that branch yourself"
        )


def check_skip_gains(t: Target, adds: Sequence[ResidualAdd], unit_ok: bool) -> None:
    """Refuse a skip multiplied by a learned gain (``x * gain + f(x)``) that the scheme cannot
    account for: any such gain (``unit_ok`` False), or one not 1 everywhere, where a scheme
    assumes an identity skip at initialization."""
    for a in adds:
        if a.skip_gain is None:
            continue
        if unit_ok and bool((t.model.get_parameter(a.skip_gain) == 1).all()):
            continue
        raise ValueError(
            f"{t.what}: the skip of the residual add {a.module or '<root>'}#{a.ordinal} is "
            f"multiplied by the learned gain {a.skip_gain!r}"
            + (" (not 1 everywhere)" if unit_ok else "")
            + (
                ", where this scheme assumes an identity skip; set it to 1 first"
                if unit_ok
                else ", which the scheme's alpha would have to replace or join; set the skip's "
                "alpha yourself, or use 'gpt2' or 'fixup' (with the gain at 1)"
            )
        )


def branch_ends(t: Target, adds: Sequence[ResidualAdd]) -> dict[int, list[str]]:
    """For each add (by index), the last module on each path of its branch: each writer, or the
    norm that follows it on the branch (a sandwich norm, ResNet's BatchNorm after conv2)."""
    norms = {n.path: n for n in t.map.norms}
    ends: dict[int, list[str]] = {}
    pending: list[int] = []
    for i, a in enumerate(adds):
        check_placeable(t, a)
        if a.sandwich_norm is not None:
            ends[i] = [a.sandwich_norm]
        elif any(n.role == "branch" for n in norms.values()):
            pending.append(i)
        else:
            ends[i] = list(a.writers)
    if pending:
        watched = {p for p, _ in t.weight_layers()} | {
            p for p, n in norms.items() if n.role == "branch"
        }
        order = t.call_order(watched)
        for i in pending:
            ends[i] = []
            for out in adds[i].writers:
                end = out
                if out in order:
                    for path in order[order.index(out) + 1 :]:
                        if path not in norms:
                            break
                        end = path
                ends[i].append(end)
    return {i: _outermost(paths) for i, paths in ends.items()}


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` less those inside another of them: a LoRA layer's ``lora_b`` writes through
    the layer, whose output a scale on the layer already covers (a second swap would land on
    the new wrapper, leaving a scale that is never called)."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def channels_of(t: Target, path: str) -> tuple[int, int, float | None]:
    """(channels, channel dim, gain offset if a norm) of the module output at ``path``."""
    module = t.module(path)
    norm = next((n for n in t.map.norms if n.path == path), None)
    if norm is not None:
        channel_dim = -1 if norm.layout == "channels-last" else 1
        count = norm.dims[0] if norm.dims else 0
        return count, channel_dim, norm.gain_offset
    weight = next(p for _, p in t.applied.of(module) if p.ndim >= 2)
    channel_dim = 1 if isinstance(module, CONVS) else -1
    return weight.shape[out_dim(module)], channel_dim, None


def scale_value(like: torch.Tensor, value: float, channels: int | None) -> torch.Tensor:
    """A scale of ``value``: a scalar, or one per channel; dtype and device of ``like``."""
    shape = () if channels is None else (channels,)
    return torch.full(shape, value, dtype=like.dtype, device=like.device)


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` in place of the module at ``path``."""
    if not path:
        raise ValueError("cannot replace the root module of the model")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, name, new)
