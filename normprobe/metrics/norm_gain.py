"""``norm_gain``: the learned gain of each norm layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import probes
from ..discovery import is_bias_name
from .core.base import Family, Out, Plan, Series, Slot, Values


@dataclass
class _GainGroup:
    """Norms whose weights share shape, dtype, device and gain offset: reduced in one go."""

    offset: float
    gains: list[tuple[nn.Module, str]] = field(default_factory=list)  # (norm, its gain's name)
    positions: list[int] = field(default_factory=list)  # their (mean, std) slot positions


class NormGain(Family):
    name = "norm_gain"
    requires = "no norm layers with a learned gain"
    optional = True  # OLMo's LayerNorm learns none by design
    description = "mean and std of each norm layer's effective gain (1 + weight for Gemma's norms)"
    series = (Series("norm_gain_mean", "module", "mean"), Series("norm_gain_std", "module", "mean"))

    def plan(self, plan: Plan) -> None:
        sharded = plan.param_reduce == "sum"  # shards of any size: moments, summed over ranks
        groups: dict[tuple[Any, ...], _GainGroup] = {}
        slots: list[tuple[str, Slot]] = []
        for n in plan.norms:
            module = plan.modules[n.path]
            name = next((p for p in n.affine if not is_bias_name(p)), "")  # weight, scale, g
            w = _gain(module, name)
            if w is None or not w.is_floating_point():
                continue
            if n.gain_offset is None:  # weight or 1 + weight: unknown, so no gain to report
                continue
            slot = plan.slot(3 if sharded else 2, plan.param_reduce)
            slots.append((plan.module_tag(n.path), slot))
            offset = n.gain_offset
            group = groups.setdefault((w.numel(), w.dtype, w.device, offset), _GainGroup(offset))
            group.gains.append((module, name))
            group.positions.extend(range(slot.offset, slot.offset + slot.size))

        def read() -> None:
            with torch.no_grad():
                for g in groups.values():
                    # read now: FSDP swaps them
                    weights = plan.holdings.weights([getattr(m, name) for m, name in g.gains])
                    if sharded:
                        stats = torch.stack([probes.gain_moments(w, g.offset) for w in weights])
                    else:
                        stacked = torch.stack([w.reshape(-1) for w in weights])
                        stats = probes.gain_stats(stacked, g.offset)
                    plan.measured.put_at(g.positions, stats.reshape(-1))

        def record(values: Values, out: Out) -> None:
            for subject, slot in slots:
                vals = values.get(slot)
                if vals is None:
                    continue
                mean, std = probes.gain_from_moments(*vals) if sharded else vals
                out.scalar("norm_gain_mean", subject, mean)
                out.scalar("norm_gain_std", subject, std)

        plan.before_step(read)
        plan.on_record(record)


def _gain(module: nn.Module, name: str) -> torch.Tensor | None:
    """The norm's gain parameter ``name`` (torch's ``weight``, torchtune's ``scale``)."""
    gain = getattr(module, name, None)
    return gain if isinstance(gain, torch.Tensor) else None
