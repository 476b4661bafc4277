"""What a check is (`Check`) and what it reads (`Context`: the step's measurements and capture)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ... import tags
from ...discovery import ModelMap
from ...tables import collapse_indices
from ..capture import Capture
from ..layers import Jump, layer_jumps, stream_jumps
from ..result import Finding

# the findings, and why the check does not apply (None when it does)
CheckResult = tuple[list[Finding], str | None]


@dataclass
class Context:
    """What the checks read: the model, its map, the probe's scalars of the step, the capture.

    ``extra`` collects the checks' own measurements (``diagnose/...`` tags).
    """

    model: nn.Module
    model_map: ModelMap
    scalars: dict[str, float]
    cap: Capture
    world_size: int
    attention_tags: dict[str, str]
    own_loss: bool
    extra: dict[str, float] = field(default_factory=dict)
    _jumps: list[Jump] | None = None

    def jumps(self) -> list[Jump]:
        """Layers and blocks jumping against their peers (`normprobe.diagnose.layers`)."""
        if self._jumps is None:
            found = layer_jumps(self.model, self.cap.layers, self.model_map, self.extra)
            for s in self.model_map.stacks:
                profile = self.stream_rms(s)
                found += stream_jumps(s.path, s.blocks, profile, self.extra)
            self._jumps = found
        return self._jumps

    def stream_rms(self, s: Any) -> list[float | None]:
        """The RMS of stack ``s``'s stream after each block."""
        name = s.path or "root"
        return [
            self.scalars.get(tags.format("resid_rms", name, b, depth=s.depth))
            for b in range(s.depth)
        ]

    def scalar(self, family: str, path: str) -> float | None:
        return self.scalars.get(tags.format(family, path or "root"))

    def add_stacks(self, placements: tuple[str, ...]) -> list[Any]:
        """Top-level stacks of these placements that carry residual adds."""
        return [
            s
            for s in self.model_map.stacks
            if s.norm_placement in placements
            and s.parent is None
            and self.model_map.adds_in(s.path)
        ]


@dataclass(frozen=True)
class Check:
    """One check of `diagnose`, declared once in its own file of `normprobe.diagnose.checks`.

    Attributes:
        code: its code in `Finding.code` and `Diagnosis.checks` (the file is named for it).
        title: one line saying what it looks for (`CHECKS`).
        thresholds: the constants it compares against, by name (held in its file, or imported
            there from the metric family whose threshold it shares); empty for a check of the
            model's structure alone.
        run: the check: its findings, and why it does not apply (None when it does).
    """

    code: str
    title: str
    thresholds: Mapping[str, float]
    run: Callable[[Context], CheckResult]


def collapse_paths(paths: Sequence[str]) -> str:
    """``blocks.{0..11}.attn`` for runs of block indices."""
    rows = collapse_indices([(p or "<root>",) for p in paths], (0,))
    return ", ".join(r[0] for r in rows)
