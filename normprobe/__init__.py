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
from .runtime import METRICS, Probe, attach
from .sinks import Record, TensorBoardSink

__version__ = "0.1.0.dev0"

__all__ = [
    "METRICS",
    "Anchor",
    "Attention",
    "DiscoveryWarning",
    "ModelMap",
    "NormLayer",
    "Probe",
    "Record",
    "ResidualAdd",
    "Stack",
    "TensorBoardSink",
    "__version__",
    "attach",
    "discover",
    "discover_on_first_forward",
]
