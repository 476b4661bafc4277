"""What `diagnose` reads from the weights, through `normprobe.reinit`'s helpers.

Which modules are weight layers, a layer's fan-in gain, and which branches carry DeepNorm's
fixed scales.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..reinit import branch_scales, is_weight_layer, out_in_view


def weight_layer_paths(modules: dict[str, nn.Module]) -> list[str]:
    """The paths of the weight layers among ``modules``, embeddings left out."""
    return [p for p, m in modules.items() if is_weight_layer(m) and not isinstance(m, nn.Embedding)]


def fan_in_gain(layer: nn.Module) -> float:
    """``fan_in * Var(W)`` of ``layer``'s weight (NaN without a matrix weight)."""
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim < 2:
        return math.nan
    return float(out_in_view(layer, w)[0].numel() * w.detach().float().var())


def deepnorm_scaled(model: nn.Module) -> set[str]:
    """The paths of the layers that carry DeepNorm's fixed branch scales."""
    return {p for p, b in branch_scales(model).items() if b.kind == "deepnorm"}
