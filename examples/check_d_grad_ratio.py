"""Sanity check [d]: Post-LN piles gradients at the top of a deep stack, Pre-LN at the bottom,
read through the probe's `grad_norm` metric.

    python examples/check_d_grad_ratio.py [--expect NAME=VALUE ...]

The stack: 48 blocks of one LayerNorm and one Linear (width 64) and a final linear
head (`normprobe.models.ResidualStack`), `torch.manual_seed(0)`, input `randn(16, 64)`, loss
`out.pow(2).mean()`, one forward and backward. `normprobe.attach(..., metrics=["grad_norm"])`
reads every block's gradient norm at `probe.step()` and reports the last/first block ratio as
`normprobe/grad_ratio/<stack>`. This script measures 0.40 for Pre-LN (bottom-heavy) and 2.35 for
Post-LN (top-heavy), expected to two decimals (± 0.005): skews of comparable size in opposite
directions. Large Post-LN gradients near the output at initialization are what Xiong et al. 2020
("On Layer Normalization in the Transformer Architecture") derive, and why Post-LN needs a
learning-rate warmup. Discovery must also name the placements.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from _sanity import Checks, Expect

import normprobe
from normprobe import tags
from normprobe.models import ResidualStack

CHECKS = Checks(
    "d",
    "Pre-LN vs Post-LN top/bottom gradient ratio over 48 blocks, through the probe",
    {
        "pre_ln_placement": Expect("pre-ln", op="=="),
        "pre_ln_ratio": Expect(0.40, tol=0.005),
        "post_ln_placement": Expect("post-ln", op="=="),
        "post_ln_ratio": Expect(2.35, tol=0.005),
    },
)


def grad_ratio(pre_ln: bool) -> tuple[str, float]:
    """(placement of the `lins` stack, its last/first block gradient ratio)."""
    torch.manual_seed(0)
    stack = ResidualStack(48, 64, pre_ln=pre_ln)
    with (
        tempfile.TemporaryDirectory() as log_dir,
        normprobe.attach(stack, metrics=["grad_norm"], log_dir=log_dir) as probe,
    ):
        stack(torch.randn(16, 64)).pow(2).mean().backward()
        probe.step()  # no optimizer given: the step ends here, gradients are read now
    assert probe.latest is not None and probe.model_map is not None
    (lins,) = [s for s in probe.model_map.stacks if s.path == "lins"]
    return lins.placement, probe.latest.scalars[tags.format("grad_ratio", "lins")]


def main() -> int:
    CHECKS.parse()
    for pre_ln, name in ((True, "pre_ln"), (False, "post_ln")):
        label = "Pre-LN" if pre_ln else "Post-LN"
        placement, ratio = grad_ratio(pre_ln)
        CHECKS.check(f"{name}_placement", f"{label} discovered placement", placement)
        CHECKS.check(f"{name}_ratio", f"{label} {tags.format('grad_ratio', 'lins')}", ratio)
    return CHECKS.verdict()


if __name__ == "__main__":
    sys.exit(main())
