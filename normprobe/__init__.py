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
from .layers import DyT
from .runtime import METRICS, Probe, attach
from .sinks import Record, TensorBoardSink
from .surgery import (
    HYBRIDNORM,
    Conversion,
    ConversionReport,
    ConversionWarning,
    convert_norms,
    convert_norms_with_report,
)

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> object:
    # the Lightning callback imports lightning, an optional dependency: load it on first use
    if name == "NormProbe":
        from .lightning import NormProbe

        return NormProbe
    raise AttributeError(f"module 'normprobe' has no attribute {name!r}")


__all__ = [
    "HYBRIDNORM",
    "METRICS",
    "Anchor",
    "Attention",
    "Conversion",
    "ConversionReport",
    "ConversionWarning",
    "DiscoveryWarning",
    "DyT",
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
    "convert_norms",
    "convert_norms_with_report",
    "discover",
    "discover_on_first_forward",
]
