"""``norm_rms``: what each norm layer receives and hands on."""

from __future__ import annotations

from functools import partial

from .. import probes
from .core.base import Family, Out, Plan, Series, Values
from .core.batch import Batch


class NormRms(Family):
    name = "norm_rms"
    requires = "no norm layers"
    description = "RMS of each norm layer's input and output"
    series = (Series("norm_in_rms", "module", "mean"), Series("norm_out_rms", "module", "mean"))

    def plan(self, plan: Plan) -> None:
        batch = Batch(plan, probes.rms_many)
        slots = []
        for n in plan.norms:
            slot = plan.slot(2, "rms")  # (input, output)
            plan.read(n.path, "pre", partial(batch.add, slot.offset))
            plan.read(n.path, "post", partial(batch.add, slot.offset + 1))
            slots.append((plan.module_tag(n.path), slot))

        def record(values: Values, out: Out) -> None:
            for subject, slot in slots:
                measured = values.measured(slot)
                for i, series in enumerate(("norm_in_rms", "norm_out_rms")):
                    if i in measured:
                        out.scalar(series, subject, measured[i])

        plan.on_record(record)
