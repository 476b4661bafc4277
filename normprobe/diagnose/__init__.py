"""`diagnose`: one forward/backward on a batch, and a short report of what looks wrong.

* `api`: `diagnose` itself, the one probed step and the checks run in order;
* `capture`: diagnose's own hooks on that step (BatchNorm batch sizes, norm inputs, ReLU pairs);
* `layers`: each weight layer's forward and backward gain, and the layers and blocks that jump;
* `checks`: one file per check, holding its title, thresholds and logic; `checks.REGISTRY`;
* `inputs`: the batch and the loss; `result`: `Finding`, `Diagnosis` and its JSON document;
* `weights`: what the checks read from the weights (`normprobe.reinit`'s helpers);
* `cli`: ``normprobe diagnose module:function``.
"""

from __future__ import annotations

from .api import diagnose
from .checks import CHECKS
from .checks.attention_logits import ATTN_LOGIT_MAX
from .inputs import default_loss, loss_caller
from .result import DIAGNOSE_SCHEMA, DiagnoseInputError, Diagnosis, Finding

__all__ = [
    "ATTN_LOGIT_MAX",
    "CHECKS",
    "DIAGNOSE_SCHEMA",
    "DiagnoseInputError",
    "Diagnosis",
    "Finding",
    "default_loss",
    "diagnose",
    "loss_caller",
]
