"""Discovery: what a model contains (norms, stacks, residual adds, attention, output head)."""

from .builder import DiscoveryWarning
from .mapping import discover, discover_on_carried, discover_on_first_forward
from .model_map import Anchor, Attention, Doubt, ModelMap, NormLayer, ResidualAdd, Stack

__all__ = [
    "Anchor",
    "Attention",
    "DiscoveryWarning",
    "Doubt",
    "ModelMap",
    "NormLayer",
    "ResidualAdd",
    "Stack",
    "discover",
    "discover_on_carried",
    "discover_on_first_forward",
]
