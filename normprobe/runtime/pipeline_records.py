"""The records of a pipeline's stages combined into the whole stack's, once per logged step.

Each stage writes its blocks under their global numbers; one all-gather over the stages' group
hands every stage every stage's record. Per-block and per-module values belong to one stage
each; the stack's ratios (``grad_ratio``, ``resid_growth``, ``resid_slope``) are computed again
from the combined depth profiles, and the model's totals combine as named in `COMBINE`. A
later stage's first cosine (with its input) stays where the stage before handed on its last
block's stream unchanged.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import probes, tags
from ..sinks import Record

# how a model's or a stack's value written by several stages combines
COMBINE: dict[str, Callable[[list[float]], float]] = {
    "grad_norm_total": lambda v: math.sqrt(sum(x * x for x in v)),  # the squares add up
    "grad_norm_rest": lambda v: math.sqrt(sum(x * x for x in v)),
    "attn_heads_over_tau": sum,  # heads counted on each stage's blocks
}
# a stack's values that span its blocks: written again from the combined profiles
SPANNING = ("grad_ratio", "resid_growth", "resid_slope")


class Exchange:
    """All-gathers a byte string of each stage in one collective (two when one outgrows the
    buffer: then every stage widens it)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.capacity = 1 << 16

    def __call__(self, payload: bytes) -> list[bytes]:
        import torch.distributed as dist

        while True:
            head = len(payload).to_bytes(8, "little")
            fits = head + payload if len(payload) <= self.capacity else head
            buffer = torch.zeros(8 + self.capacity, dtype=torch.uint8)
            buffer[: len(fits)] = torch.frombuffer(bytearray(fits), dtype=torch.uint8)
            mine = buffer.to(self.device)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(every, mine, group=self.group)
            host = torch.stack(every).cpu()  # the one transfer of the stages' records
            sizes = [int.from_bytes(row[:8].numpy().tobytes(), "little") for row in host]
            if max(sizes) <= self.capacity:
                rows = zip(host, sizes, strict=True)
                return [row[8 : 8 + n].numpy().tobytes() for row, n in rows]
            self.capacity = 2 * max(sizes)  # every stage read the same sizes


def encoded(record: Record, held: Mapping[str, tuple[int, bool]]) -> bytes:
    """A stage's record and what it holds of each stack (`pipeline.held`)."""
    return json.dumps([record.scalars, record.profiles, record.texts, held]).encode()


def combined(step: int, payloads: Sequence[bytes]) -> Record:
    """The stages' records (``payloads``, `encoded`, in stage order: a stage's rank in its
    group is its index) as one."""
    record = Record(step)
    several: dict[str, list[float]] = {}
    stages = [json.loads(payload) for payload in payloads]
    for before, after in itertools.pairwise(stages):
        _unhanded(before[3], after)
    for scalars, profiles, texts, _ in stages:
        for tag, value in scalars.items():
            several.setdefault(tag, []).append(value)
        for tag, values in profiles.items():
            record.profiles[tag] = _merged(tag, record.profiles.get(tag), values)
        record.texts.update(texts)
    for tag, values in several.items():
        series = tag.split("/")[1]
        if series in SPANNING:
            continue
        if len(values) == 1:
            record.scalars[tag] = values[0]
        elif series in COMBINE:
            record.scalars[tag] = COMBINE[series](values)
        else:
            raise RuntimeError(f"normprobe cannot combine {tag} across pipeline stages: {values}")
    _spanning(record)
    return record


def _unhanded(before: Mapping[str, list[Any]], stage: list[Any]) -> None:
    """Drop the cosine of ``stage``'s first block with the stream before it (its input) where
    the stage ``before`` it did not hand that stream on unchanged."""
    scalars, profiles = stage[0], stage[1]
    for stack, (first, _) in stage[3].items():
        if before.get(stack, (0, False))[1]:
            continue
        profile = profiles.get(tags.format("resid_cos", stack))
        if profile is not None:
            profile[first] = math.nan
            scalars.pop(tags.format("resid_cos", stack, first, depth=len(profile)), None)


def _merged(tag: str, have: list[float] | None, values: list[float]) -> list[float]:
    """A depth profile: each block's value from the stage that holds it."""
    if have is None:
        return list(values)
    out = []
    for a, b in zip(have, values, strict=True):
        if not math.isnan(a) and not math.isnan(b):
            raise RuntimeError(f"normprobe found two pipeline stages writing {tag} for one block")
        out.append(b if math.isnan(a) else a)
    return out


def _spanning(record: Record) -> None:
    """Each stack's top/bottom gradient ratio and residual growth and slope, from the combined
    profiles, as one process computes them."""
    for tag, values in record.profiles.items():
        parsed = tags.parse(tag)
        if parsed is None or parsed.block is not None:
            continue
        stack = parsed.subject
        if parsed.series == "grad_norm":
            first, last = values[0], values[-1]
            if first and not math.isnan(first) and not math.isnan(last):
                record.scalars[tags.format("grad_ratio", stack)] = last / first
        elif parsed.series == "resid_rms":
            measured = [v for v in values if not math.isnan(v)]
            first, last = values[0], values[-1]
            if first and not math.isnan(first) and not math.isnan(last):
                record.scalars[tags.format("resid_growth", stack)] = last / first
                record.scalars[tags.format("resid_slope", stack)] = probes.loglog_slope(measured)
