"""The one tag schema: every TensorBoard tag normprobe writes, and how to read one back.

A tag is ``normprobe/<series>/<subject>``, where the series is a metric family's name or one of
the names it writes (``resid_growth``, ``norm_gain_mean``), and the subject is

* a stack and a block, ``blocks/07`` (per-block series; indices zero-padded to the stack's
  depth so that they sort);
* a stack, ``blocks`` (per-stack summaries);
* a module inside a block, ``blocks/07.ln_1``, or elsewhere, by its path (``ln_f``, ``root``);
* a statistic of the whole model, ``max_abs`` (``logits``), ``modules`` (``nonfinite``).

Example::

    tags.format("resid_rms", "blocks", block=7, depth=12)   # 'normprobe/resid_rms/blocks/07'
    tags.parse("normprobe/norm_in_rms/blocks/07.ln_1")
    # Tag(series='norm_in_rms', subject='blocks', block=7, layer='ln_1')
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PREFIX = "normprobe"
_BLOCK = re.compile(r"(\d+)(?:\.(.+))?")


@dataclass(frozen=True)
class Tag:
    """A parsed tag.

    Attributes:
        series: the family or one of its series (``resid_rms``, ``val_bn_gap``).
        subject: the stack, module path or statistic the value belongs to.
        block: the block index for per-block values and modules inside a block, else None.
        layer: the module's path inside its block (``ln_1``), else None.
    """

    series: str
    subject: str
    block: int | None = None
    layer: str | None = None

    def __str__(self) -> str:
        return format(self.series, self.subject, self.block, self.layer)


def block_label(block: int, depth: int) -> str:
    """``block`` zero-padded to the width of the stack's last index (``07`` of 12)."""
    return f"{block:0{len(str(max(depth, 1) - 1))}d}"


def format(
    series: str,
    subject: str,
    block: int | None = None,
    layer: str | None = None,
    *,
    depth: int = 0,
) -> str:
    """The tag of ``series`` for ``subject`` (and ``block``, ``layer`` inside it).

    ``depth`` pads the block index to the stack's width; without it the index is written as is.
    """
    if "/" in series or not series:
        raise ValueError(f"a series name is one path segment without '/', got {series!r}")
    tag = f"{PREFIX}/{series}/{subject}"
    if block is not None:
        tag += "/" + (block_label(block, depth) if depth else str(block))
        if layer:
            tag += "." + layer
    return tag


@functools.lru_cache(maxsize=1 << 16)  # a run's tags come back at every step and judgement
def parse(tag: str) -> Tag | None:
    """The parts of a normprobe tag; None for a tag that is not one."""
    head, _, rest = tag.partition("/")
    if head != PREFIX:
        return None
    series, _, subject = rest.partition("/")
    if not series or not subject:
        return None
    stack, _, last = subject.rpartition("/")
    m = _BLOCK.fullmatch(last) if stack else None
    if m is None:
        return Tag(series, subject)
    return Tag(series, stack, int(m[1]), m[2])


def prefix(series: str, subject: str = "") -> str:
    """What every tag of ``series`` (for ``subject``) starts with, for filtering."""
    return f"{PREFIX}/{series}/" + (f"{subject}/" if subject else "")
