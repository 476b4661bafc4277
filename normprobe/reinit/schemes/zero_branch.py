"""The ``zero_branch`` scheme: the last module of every residual branch set to 0."""

from __future__ import annotations

from ..branches import branch_ends
from ..scheme import Scheme
from ..target import Target, set_norm, zero_params


def zero_branch(t: Target) -> None:
    """The last module of every residual branch set to 0 (its last weight layer, or the gain of
    a norm that follows it on the branch, as ResNet's ``zero_init_residual``)."""
    adds = t.adds()
    norms = {n.path: n for n in t.map.norms}
    for path in {end for ends in branch_ends(t, adds).values() for end in ends}:
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
