"""What a conversion tells its caller: one `Conversion` per replaced layer, the
`ConversionReport` (``print()`` it for a table) and `ConversionWarning`."""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field

from ..tables import table
from .targets import Target

_PACKAGE = os.path.dirname(__file__)


class ConversionWarning(UserWarning):
    """`convert_norms` did less than asked, or something needs the caller's attention."""


def warn(message: str) -> None:
    """Warn at the caller's line: the first frame outside this package."""
    level, frame = 2, sys._getframe(1)  # level 2: warn's caller
    while frame.f_back is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, ConversionWarning, level)


@dataclass(frozen=True)
class Conversion:
    """One norm layer replaced by `convert_norms`.

    Attributes:
        path: its name in ``model.named_modules()``; ``aliases`` holds any other names of the
            same (shared) module.
        source: the replaced module's class name; ``kind`` what it computed.
        target: what it was converted to; ``result`` the new module's class name.
        carried: state moved into the new module (``weight``, ``bias``, ``eps=1e-05``, ...).
        dropped: state the new module has no place for (``bias``, ``running_mean``, ...).
        created: parameters made fresh (``alpha``, a ``weight`` of ones, ...).
        notes: anything else a reader should know (a folded ``1 + weight``, a renamed key).
        max_abs_diff: for a conversion to the same kind, the largest output difference between
            the old and the new layer on a random input (None when not checked).
    """

    path: str
    aliases: tuple[str, ...]
    source: str
    kind: str
    target: Target
    result: str
    carried: tuple[str, ...]
    dropped: tuple[str, ...]
    created: tuple[str, ...]
    notes: tuple[str, ...] = ()
    max_abs_diff: float | None = None


@dataclass
class ConversionReport:
    """What `convert_norms_with_report` changed; ``print()`` it for a table.

    Attributes:
        conversions: every replaced layer.
        kept: ``(path, why)`` of norm layers left as they were (already the target, or no
            policy key chose them).
        skipped: ``(path, why)`` of norm layers that could not be converted and were left alone.
        new_parameters: full names of parameters the conversion created.
        removed_parameters: full names (before the conversion) of parameters no longer in the
            model.
        renamed_keys: state_dict keys whose tensor now lives under another key, old to new.
        removed_keys, added_keys: state_dict keys that disappeared or appeared.
        optimizer_updated: whether the optimizer passed in had its param groups changed.
    """

    conversions: list[Conversion] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    new_parameters: list[str] = field(default_factory=list)
    removed_parameters: list[str] = field(default_factory=list)
    renamed_keys: dict[str, str] = field(default_factory=dict)
    removed_keys: list[str] = field(default_factory=list)
    added_keys: list[str] = field(default_factory=list)
    optimizer_updated: bool = False

    def __str__(self) -> str:
        swaps = Counter(f"{c.source} -> {c.result}" for c in self.conversions)
        summary = ", ".join(f"{count} {swap}" for swap, count in swaps.items())
        n = len(self.conversions)
        lines = [f"Converted {n} norm layer{'s' if n != 1 else ''}" + (f": {summary}" if n else "")]
        if self.conversions:
            rows = [
                (
                    c.path or "<root>",
                    c.source,
                    c.result,
                    ", ".join(c.carried) or "-",
                    ", ".join(c.dropped) or "-",
                    ", ".join(c.created) or "-",
                )
                for c in self.conversions
            ]
            lines += table(("path", "from", "to", "carried", "dropped", "created"), rows)
        for title, items in (("Kept", self.kept), ("Skipped", self.skipped)):
            if items:
                lines.append(f"{title} ({len(items)})")
                lines += table(("path", "why"), [(p or "<root>", why) for p, why in items])
        changes = [
            f"{len(self.removed_keys)} removed",
            f"{len(self.added_keys)} added",
            f"{len(self.renamed_keys)} renamed",
        ]
        lines.append("state_dict keys: " + ", ".join(changes))
        params = (
            f"parameters: {len(self.new_parameters)} new, {len(self.removed_parameters)} removed"
        )
        if self.optimizer_updated:
            params += " (optimizer updated)"
        elif self.new_parameters:
            params += " (not in any optimizer: build it after the conversion)"
        lines.append(params)
        notes = sorted({n for c in self.conversions for n in c.notes})
        lines += [f"Note: {n}" for n in notes]
        return "\n".join(lines)
