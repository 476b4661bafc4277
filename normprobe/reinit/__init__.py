"""Re-initialization schemes and residual-branch scalers, placed through discovery.

`reinit` rewrites the existing parameters in place with ``torch.nn.init`` (the same Parameter
objects, so an optimizer built earlier stays valid). `insert_branch_scale` wraps the last module
of every residual branch in a `BranchScale`. Which layers write into the residual stream, how many
blocks a stack has and how many layers a branch has all come from `normprobe.discover`; no layer
is found by its attribute name.

Layout: `api` (`reinit`, `reinit_with_report`), `scheme` (what a scheme declares), `schemes/`
(one module per scheme), `target` (the model, its map and what a scheme selects), `branches`
(the ends of residual branches), `branch_scale` (inserting and removing scalers), `weights`
(weight layers and their parametrized tensors), `report` (`ReinitReport`).
"""

from ..layers.branch_scale import BranchScale, FixupScalars, branch_scales
from .api import reinit, reinit_with_report
from .branch_scale import (
    BRANCH_SCALES,
    BranchScaleKind,
    cait_init,
    insert_branch_scale,
    remove_branch_scale,
)
from .report import ReinitReport, TensorInit
from .scheme import Scheme
from .schemes import SCHEMES
from .schemes.deepnorm import deepnorm_constants, deepnorm_encoder_decoder_constants
from .weights import is_transposed, is_weight_layer, out_in_view

__all__ = [
    "BRANCH_SCALES",
    "SCHEMES",
    "BranchScale",
    "BranchScaleKind",
    "FixupScalars",
    "ReinitReport",
    "Scheme",
    "TensorInit",
    "branch_scales",
    "cait_init",
    "deepnorm_constants",
    "deepnorm_encoder_decoder_constants",
    "insert_branch_scale",
    "is_transposed",
    "is_weight_layer",
    "out_in_view",
    "reinit",
    "reinit_with_report",
    "remove_branch_scale",
]
