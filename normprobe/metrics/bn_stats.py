"""``bn_stats``: how far batches are from a BatchNorm's running statistics."""

from __future__ import annotations

import itertools
import math
import operator
from functools import partial
from typing import NamedTuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import probes, tags
from .core.base import (
    NOTE,
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
# Running statistics start at mean 0, variance 1 and close in on the batches' geometrically (by
# the momentum each step), so early in a run a layer whose batches sit far from 1 is past its
# limit from the first logged step while its drift falls step after step: a torchvision
# MobileNetV2 at batch 32 starts at var drift 9.6 and is under 0.25 by step 90. Past the limit
# since the first logged step, falling at 3 of 4 logged steps and to 0.8 of its first value or
# less, the drift is that convergence: a note (MobileNetV2's var drift 9.6 -> 2.2 and gap
# 0.99 -> 0.65 over 55 steps, falling at every logged one). Batches of 2 jump between 1 and 5.8
# at random.
# The running statistics with their initial values discounted (`probes.batchnorm_stats`' settled
# drifts, as Adam corrects its moments' bias) tell convergence apart from drift directly: where
# the batches sit within the limits of those, what is past them is the initial values' share
# (a torchvision EfficientNet-B0 at 64 px: batch variances near 1e-5 deep in the net, so a var
# drift of 11.6 that falls 0.1 a step at momentum 0.1, still 10.1 after 15 healthy steps).
# `bn_settled_drift` is the worse of the two settled drifts over its limit: converging at 1 or
# less.
SETTLED = "bn_settled_drift"
CONVERGING_FALLS = 0.75
CONVERGING_SHARE = 0.8
CONVERGING_POINTS = 4


class BnStats(Family):
    name = "bn_stats"
    requires = "no BatchNorm layers"
    optional = True
    description = (
        "per BatchNorm: how far the batch's mean and variance are from the running ones "
        "(normalized), the train-vs-eval output gap on the logged batch, and the settled "
        "drift: the worse drift over its limit against the running statistics with their "
        "initial mean 0 and variance 1 discounted"
    )
    series = tuple(
        Series(prefix + stat, "module", "max")
        for prefix in ("", "val_")
        for stat in (*STATS, SETTLED)
    )  # the worst module of the stack
    validation = True  # also read on a validation forward (`Probe.validate_next_forward`)

    def plan(self, plan: Plan) -> None:
        slots: list[tuple[str, Slot]] = []
        for n in plan.norms:
            m = plan.modules[n.path]
            if not isinstance(m, _BatchNorm) or m.running_mean is None:
                continue
            slot = plan.slot(5, "mean")
            plan.read(n.path, "pre", _reader(plan, slot, m))
            slots.append((plan.module_tag(n.path), slot))

        def record(values: Values, out: Out) -> None:
            prefix = "val_" if values.validation else ""
            for subject, slot in slots:
                vals = values.get(slot)
                if vals is None:
                    continue
                for stat, v in zip(STATS, vals[:3], strict=True):
                    out.scalar(prefix + stat, subject, v)
                mean_s, var_s = vals[3:]
                settled = max(mean_s / LIMITS["mean_drift"], var_s / LIMITS["var_drift"])
                out.scalar(prefix + SETTLED, subject, settled)

        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        over: dict[str, list[_Hit]] = {}
        for t in run.tags:
            series = t.parsed.series
            if series.removeprefix("val_") not in STATS:
                continue
            limit = LIMITS[series.split("bn_", 1)[1]]
            past = sustained(run.scalars[t.tag], partial(operator.lt, limit))  # limit < v
            last = past[-1] if past else None
            # a validation pass is one step; a training series must stay past its limit
            if last is not None and (series.startswith("val_") or len(past) >= SUSTAIN):
                hit = _Hit(
                    last[1] / limit,
                    last[0],
                    last[1],
                    limit,
                    f"{series} {last[1]:.3g} > {limit:.3g} at {t.module}",
                    not series.startswith("val_"),
                    _settled(run, t.module, last[0]) or _converging(run.scalars[t.tag], past),
                )
                over.setdefault(t.stack, []).append(hit)
        found = []
        for stack in sorted(over):
            if not any(h.training for h in over[stack]):  # flagged by one pass, not by training
                continue
            converging = all(h.converging for h in over[stack] if h.training)
            # the worst first, by its ratio to its limit; for a problem, what makes it one
            # (training series that are not converging) ahead of the rest
            hits = sorted(
                over[stack],
                key=lambda h: (not converging and (h.converging or not h.training), -h.ratio),
            )
            listed = "; ".join(h.text for h in hits[:4]) + ("; ..." if len(hits) > 4 else "")
            if converging:
                why = (
                    ", falling since the first logged step: the running statistics are still "
                    "converging from their initial mean 0 and variance 1 (by the momentum each "
                    "step); a problem if it stops falling"
                )
            else:
                why = (
                    ": batches differ from the running statistics that eval mode uses; look for "
                    "a shifting input distribution, raise the momentum, or for small or "
                    "correlated batches use GroupNorm (normprobe.convert_norms(model, "
                    "'groupnorm'))"
                )
            worst = hits[0]
            severity = NOTE if converging else PROBLEM
            found.append(
                Flag(
                    "batchnorm drift",
                    stack,
                    worst.step,
                    worst.value,
                    worst.limit,
                    listed + why,
                    severity,
                )
            )
        return found


class _Hit(NamedTuple):
    """A BatchNorm series past its limit at its last logged step."""

    ratio: float  # value / limit: what orders the hits
    step: int
    value: float
    limit: float
    text: str
    training: bool  # a training series (not one validation pass)
    converging: bool  # `_converging`


def _settled(run: Run, module: str, step: int) -> bool:
    """Whether the batches sit within the limits of ``module``'s running statistics with their
    initial values discounted at ``step``: what is past them is those values' share."""
    settled = dict(run.scalars.get(tags.prefix(SETTLED) + module, []))
    return settled.get(step, math.inf) <= 1.0


def _converging(points: list[tuple[int, float]], past: list[tuple[int, float]]) -> bool:
    """Past the limit since the series' first finite point and falling most of the way."""
    finite = [p for p in points if math.isfinite(p[1])]
    if len(past) < CONVERGING_POINTS or not finite or past[0] != finite[0]:
        return False
    values = [v for _, v in past]
    falls = sum(b < a for a, b in itertools.pairwise(values))
    return (
        falls >= CONVERGING_FALLS * (len(values) - 1) and values[-1] <= CONVERGING_SHARE * values[0]
    )


def _reader(plan: Plan, slot: Slot, m: _BatchNorm) -> Reader:
    def read(x: torch.Tensor) -> None:
        assert m.running_mean is not None and m.running_var is not None
        stats = probes.batchnorm_stats(
            x, m.running_mean, m.running_var, m.weight, m.bias, m.eps, _init_share(m)
        )
        plan.measured.put(slot, stats)

    return read


def _init_share(m: _BatchNorm) -> torch.Tensor | None:
    """The weight the running statistics' initial values still hold: ``(1 - momentum) **
    num_batches_tracked``, or for a cumulative average (momentum None) 1 before the first
    update and 0 after it."""
    n = m.num_batches_tracked
    if n is None:
        return None
    if m.momentum is None:
        return (n == 0).float()
    return (1.0 - m.momentum) ** n.float()
