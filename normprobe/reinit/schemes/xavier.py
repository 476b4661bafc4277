"""The ``xavier`` scheme: Glorot init (``torch.nn.init.xavier_*_``) on every weight layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..report import xavier
from ..scheme import Scheme, gain_for, one_of, positive_number
from ..target import Target
from ..weights import out_in_view


def xavier_init(
    t: Target, *, gain: Any = None, nonlinearity: Any = "linear", distribution: Any = "normal"
) -> None:
    """Every weight layer except embeddings; biases 0; norms reset."""
    g = gain_for(nonlinearity) if gain is None else positive_number("gain", gain)
    distribution = one_of("distribution", distribution, ("normal", "uniform"))
    init = nn.init.xavier_normal_ if distribution == "normal" else nn.init.xavier_uniform_
    for m, name, p in t.layer_params():
        if t.drawn(name, p):
            view = out_in_view(m, p)
            init(view, gain=g)
            t.rec.record(p, xavier(view, g, distribution, f"{g:.4g}"))
        else:
            t.set_vector(name, p, "xavier")
    t.reset_norms()


SCHEME = Scheme("xavier", xavier_init)
