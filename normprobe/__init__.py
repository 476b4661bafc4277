"""normprobe: see and change the normalization, residual and initialization behaviour of a model."""

from .dashboard import dashboard_url
from .diagnose import DiagnoseInputError, Diagnosis, Finding, diagnose
from .discovery import (
    Attention,
    DiscoveryWarning,
    Doubt,
    ModelMap,
    NormLayer,
    ResidualAdd,
    Stack,
    discover,
    discover_on_first_forward,
)
from .layers import DyT
from .metrics import Flag
from .metrics.attn_logits_head import qk_clip_factors
from .mup import CoordTable, MupShape, coord_check, mup, mup_param_groups, mup_shapes
from .reinit import (
    BranchScale,
    FixupScalars,
    ReinitReport,
    TensorInit,
    branch_scales,
    insert_branch_scale,
    reinit,
    reinit_with_report,
    remove_branch_scale,
)
from .report import Comparison, RunReport, Trend, compare_runs, find_runs
from .report import report as report_run
from .runtime import METRICS, Probe, Spikes, attach, attached_probe
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
    "Comparison",
    "Conversion",
    "ConversionReport",
    "ConversionWarning",
    "CoordTable",
    "DiagnoseInputError",
    "Diagnosis",
    "DiscoveryWarning",
    "Doubt",
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
    "ReinitReport",
    "ResidualAdd",
    "RunReport",
    "Sink",
    "Spikes",
    "Stack",
    "TensorBoardSink",
    "TensorInit",
    "Trend",
    "__version__",
    "attach",
    "attached_probe",
    "branch_scales",
    "compare_runs",
    "convert_norms",
    "convert_norms_with_report",
    "coord_check",
    "dashboard_url",
    "diagnose",
    "discover",
    "discover_on_first_forward",
    "find_runs",
    "insert_branch_scale",
    "mup",
    "mup_param_groups",
    "mup_shapes",
    "qk_clip_factors",
    "reinit",
    "reinit_with_report",
    "remove_branch_scale",
    "report_run",
]
