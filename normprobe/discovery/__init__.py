"""Discovery: what a model contains (norms, stacks, residual adds, attention, output head).

What the rest of normprobe uses of it is exported here: `discover` and the map's types; running
a model without changing it (`read_only`, `preserved`); the doubts a map reports and the
refusals they cause (`refusal`, `block_glob`, `DEPTH_DOUBTS`, `Action`); and, for reading
attention logits inside a forward, the ops discovery tells apart by name and its rules for
following logits (`carries_logits`, `mixes_heads`, `scripted_functions_as_python`).
"""

from .attention import LOGIT_MASK_OPS, LOGIT_SCALE_OPS, carries_logits, mixes_heads
from .builder import DiscoveryWarning
from .doubts import DEPTH_DOUBTS, block_glob, refusal
from .mapping import (
    discover,
    discover_on_carried,
    discover_on_first_forward,
    read_only,
)
from .model_map import (
    Action,
    Anchor,
    Attention,
    Doubt,
    ModelMap,
    NormLayer,
    ResidualAdd,
    Stack,
    inside,
    is_bias_name,
)
from .ops import ADD_OPS, FIRST_ONLY_OPS, MATMUL_OPS, SDPA_OPS, SOFTMAX_OPS, WEIGHT_OPS
from .state import ParameterWrites, preserved
from .trace import scripted_functions_as_python

__all__ = [
    "ADD_OPS",
    "DEPTH_DOUBTS",
    "FIRST_ONLY_OPS",
    "LOGIT_MASK_OPS",
    "LOGIT_SCALE_OPS",
    "MATMUL_OPS",
    "SDPA_OPS",
    "SOFTMAX_OPS",
    "WEIGHT_OPS",
    "Action",
    "Anchor",
    "Attention",
    "DiscoveryWarning",
    "Doubt",
    "ModelMap",
    "NormLayer",
    "ParameterWrites",
    "ResidualAdd",
    "Stack",
    "block_glob",
    "carries_logits",
    "discover",
    "discover_on_carried",
    "discover_on_first_forward",
    "inside",
    "is_bias_name",
    "mixes_heads",
    "preserved",
    "read_only",
    "refusal",
    "scripted_functions_as_python",
]
