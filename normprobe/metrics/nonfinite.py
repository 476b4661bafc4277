"""``nonfinite``: where NaN or Inf first appears in a forward."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from .. import probes, tags
from ..discovery.trace import iter_tensors
from .base import MODEL, Batch, Family, Flag, Out, Plan, Run, Series, Values


class NonFinite(Family):
    name = "nonfinite"
    description = (
        "number of modules whose output holds NaN or Inf, and the first of them in "
        "execution order (warned once)"
    )
    series = (Series("nonfinite", "model"),)

    def plan(self, plan: Plan) -> None:
        paths = list(plan.modules_in_order)
        slot = plan.slot(len(paths), "min")  # per module: its rank in execution order, or inf
        seen: set[int] = set()
        order: dict[torch.device, torch.Tensor] = {}
        warned = [False]

        def publish(modules: list[int], sums: torch.Tensor) -> None:
            # the i-th module read is the i-th to run: its rank if its output was not finite
            device = sums.device
            if device not in order:
                order[device] = torch.arange(len(paths), dtype=torch.float32, device=device)
            ranks = torch.where(torch.isfinite(sums), math.inf, order[device][: len(sums)])
            plan.measured.put_at([slot.offset + i for i in modules], ranks)

        batch = Batch(plan, probes.finite_sums, publish)
        plan.at_forward_start(seen.clear)
        plan.on_clear(seen.clear)

        def read(index: int, out: Any) -> None:
            if index in seen:
                return
            if isinstance(out, torch.Tensor):
                if not out.is_floating_point():
                    return
                batch.add(index, out)
            else:
                floats = [t.detach() for _, t in iter_tensors(out) if t.is_floating_point()]
                if not floats:
                    return
                batch.add(index, probes.finite_sums(floats).sum())
            seen.add(index)

        def record(values: Values, out: Out) -> None:
            ranks = values.measured(slot)
            bad = sorted((r, paths[i]) for i, r in ranks.items() if r != math.inf)
            out.scalar("nonfinite", "modules", float(len(bad)))
            if not bad:
                return
            first = bad[0][1] or "<root>"
            out.text("nonfinite", "first", first)
            if not warned[0] and out.writes:
                warned[0] = True
                warnings.warn(
                    f"normprobe: NaN/Inf first appeared in the output of {first} "
                    f"at step {out.step} ({len(bad)} modules affected)",
                    RuntimeWarning,
                    stacklevel=2,
                )

        plan.read_outputs(read)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        series = run.scalars.get(tags.format("nonfinite", "modules"), [])
        onset = next(((s, v) for s, v in series if v > 0 or not math.isfinite(v)), None)
        if onset is None:
            return []
        step, count = onset
        texts = run.texts.get(tags.format("nonfinite", "first"), [])
        first = next((text for s, text in texts if s == step), None)
        where = f"first in the output of {first}" if first else "module not recorded"
        return [
            Flag(
                "nan onset",
                MODEL,
                step,
                count,
                0.0,
                f"NaN/Inf in {count:g} module outputs, {where}; check the learning rate, the "
                "data of that step and fp16 overflow (earlier logged steps were finite)",
            )
        ]
