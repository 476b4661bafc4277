"""The ``--json`` output the commands share: numbers as strict JSON takes them, and the text."""

from __future__ import annotations

import json
import math
from typing import Any


def json_number(value: float | None) -> float | None:
    """``value`` as JSON takes it: None for NaN and ±Inf (strict JSON has no such numbers)."""
    return value if value is not None and math.isfinite(value) else None


def dumps(document: dict[str, Any]) -> str:
    """A ``--json`` document as text; strict JSON (a NaN left in it raises ValueError)."""
    return json.dumps(document, indent=2, allow_nan=False)
