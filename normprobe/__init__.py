"""normprobe: see and change the normalization, residual and initialization behaviour of a model."""

from .discovery import (
    Anchor,
    Attention,
    DiscoveryWarning,
    ModelMap,
    NormLayer,
    ResidualAdd,
    Stack,
    discover,
    discover_on_first_forward,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "Anchor",
    "Attention",
    "DiscoveryWarning",
    "ModelMap",
    "NormLayer",
    "ResidualAdd",
    "Stack",
    "__version__",
    "discover",
    "discover_on_first_forward",
]
