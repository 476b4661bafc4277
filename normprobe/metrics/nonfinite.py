"""``nonfinite``: where NaN or Inf first appears, in a forward and in its backward."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .. import probes, tags
from ..discovery.trace import iter_tensors
from .base import MODEL, PROBLEM, Family, Flag, Out, Plan, Run, Series, Side, Values

Ranks = dict[torch.device, torch.Tensor]  # 0, 1, 2, ... on each device, made once


class NonFinite(Family):
    name = "nonfinite"
    description = (
        "number of modules whose output holds NaN or Inf, and the first of them in execution "
        "order; in backward, number of modules whose input gradient holds NaN or Inf, and the "
        "first, in backward order, that made it from a finite received gradient (both warned "
        "once; backward: not on compiled models)"
    )
    series = (Series("nonfinite", "model"),)

    def plan(self, plan: Plan) -> None:
        order: Ranks = {}
        self._plan_forward(plan, order)
        self._plan_backward(plan, order)

    def _plan_forward(self, plan: Plan, order: Ranks) -> None:
        paths = list(plan.modules_in_order)
        slot = plan.slot(len(paths), "min")  # per module: its rank in execution order, or inf
        seen: set[int] = set()
        last: list[torch.Tensor] = []  # the output read last, and its sum
        read_modules: list[int] = []  # in the order they ran (each module's first call)
        sums: list[torch.Tensor] = []  # the finite sum of each one's output
        warned = [False]

        def read(index: int, out: Any) -> None:
            if index in seen:
                return
            if isinstance(out, torch.Tensor):
                if not out.is_floating_point():
                    return
                # a module that returns what its last child returned (read just before): summed
                # once
                if last and last[0] is out:
                    total = last[1]
                else:
                    total = probes.finite_sum(out)
                    last[:] = [out, total]
            else:
                floats = [t for _, t in iter_tensors(out) if t.is_floating_point()]
                if not floats:
                    return
                total = probes.finite_sums(floats).sum()
            seen.add(index)
            read_modules.append(index)
            sums.append(total)

        def publish() -> None:
            if sums:
                # the i-th module read is the i-th to run: its rank if its output was not finite
                values = torch.stack(_on_first_device(sums))
                ranks = torch.where(torch.isfinite(values), math.inf, _ranks(order, paths, values))
                plan.measured.put_at([slot.offset + i for i in read_modules], ranks)

        def clear() -> None:
            seen.clear()
            last.clear()
            read_modules.clear()
            sums.clear()

        plan.at_forward_start(clear)
        plan.at_flush(publish)
        plan.on_clear(clear)

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

    def _plan_backward(self, plan: Plan, order: Ranks) -> None:
        """Per module, the finite sums of its input gradients (each tensor's, accumulated over
        its consumers) and of the gradients its outputs received. At flush, a module whose input
        gradient is non-finite gets its rank in the order input gradients completed if what it
        received was finite (it made the NaN/Inf), else ``len(paths)`` (it passed one on); inf
        if its input gradient is finite. Modules called with one tensor complete together, the
        first called (the outermost) first. As input gradients are accumulated, a module called
        with a tensor that an operation outside it also reads (the skip path, a sibling's
        input) is named when that operation made the NaN/Inf and no module around it was called
        with the same tensor."""
        paths = list(plan.modules_in_order)
        spread = float(len(paths))
        slot = plan.slot(len(paths), "min")
        sums: list[torch.Tensor] = []  # the finite sum of each gradient, as they complete
        # by module, the positions in ``sums`` of its gradients; inputs in the order their
        # gradient completed (a module's last one)
        inputs: dict[int, list[int]] = {}
        outputs: dict[int, list[int]] = {}
        warned = [False]

        def read(modules: Sequence[tuple[int, Side]], grad: torch.Tensor) -> None:
            position = len(sums)
            sums.append(probes.finite_sum(grad))
            for index, side in modules:
                if side == "input":
                    inputs[index] = [*inputs.pop(index, []), position]
                else:
                    outputs.setdefault(index, []).append(position)

        def publish() -> None:
            if not inputs:
                return
            values = torch.stack(_on_first_device(sums))
            given = _group_sums(values, list(inputs.values()))
            received = _group_sums(values, [outputs.get(i, []) for i in inputs])
            made = torch.where(torch.isfinite(received), _ranks(order, paths, given), spread)
            ranks = torch.where(torch.isfinite(given), math.inf, made)
            plan.measured.put_at([slot.offset + i for i in inputs], ranks)

        def clear() -> None:
            sums.clear()
            inputs.clear()
            outputs.clear()

        def record(values: Values, out: Out) -> None:
            ranks = values.measured(slot)
            if not ranks:
                return  # no backward of the step's forward
            bad = sorted((r, paths[i]) for i, r in ranks.items() if r != math.inf)
            out.scalar("nonfinite", "backward_modules", float(len(bad)))
            if not bad or bad[0][0] >= spread:
                return  # finite, or non-finite where it entered: from the loss or the forward
            first = bad[0][1] or "<root>"
            out.text("nonfinite", "first_backward", first)
            if not warned[0] and out.writes:
                warned[0] = True
                warnings.warn(
                    f"normprobe: NaN/Inf first appeared in backward in the input gradient of "
                    f"{first} at step {out.step}, from a finite gradient at its output "
                    f"({len(bad)} modules' input gradients affected)",
                    RuntimeWarning,
                    stacklevel=2,
                )

        plan.read_gradients(read)
        plan.at_forward_start(clear)
        plan.at_flush(publish)
        plan.on_clear(clear)
        plan.on_record(record)

    def flags(self, run: Run) -> list[Flag]:
        return _forward_flags(run) + _backward_flags(run)


def _ranks(order: Ranks, paths: list[str], like: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... as many as ``like`` holds, on its device."""
    device = like.device
    if device not in order:
        order[device] = torch.arange(len(paths), dtype=torch.float32, device=device)
    return order[device][: len(like)]


def _group_sums(values: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """The sum of ``values`` at each group's positions (0 for an empty group)."""
    members = [p for group in groups for p in group]
    out = values.new_zeros(len(groups))
    if not members:
        return out
    owner = [g for g, group in enumerate(groups) for _ in group]
    device = values.device
    index = torch.tensor(members, device=device)
    return out.index_add_(0, torch.tensor(owner, device=device), values[index])


def _on_first_device(values: list[torch.Tensor]) -> list[torch.Tensor]:
    device = values[0].device
    return [v if v.device == device else v.to(device) for v in values]


def _forward_flags(run: Run) -> list[Flag]:
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
            PROBLEM,
        )
    ]


def _backward_flags(run: Run) -> list[Flag]:
    """The first logged step whose backward made a NaN/Inf in a module (a gradient that was
    already non-finite where it entered the model is the loss's or the forward's)."""
    texts = run.texts.get(tags.format("nonfinite", "first_backward"), [])
    if not texts:
        return []
    step, first = texts[0]
    counts = dict(run.scalars.get(tags.format("nonfinite", "backward_modules"), []))
    count = counts.get(step, math.nan)
    return [
        Flag(
            "nan onset in backward",
            MODEL,
            step,
            count,
            0.0,
            f"the gradient turned NaN/Inf in the backward of {first} (finite at its output, "
            f"not at its input; {count:g} modules' input gradients affected); check its "
            "operations whose derivative is infinite where the forward is finite (sqrt, pow, "
            "log, division near zero) and fp16 overflow of gradients",
            PROBLEM,
        )
    ]
