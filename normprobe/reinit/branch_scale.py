"""Putting learnable scales on residual branches (`insert_branch_scale`) and taking them out
again (`remove_branch_scale`, folding each scale into the layer it wraps).

The `BranchScale` module itself is one of `normprobe.layers`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import nn

from ..discovery import ModelMap, is_bias_name
from ..layers.branch_scale import BranchScale, branch_scales
from .branches import branch_ends, channels_of, replace_module, scale_value
from .target import Target
from .weights import Applied, direct_params, is_layer, out_dim

BranchScaleKind = Literal["rezero", "layerscale", "skipinit"]
BRANCH_SCALES: tuple[str, ...] = get_args(BranchScaleKind)

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def cait_init(depth: int) -> float:
    """CaiT's LayerScale starting value for a model of ``depth`` blocks (Touvron et al. 2021).

    Args:
        depth: the number of blocks.

    Returns:
        0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 beyond.

    Example::

        >>> from normprobe.reinit import cait_init
        >>> cait_init(36)   # 1e-06
    """
    if depth <= 18:
        return 0.1
    return 1e-5 if depth <= 24 else 1e-6


def insert_branch_scale(
    model: ModuleT,
    kind: BranchScaleKind,
    *,
    init: float | Literal["cait"] | None = None,
    example_inputs: Sequence[Any] | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    model_map: ModelMap | None = None,
) -> ModuleT:
    """Put a learnable scale on the end of every residual branch: ``x + scale * f(x)``.

    The last module of each branch (its last weight layer, or the norm that follows it on the
    branch: Gemma's sandwich norm, ResNet's BatchNorm) is wrapped in a `BranchScale`, so the scale
    acts on exactly what the branch adds to the stream. The wrapped module keeps its parameters
    and hooks; its state_dict keys gain ``.inner`` and the scale is ``.scale``.

    * ``rezero`` (Bachlechner et al. 2020) and ``skipinit`` (De & Smith 2020): one scalar per
      branch, ``init`` 0 by default, so the model starts as the identity on its residual stream.
    * ``layerscale`` (CaiT, Touvron et al. 2021): one factor per channel, ``init`` 1e-5 by
      default; ``init="cait"`` picks 0.1 / 1e-5 / 1e-6 for up to 18 / 24 / more blocks.

    Args:
        model: the model; changed in place.
        kind: ``rezero``, ``layerscale`` or ``skipinit``.
        init: the starting value (a finite number), or ``"cait"`` for LayerScale.
        example_inputs: positional inputs for one forward (discovery needs them).
        example_kwargs: keyword inputs for that forward.
        model_map: a map from ``normprobe.discover`` to use instead of discovering again.

    Returns:
        ``model``. Build the optimizer afterwards: the scales are new parameters.

    Raises:
        ValueError: unknown kind, a bad ``init``, no residual branches found, or a doubt of the
            map affecting ``insert_branch_scale`` (one about the depth only with
            ``init="cait"``), before any change.
        RuntimeError: the model already has branch scalers.

    Example::

        >>> model = normprobe.insert_branch_scale(model, "rezero", example_inputs=(ids,))
        >>> model = normprobe.insert_branch_scale(vit, "layerscale", init="cait",
        ...                                       example_inputs=(images,))
    """
    _check_request(model, kind, init)
    t = Target(
        model, f"insert_branch_scale(model, {kind!r})", example_inputs, example_kwargs, model_map
    )
    way_out = (
        "Fix the map" if init != "cait" else "Give init= a number if only the depth is in doubt"
    )
    t.refuse_doubts("insert_branch_scale", init == "cait", way_out)
    adds = t.adds()
    ends = branch_ends(t, adds)
    swaps: dict[str, BranchScale] = {}
    for i, path in ((i, path) for i, paths in ends.items() for path in paths):
        if path in swaps:
            continue
        if init == "cait":
            value = cait_init(t.depth(adds[i]))
        elif init is None:
            value = 1e-5 if kind == "layerscale" else 0.0
        else:
            value = float(init)
        module = t.module(path)
        # the scale's dtype and device: the end's own parameters, else its branch's writers'
        # (an affine-free norm ends it: MONAI's InstanceNorm)
        held = [module, *(t.module(w) for w in adds[i].writers)]
        like = next((p for m in held for p in m.parameters()), None)
        if like is None:
            raise ValueError(
                f"the branch of the add in {adds[i].module!r} ends in {path!r}, and neither it "
                "nor the branch's writers hold a parameter to take the scale's dtype and "
                "device from"
            )
        channels, channel_dim, offset = channels_of(t, path)
        per_channel = channels if kind == "layerscale" else None
        swaps[path] = BranchScale(
            module, kind, scale_value(like, value, per_channel), channel_dim, True, offset
        )
    for path, new in swaps.items():
        replace_module(model, path, new)
    return model


def _check_request(model: nn.Module, kind: str, init: Any) -> None:
    """Refuse an unknown ``kind``, a bad ``init`` and a model that has branch scalers already."""
    if kind not in BRANCH_SCALES:
        raise ValueError(f"unknown branch scale {kind!r}; expected one of {list(BRANCH_SCALES)}")
    if init == "cait":
        if kind != "layerscale":
            raise ValueError(f"init='cait' is CaiT's LayerScale rule; {kind!r} takes a number")
    elif init is not None and (
        isinstance(init, bool) or not isinstance(init, int | float) or not math.isfinite(init)
    ):
        raise ValueError(f"init must be a finite number or 'cait', got {init!r}")
    existing = branch_scales(model) if isinstance(model, nn.Module) else {}
    if existing:
        path, first = next(iter(existing.items()))
        raise RuntimeError(
            f"the model already has {len(existing)} branch scalers ({first.kind} at {path!r}); "
            "inserting more would stack them. Remove them first with "
            "normprobe.remove_branch_scale(model, fold=True), which keeps the function"
        )


def remove_branch_scale(model: ModuleT, *, fold: bool = True) -> ModuleT:
    """Take out every `BranchScale`, putting the wrapped module back in its place.

    Args:
        model: a model with branch scalers.
        fold: multiply each scale into the wrapped layer's weight and bias (or the wrapped norm's
            gain and bias) first, so the model computes the same function, as
            ``remove_parametrizations(leave_parametrized=True)`` keeps the value. ``False`` drops
            the scale.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: ``fold=True`` and a scale sits on a module without a gain to fold into.

    Example::

        >>> model = normprobe.remove_branch_scale(model)   # after training with LayerScale
    """
    found = branch_scales(model)
    if fold:
        applied = Applied()
        for path, wrapper in found.items():
            _fold(path, wrapper, applied)
        applied.commit()
    replacements = [(path, wrapper.inner) for path, wrapper in found.items()]
    for path, inner in replacements:
        replace_module(model, path, inner)
    return model


def _fold(path: str, wrapper: BranchScale, applied: Applied) -> None:
    inner = wrapper.inner
    scale = wrapper.scale.detach()
    with torch.no_grad():
        if is_layer(inner):
            for _, p in applied.of(inner):
                dim = out_dim(inner) if p.ndim >= 2 else 0
                p.mul_(scale if scale.ndim == 0 else _along(scale, dim, p.ndim))
            return
        params = direct_params(inner)
        if wrapper.gain_offset is None or not params:
            raise ValueError(
                f"cannot fold the scale at {path!r} into {type(inner).__name__}, which has no "
                "gain; pass fold=False to drop the scale instead"
            )
        for name, p in params:
            if is_bias_name(name):
                p.mul_(scale)
            else:
                offset = wrapper.gain_offset
                p.copy_((p + offset) * scale - offset)


def _along(vector: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return vector.view(shape)
