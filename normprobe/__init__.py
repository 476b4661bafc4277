"""normprobe: see and change the normalization, residual and initialization behaviour of a model."""

from .diagnose import DiagnoseInputError, Diagnosis, Finding, diagnose
from .discovery import (
    Attention,
    DiscoveryWarning,
    ModelMap,
    NormLayer,
    ResidualAdd,
    Stack,
    discover,
    discover_on_first_forward,
)
from .init import (
    BranchScale,
    FixupScalars,
    branch_scales,
    insert_branch_scale,
    reinit,
    remove_branch_scale,
)
from .layers import DyT
from .metrics import Flag
from .muparam import CoordTable, MupShape, coord_check, mup, mup_param_groups, mup_shapes
from .report import RunReport, Trend, find_runs
from .report import report as report_run
from .runtime import METRICS, Probe, attach, attached_probe
from .sinks import MemorySink, Record, Sink, TensorBoardSink
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
    "Attention",
    "BranchScale",
    "Conversion",
    "ConversionReport",
    "ConversionWarning",
    "CoordTable",
    "DiagnoseInputError",
    "Diagnosis",
    "DiscoveryWarning",
    "DyT",
    "Finding",
    "FixupScalars",
    "Flag",
    "MemorySink",
    "ModelMap",
    "MupShape",
    "NormLayer",
    "NormProbe",
    "Probe",
    "Record",
    "ResidualAdd",
    "RunReport",
    "Sink",
    "Stack",
    "TensorBoardSink",
    "Trend",
    "__version__",
    "attach",
    "attached_probe",
    "branch_scales",
    "convert_norms",
    "convert_norms_with_report",
    "coord_check",
    "diagnose",
    "discover",
    "discover_on_first_forward",
    "find_runs",
    "insert_branch_scale",
    "mup",
    "mup_param_groups",
    "mup_shapes",
    "reinit",
    "remove_branch_scale",
    "report_run",
]
