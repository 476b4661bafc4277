"""muP (Yang et al., Tensor Programs V): width-aware init (`shapes`), per-layer learning rates
(`param_groups`), coord check (`coords`)."""

from .coords import COORD_PANEL_SIZE, CoordTable, coord_check
from .param_groups import Optimizer, mup_param_groups
from .shapes import MupKind, MupShape, mup, mup_shapes

__all__ = [
    "COORD_PANEL_SIZE",
    "CoordTable",
    "MupKind",
    "MupShape",
    "Optimizer",
    "coord_check",
    "mup",
    "mup_param_groups",
    "mup_shapes",
]
