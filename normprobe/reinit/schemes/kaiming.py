"""The ``kaiming`` scheme: He init (``torch.nn.init.kaiming_*_``) on every weight layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..report import kaiming
from ..scheme import Scheme, gain_for, one_of
from ..target import Target
from ..weights import out_in_view


def kaiming_init(
    t: Target,
    *,
    mode: Any = "fan_in",
    nonlinearity: Any = "relu",
    a: Any = 0.0,
    distribution: Any = "normal",
) -> None:
    """Every weight layer except embeddings; biases 0; norms reset."""
    mode = one_of("mode", mode, ("fan_in", "fan_out"))
    distribution = one_of("distribution", distribution, ("normal", "uniform"))
    gain = gain_for(nonlinearity, a)
    init = nn.init.kaiming_normal_ if distribution == "normal" else nn.init.kaiming_uniform_
    for m, name, p in t.layer_params():
        if t.drawn(name, p):
            view = out_in_view(m, p)
            init(view, a=a, mode=mode, nonlinearity=nonlinearity)
            t.rec.record(p, kaiming(view, mode, gain, distribution, f"{gain:.4g}"))
        else:
            t.set_vector(name, p, "kaiming")
    t.reset_norms()


SCHEME = Scheme("kaiming", kaiming_init)
