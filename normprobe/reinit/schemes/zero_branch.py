"""The ``zero_branch`` scheme: the last module of every residual branch set to 0."""

from __future__ import annotations

from ..branches import branch_ends
from ..scheme import Scheme
from ..target import Target, gain_names, set_norm, zero_params


def zero_branch(t: Target) -> None:
    """The last module of every residual branch set to 0 (its last weight layer, or the gain of
    a norm that follows it on the branch, as ResNet's ``zero_init_residual``). A branch ending
    in a norm without a gain cannot be zeroed: refused before anything changes."""
    adds = t.adds()
    norms = {n.path: n for n in t.map.norms}
    ends = sorted({end for ends in branch_ends(t, adds).values() for end in ends})
    gainless = [p for p in ends if p in norms and not gain_names(t.module(p))]
    if gainless:
        first = norms[gainless[0]]
        raise ValueError(
            f"zero_branch: the residual branch ending in {first.path} ({first.class_name}) "
            "cannot be set to 0, since that norm has no gain and its output stays normalized "
            f"whatever comes before it ({len(gainless)} such branch ends: {gainless[:4]}); give "
            "those norms a gain (affine=True), or scale the branches with "
            "normprobe.insert_branch_scale(model, 'rezero'); nothing was changed"
        )
    for path in ends:
        if path in norms:
            set_norm(t, norms[path], gain=0.0)
        else:
            zero_params(t, t.module(path), "last layer of a residual branch")


SCHEME = Scheme(
    "zero_branch",
    zero_branch,
    branches=True,
    leaves_layers="not the last module of a residual branch",
)
