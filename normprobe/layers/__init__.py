"""Modules normprobe puts into a model: the norm layers `convert_norms` builds (`norms`) and the
scalers put on residual branches (`branch_scale`)."""

from .branch_scale import BranchScale, FixupScalars, branch_scales
from .norms import BatchNormNd, DyT, LayerNorm2d, PerHeadLayerNorm, PerHeadRMSNorm, RMSNorm2d

__all__ = [
    "BatchNormNd",
    "BranchScale",
    "DyT",
    "FixupScalars",
    "LayerNorm2d",
    "PerHeadLayerNorm",
    "PerHeadRMSNorm",
    "RMSNorm2d",
    "branch_scales",
]
