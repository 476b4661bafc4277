"""The schemes `reinit` knows, one module each. A new scheme is a module declaring
``SCHEME = Scheme(...)`` (see `normprobe.reinit.scheme`) and its entry in `REGISTRY` below, whose
order is the order `SCHEMES`, the error for an unknown scheme and `reinit`'s docstring list them
in."""

from ..scheme import Scheme
from . import deepnorm, fixup, gpt2, kaiming, xavier, zero_branch

REGISTRY: dict[str, Scheme] = {
    s.name: s
    for s in (
        gpt2.SCHEME,
        fixup.SCHEME,
        deepnorm.SCHEME,
        kaiming.SCHEME,
        xavier.SCHEME,
        zero_branch.SCHEME,
    )
}
SCHEMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["REGISTRY", "SCHEMES"]
