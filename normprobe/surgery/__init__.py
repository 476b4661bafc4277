"""`convert_norms`: swap a model's normalization layers for another kind, in place.

The steps, one module each: `api` (the two entry points and their argument checks), `select`
(finding the norm layers and choosing which become what), `layout` (what each one's statistics
run over), `plan` (deciding everything, refusing before the model is touched), `builders` (a
registry of one builder per target), `build` (a new layer with the old state placed in it),
`fidelity` (old and new outputs compared), `commit` (placing the new layers, optimizer),
`hooks` (carried over or kept quiet), `report` (what was done) and `targets` (the names it
takes).
"""

from .api import convert_norms, convert_norms_with_report
from .report import Conversion, ConversionReport, ConversionWarning
from .targets import HYBRIDNORM, POSITIONS, ROLES, TARGETS, Target

__all__ = [
    "HYBRIDNORM",
    "POSITIONS",
    "ROLES",
    "TARGETS",
    "Conversion",
    "ConversionReport",
    "ConversionWarning",
    "Target",
    "convert_norms",
    "convert_norms_with_report",
]
