"""Plain-text tables whose rows for repeated blocks collapse into one (``h.{0..11}.attn``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# A block index or ordinal inside a path: `h.3.attn`, `<root>#2`.
_INDEX = re.compile(r"(?<=[.#])\d+(?=[.#\s]|$)")


def collapse_indices(
    rows: list[tuple[str, ...]], path_cols: tuple[int, ...]
) -> list[tuple[str, ...]]:
    """Merge rows that differ only in block indices into one row with `{0..11}` ranges."""
    groups: dict[tuple[str, ...], list[list[int]]] = {}
    for row in rows:
        values: list[int] = []

        def hole(m: re.Match[str], values: list[int] = values) -> str:
            values.append(int(m.group()))
            return "{}"

        template = tuple(
            _INDEX.sub(hole, cell) if i in path_cols else cell for i, cell in enumerate(row)
        )
        groups.setdefault(template, []).append(values)
    out = []
    for template, rows_values in groups.items():
        for run in _runs(rows_values):
            out.append(_fill(template, run))
    return out


def _is_run(values: list[list[int]]) -> bool:
    """Whether the rows count up together by one: [[0, 1], [1, 2], [2, 3]]."""
    if len(values) < 2:
        return True
    step = [b - a for a, b in zip(values[0], values[1], strict=True)]
    if any(s not in (0, 1) for s in step) or not any(step):
        return False
    return all(
        v == [x + k * s for x, s in zip(values[0], step, strict=True)] for k, v in enumerate(values)
    )


def _runs(values: list[list[int]]) -> list[list[list[int]]]:
    if _is_run(values):
        return [values]
    varying = [j for j in range(len(values[0])) if len({v[j] for v in values}) > 1]
    j = varying[-1]
    sub: dict[tuple[int, ...], list[list[int]]] = {}
    for v in values:
        sub.setdefault((*v[:j], *v[j + 1 :]), []).append(v)
    return [
        run
        for group in sub.values()
        for run in ([group] if _is_run(group) else [[v] for v in group])
    ]


def _fill(template: tuple[str, ...], run: list[list[int]]) -> tuple[str, ...]:
    texts = iter(
        str(a) if a == b else f"{{{a}..{b}}}" for a, b in zip(run[0], run[-1], strict=True)
    )
    filled = []
    for cell in template:
        parts = cell.split("{}")
        filled.append(parts[0] + "".join(next(texts) + part for part in parts[1:]))
    return tuple(filled)


def table(
    header: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    path_cols: tuple[int, ...] = (0,),
    indent: str = "  ",
) -> list[str]:
    """Aligned text rows under ``header``; rows differing only in block indices in the
    ``path_cols`` columns merged (`collapse_indices`)."""
    merged = collapse_indices(list(rows), path_cols)
    widths = [max(len(r[i]) for r in [header, *merged]) for i in range(len(header))]
    fmt = indent + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in merged)]
