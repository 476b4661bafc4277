"""Whether a new layer computes what the old one did: for a conversion to the same kind, the old
layer's output on a random input, compared with the new layer's (kept as it was when the two
differ by rounding only, warned about when they differ by more)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .build import Built, build
from .layout import reference
from .plan import Options, Plan
from .report import ConversionReport, warn


def keep_bit_identical(
    model: nn.Module, plans: list[Plan], opts: Options, report: ConversionReport
) -> list[Plan]:
    """The plans left once same-kind layers a new layer would only round differently are kept
    as they are (in ``report.kept``)."""
    fallback = next((p for p in model.parameters() if p.is_floating_point()), None)
    for plan in plans:
        _record_old_output(plan)
    kept = [plan for plan in plans if _rounds_differently(plan, opts, fallback)]
    for plan in kept:
        cls = type(build(replace(plan, notes=[]), opts, fallback).module).__name__
        report.kept.append(
            (
                plan.source.paths[0],
                f"already computes a {plan.target} over the same features, which a new {cls} "
                "would round differently: kept so its outputs stay bit-identical",
            )
        )
    return [plan for plan in plans if plan not in kept]


def _record_old_output(plan: Plan) -> None:
    """For a same-kind conversion, run the old layer on a random input to compare later."""
    kind = plan.source.layer.kind if plan.source.layer is not None else "dyt"
    if kind != plan.target or kind not in ("layernorm", "rmsnorm", "dyt"):
        return
    ref = reference(plan.source.module)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    if device.type == "meta":
        return
    shape = (2, 3, *plan.affine) if plan.out_layout == "channels-last" else (2, plan.shape[0], 3, 3)
    gen = torch.Generator().manual_seed(0)  # the caller's random stream stays untouched
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device, dtype)
    try:
        with torch.no_grad():
            y = plan.source.module.forward(x)  # forward, not __call__: the layer's hooks stay quiet
    except Exception:  # a layer needing more inputs than x: nothing to compare
        return
    if isinstance(y, torch.Tensor) and y.shape == x.shape:
        plan.check_input, plan.old_output = x, y


def _within_rounding(new: torch.Tensor, old: torch.Tensor) -> bool:
    """A few roundings at the output's size: HF norms compute in fp32 and cast back."""
    diff = float((new.double() - old.double()).abs().max())
    scale = max(1.0, float(old.abs().max()))
    return diff <= max(1e-4, 4 * torch.finfo(new.dtype).eps) * scale


def _rounds_differently(plan: Plan, opts: Options, fallback: torch.Tensor | None) -> bool:
    """A same-kind conversion whose new layer differs from the old one by rounding only."""
    layer, x, old = plan.source.layer, plan.check_input, plan.old_output
    if layer is None or x is None or old is None or layer.kind != plan.target:
        return False
    if layer.eps_placement == "outside-sqrt" or opts.eps not in (None, layer.eps):
        return False  # a real change, reported as one
    trial = build(replace(plan, notes=[]), opts, fallback).module
    params = {}
    if plan.gain_offset and plan.gain is not None and trial.weight is plan.gain:
        params["weight"] = plan.gain + plan.gain_offset  # the shift the commit makes in place
    with torch.no_grad():
        y = torch.func.functional_call(trial, params, (x,))
    return not torch.equal(y, old) and _within_rounding(y, old)


def output_diff(b: Built) -> float | None:
    """The largest difference between the new layer's output and the old one's recorded output
    (None when none was recorded); warns past rounding."""
    plan = b.plan
    if plan.check_input is None or plan.old_output is None:
        return None
    with torch.no_grad():
        y = b.module.forward(plan.check_input)
    diff = float((y.double() - plan.old_output.double()).abs().max())
    if not _within_rounding(y, plan.old_output):
        warn(
            f"{plan.source.paths[0]}: the new {type(b.module).__name__} differs from the old "
            f"{type(plan.source.module).__name__} by up to {diff:.3g} on a random input; "
            "check what the old layer computes (convert_norms_with_report shows the details)"
        )
    return diff
