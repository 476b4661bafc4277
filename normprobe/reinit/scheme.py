"""What a re-initialization scheme declares (`Scheme`), and the checks its options share.

A scheme is a function ``apply(target, *, option=default, ...)`` that overwrites what it selects
from the `Target`: its keyword-only parameters are the scheme's options (their defaults the
options' defaults) and its docstring is the scheme's documentation, which `reinit`'s own
docstring lists. `Scheme` adds its name and what `reinit` must know before it runs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn


def _never(_options: Mapping[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class Scheme:
    """One scheme `reinit` can run.

    Attributes:
        name: what ``reinit(model, name)`` calls it (``-`` and ``_`` optional, any case).
        apply: ``apply(target, **options)``; its keyword-only parameters and their defaults are
            the options, its docstring the documentation.
        branches: it acts on residual branches, so it refuses (before any change) while the map
            doubts what ``reinit`` would change.
        counts_depth: with these options, whether it counts the blocks N itself (then a doubt
            about the depth stands too).
        leaves_layers: why it leaves a weight layer it does not set (for the report).
    """

    name: str
    apply: Callable[..., None]
    branches: bool = False
    counts_depth: Callable[[Mapping[str, Any]], bool] = _never
    leaves_layers: str | None = None

    @property
    def options(self) -> dict[str, Any]:
        """Option name -> default, from ``apply``'s keyword-only parameters."""
        params = inspect.signature(self.apply).parameters.values()
        return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}

    @property
    def doc(self) -> str:
        """What the scheme does: ``apply``'s docstring."""
        return inspect.cleandoc(self.apply.__doc__ or "")


def positive_number(name: str, value: Any) -> float:
    """The option ``value``, refused unless a finite positive number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def block_count(name: str, value: Any) -> int | None:
    """The option ``value``: None, or a number of blocks (a positive integer)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (number of blocks), got {value!r}")
    return value


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """The option ``value``, refused unless one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)


def gain_for(nonlinearity: str, a: float = 0.0) -> float:
    """torch's recommended gain for ``nonlinearity``, with a clearer error for an unknown one."""
    try:
        return nn.init.calculate_gain(nonlinearity, a)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(
            f"unknown nonlinearity {nonlinearity!r} (from torch: {err}); use one of 'linear', "
            "'relu', 'leaky_relu', 'tanh', 'sigmoid', 'selu'"
        ) from None
