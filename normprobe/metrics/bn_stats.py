"""``bn_stats``: how far batches are from a BatchNorm's running statistics."""

from __future__ import annotations

import math
import operator
from functools import partial

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import probes
from .base import (
    PROBLEM,
    SUSTAIN,
    Family,
    Flag,
    Out,
    Plan,
    Reader,
    Run,
    Series,
    Slot,
    Values,
    sustained,
)

# BatchNorm: batch mean off the running mean by half a running std, batch variance off by a
# factor 2 (|log| = 0.69), eval output differing from train output by half its RMS. Set from
# benchmarks/calibration.py: a ResNet-18 at batch 32 ends at mean 0.06, var 0.13, gap 0.11 (a
# ResNet-10 at batch 16 at 0.14, 0.29, 0.24; both pass every limit in their first steps); fed
# batches of 2, at 0.41, 1.4-2.2, 0.68-0.79.
LIMITS = {"mean_drift": 0.5, "var_drift": math.log(2.0), "gap": 0.5}
STATS = ("bn_mean_drift", "bn_var_drift", "bn_gap")


class BnStats(Family):
    name = "bn_stats"
    requires = "no BatchNorm layers"
    optional = True
    description = (
        "per BatchNorm: how far the batch's mean and variance are from the running ones "
        "(normalized), and the train-vs-eval output gap on the logged batch"
    )
    series = tuple(
        Series(prefix + stat, "module", "max") for prefix in ("", "val_") for stat in STATS
    )  # the worst module of the stack
    validation = True  # also read on a validation forward (`Probe.validate_next_forward`)

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, Slot]] = []
        for n in plan.norms:
            m = plan.modules[n.path]
            if not isinstance(m, _BatchNorm) or m.running_mean is None:
                continue
            slot = plan.slot(3, "mean")
            plan.read(n.path, "pre", _reader(plan, slot, m))
            slots.append((plan.module_tag(n.path), slot))

        def record(values: Values, out: Out) -> None:
            prefix = "val_" if values.validation else ""
            for subject, slot in slots:
                vals = values.get(slot)
                if vals is None:
                    continue
                for stat, v in zip(STATS, vals, strict=True):
                    out.scalar(prefix + stat, subject, v)

        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        over: dict[str, list[tuple[float, int, float, float, str, bool]]] = {}
        for t in run.tags:
            series = t.parsed.series
            if series.removeprefix("val_") not in STATS:
                continue
            limit = LIMITS[series.split("bn_", 1)[1]]
            past = sustained(run.scalars[t.tag], partial(operator.lt, limit))  # limit < v
            last = past[-1] if past else None
            # a validation pass is one step; a training series must stay past its limit
            if last is not None and (series.startswith("val_") or len(past) >= SUSTAIN):
                text = f"{series} {last[1]:.3g} > {limit:.3g} at {t.module}"
                entry = (
                    last[1] / limit,
                    last[0],
                    last[1],
                    limit,
                    text,
                    not series.startswith("val_"),
                )
                over.setdefault(t.stack, []).append(entry)
        found = []
        for stack in sorted(over):
            if not any(h[5] for h in over[stack]):  # flagged by training steps, not by one pass
                continue
            hits = sorted(over[stack], reverse=True)  # the worst first, by its ratio to its limit
            _, step, value, limit, _, _ = hits[0]
            listed = "; ".join(h[4] for h in hits[:4]) + ("; ..." if len(hits) > 4 else "")
            found.append(
                Flag(
                    "batchnorm drift",
                    stack,
                    step,
                    value,
                    limit,
                    f"{listed}: batches differ from the running statistics that eval mode uses; "
                    "look for a shifting input distribution, raise the momentum, or for small or "
                    "correlated batches use GroupNorm (normprobe.convert_norms(model, "
                    "'groupnorm'))",
                    PROBLEM,
                )
            )
        return found


def _reader(plan: Plan, slot: Slot, m: _BatchNorm) -> Reader:
    def read(x: torch.Tensor) -> None:
        assert m.running_mean is not None and m.running_var is not None
        stats = probes.batchnorm_stats(x, m.running_mean, m.running_var, m.weight, m.bias, m.eps)
        plan.measured.put(slot, stats)

    return read
