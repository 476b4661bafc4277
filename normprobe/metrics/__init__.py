"""The metric families: one file each, listed here in the order the dashboard shows them.

A family declares what it reads on the `normprobe.ModelMap`, how it reduces on the device,
the tags it writes (`normprobe.tags`), how `normprobe report` summarizes and flags them, and
its thresholds. `METRICS`, the TensorBoard layout, `report`'s table and flags, and the
thresholds `diagnose` compares against all come from here.
"""

from __future__ import annotations

import difflib

from .attn_entropy import AttnEntropy
from .attn_logits import AttnLogits
from .attn_logits_head import AttnLogitsHead
from .bn_stats import BnStats
from .core.base import Family, Flag, Series
from .grad_norm import GradNorm
from .logits import Logits
from .nonfinite import NonFinite
from .norm_gain import NormGain
from .norm_rms import NormRms
from .outliers import Outliers
from .resid_cos import ResidCos
from .resid_rms import ResidRms
from .spikes import Spikes
from .update_ratio import UpdateRatio
from .weight_rms import WeightRms

# most telling first: the dashboard and the report's rows follow this order
FAMILIES: tuple[Family, ...] = (
    ResidRms(),
    GradNorm(),
    ResidCos(),
    Outliers(),
    AttnLogits(),
    AttnLogitsHead(),
    AttnEntropy(),
    Logits(),
    UpdateRatio(),
    WeightRms(),
    NormRms(),
    NormGain(),
    BnStats(),
    NonFinite(),
    Spikes(),
)
METRICS: dict[str, str] = {f.name: f.description for f in FAMILIES}
DEFAULTS: tuple[str, ...] = tuple(f.name for f in FAMILIES if not f.opt_in)  # metrics=None
SERIES: dict[str, Series] = {s.name: s for f in FAMILIES for s in f.series}


def family(name: str) -> Family:
    """The family called ``name``; ValueError lists the names there are."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(unknown_metric(name))


def chosen(metrics: object) -> tuple[str, ...]:
    """Family names from a user's ``metrics=`` (None: all but the opt-in ones), checked."""
    if metrics is None:
        return DEFAULTS
    names = [metrics] if isinstance(metrics, str) else list(metrics)  # type: ignore[call-overload]
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise ValueError(unknown_metric(unknown[0]))
    return tuple(names)


def unknown_metric(name: object) -> str:
    """The message for a metric name that is no family's: the closest family name (or the
    family writing a series of that name), then every valid name."""
    text = str(name)
    writer = next((f.name for f in FAMILIES for s in f.series if s.name == text), None)
    if writer is not None:
        hint = f"{text!r} is a series the {writer!r} family writes: metrics=[{writer!r}]"
    else:
        close = difflib.get_close_matches(text, METRICS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "no metric has a similar name"
    return f"unknown metric {name!r} ({hint}); the metrics are {', '.join(METRICS)}"


__all__ = [
    "DEFAULTS",
    "FAMILIES",
    "METRICS",
    "SERIES",
    "Family",
    "Flag",
    "Series",
    "chosen",
    "family",
    "unknown_metric",
]
