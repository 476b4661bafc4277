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


def __getattr__(name: str) -> object:
    # the Lightning callback imports lightning, an optional dependency: load it on first use
    if name == "NormProbe":
        from .lightning import NormProbe

        return NormProbe
    raise AttributeError(f"module 'normprobe' has no attribute {name!r}")


__all__ = [
    "METRICS",
    "Anchor",
    "Attention",
    "DiscoveryWarning",
    "ModelMap",
    "NormLayer",
    "NormProbe",
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
