"""A run's tags read back: which stack and module each belongs to, and every family's flags.
`normprobe report` reads event files through it, the TensorBoard sink the run as it goes."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ... import tags
from .. import FAMILIES, SERIES
from .base import MODEL, PROBLEM, Flag, Points, RunTag


def run_tags(tag_names: Sequence[str]) -> list[RunTag]:
    """The normprobe tags among ``tag_names``, each with its stack (or `MODEL`) and module."""
    return list(_run_tags(tuple(tag_names)))


@functools.lru_cache(maxsize=16)  # the TensorBoard sink judges the same tags again and again
def _run_tags(tag_names: tuple[str, ...]) -> tuple[RunTag, ...]:
    stacks = _stacks(tag_names)
    return tuple(p for p in (_run_tag(t, stacks) for t in tag_names) if p is not None)


def _run_tag(tag: str, stacks: set[str]) -> RunTag | None:
    parsed = tags.parse(tag)
    series = SERIES.get(parsed.series) if parsed is not None else None
    if parsed is None or series is None:
        return None
    if series.shape == "model":
        return RunTag(tag, parsed, MODEL, "")
    if series.shape in ("stack", "block"):
        return RunTag(tag, parsed, parsed.subject, "")
    module = tag.split("/", 2)[2]  # <stack>/<block>.<layer>, or the module's path
    if parsed.block is not None:
        return RunTag(tag, parsed, parsed.subject, module)
    stack, _, index = module.rpartition(".")
    if stack in stacks and index.isdigit():  # the block is the module (lns.3)
        return RunTag(tag, parsed, stack, module)
    return RunTag(tag, parsed, MODEL, module)


def _stacks(tag_names: Sequence[str]) -> set[str]:
    found = set()
    for tag in tag_names:
        parsed = tags.parse(tag)
        series = SERIES.get(parsed.series) if parsed is not None else None
        if parsed is not None and series is not None and series.shape in ("stack", "block"):
            found.add(parsed.subject)
    return found


@dataclass
class RunView:
    """A run as the families' `flags` read it (`normprobe.metrics.core.base.Run`)."""

    scalars: Mapping[str, Points]
    texts: Mapping[str, list[tuple[int, str]]]
    tags: list[RunTag]


def run_flags(
    scalars: Mapping[str, Points], texts: Mapping[str, list[tuple[int, str]]]
) -> list[Flag]:
    """Every family's flags on a run: problems, then notes; in each, NaN onset first (what came
    after it is its consequence), then stack by stack."""
    run = RunView(scalars, texts, run_tags(list(scalars)))
    found = [(i, flag) for i, family in enumerate(FAMILIES) for flag in family.flags(run)]
    found.sort(
        key=lambda f: (
            f[1].severity != PROBLEM,
            f[1].kind != "nan onset",
            f[1].stack == MODEL,
            f[1].stack,
            f[0],
        )
    )
    return [flag for _, flag in found]


def problems(flags: Sequence[Flag]) -> list[Flag]:
    """The flags worth stopping for (`normprobe report`'s exit status 1)."""
    return [f for f in flags if f.severity == PROBLEM]


def flag_lines(flags: Sequence[Flag], indent: str = "  ") -> list[str]:
    """The flags as `report` prints them: problems, then notes, each under its heading."""
    lines = []
    found = problems(flags)
    notes = [f for f in flags if f.severity != PROBLEM]
    if found:
        lines.append(f"Problems ({len(found)}), worth stopping for:")
        lines += [f"{indent}{f}" for f in found]
    elif notes:
        lines.append("No problems.")
    if notes:
        lines.append(f"Notes ({len(notes)}), worth a look (healthy runs raise these too):")
        lines += [f"{indent}{f}" for f in notes]
    return lines or ["No flags."]
