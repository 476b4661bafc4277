"""``low-precision-norm``: a norm computing its statistics in float16/bfloat16.

Each norm class other than torch's own is rerun on its captured input's shape, once in float16
with inputs of RMS 1024 (squares overflow float16 unless accumulated in float32) and once in
bfloat16 with inputs whose mean is 64 times their spread (a mean held in bfloat16 loses the
spread); the output is compared with the same module run in float64 on the same rounded input.
A norm that computes its statistics in float32 differs only by the output's rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...nested import iter_tensors, replace_at
from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "low-precision-norm"

# Relative RMS error of a norm run in float16/bfloat16 against the same computation in float64
# on the same rounded input. Norms that accumulate in float32 measure only the output's rounding
# (bfloat16 0.0017, float16 0.0002 here); one squaring in float16 overflows (error 1.0), one
# centering in bfloat16 misses the mean (0.09).
LOWP_ERROR_MAX = 0.01
# inputs of RMS 1024: squares near 1e6 overflow float16 (largest finite value 65504)
LOWP_FP16_SCALE = 1024.0
# inputs with a mean of 64 spreads: bfloat16 resolves 64 only to 0.5, the spread needs float32
LOWP_BF16_OFFSET = 64.0

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def check(ctx: Context) -> CheckResult:
    if not ctx.cap.norm_inputs:
        return [], "no LayerNorm/RMSNorm/GroupNorm-like layers ran"
    modules = dict(ctx.model.named_modules())
    found = []
    for path, inputs in ctx.cap.norm_inputs.items():
        if type(modules[path]).__module__.startswith("torch."):
            continue  # torch's own kernels: the advice (use torch's class) would be moot
        errors = _errors(ctx, path, modules[path], inputs)
        bad = {k: v for k, v in errors.items() if v > LOWP_ERROR_MAX}
        if bad:
            found.append(_finding(path, modules, bad))
    return found, None


def _errors(ctx: Context, path: str, module: nn.Module, inputs: Inputs) -> dict[str, float]:
    """The rerun's error per low-precision dtype (not judged where the dtype has no kernel)."""
    errors: dict[str, float] = {}
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        try:
            errors[name] = _rerun(module, inputs, dtype)
        except Exception:  # an op without a kernel for this dtype: not judged
            continue
        ctx.extra[f"diagnose/lowp_error/{name}/{path}"] = errors[name]
    return errors


def _rerun(module: nn.Module, inputs: Inputs, dtype: torch.dtype) -> float:
    """Relative RMS error of ``module`` run in ``dtype`` against float64 on the same input."""
    args, kwargs = inputs
    key, x = next(((k, t) for k, t in iter_tensors((args, kwargs)) if t.is_floating_point()))
    gen = torch.Generator(device="cpu").manual_seed(0)
    z = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    z = z * LOWP_FP16_SCALE if dtype == torch.float16 else z + LOWP_BF16_OFFSET
    low = z.to(x.device, dtype)

    def run(t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        params = {n: p.detach().to(to) for n, p in module.named_parameters()}
        a, k = replace_at((args, kwargs), key, t)
        out = torch.func.functional_call(module, params, tuple(a), k)
        y = next(t for _, t in iter_tensors(out) if t.is_floating_point())
        return y.double()

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        y = run(low, dtype)
        torch.manual_seed(0)
        ref = run(low.double(), torch.float64)
    err = (y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return float(err.nan_to_num(nan=math.inf))


def _finding(path: str, modules: dict[str, nn.Module], bad: dict[str, float]) -> Finding:
    cls = type(modules[path])
    same = [p for p, m in modules.items() if type(m) is cls and p]
    how = []
    if "float16" in bad:
        how.append(
            f"float16, inputs of RMS {LOWP_FP16_SCALE:g}: error {bad['float16']:.1%} "
            "(squares above 65504 overflow)"
        )
    if "bfloat16" in bad:
        how.append(f"bfloat16, mean {LOWP_BF16_OFFSET:g}x the spread: error {bad['bfloat16']:.1%}")
    return Finding(
        CODE,
        f"{cls.__name__} computes its statistics in the input's precision",
        (
            f"{path} rerun against float64 on the same rounded input: " + "; ".join(how),
            f"a norm that accumulates in float32 is off by its output rounding only "
            f"(below {LOWP_ERROR_MAX:.0%}); {len(same)} layers of this class: "
            f"{collapse_paths(same)}",
        ),
        "upcast inside the norm (x32 = x.float(); statistics and scaling in float32; "
        "return y.to(x.dtype)), or replace the class with torch's: "
        "normprobe.convert_norms(model, 'rmsnorm' or 'layernorm').",
        tuple(same),
    )


CHECK = Check(
    CODE,
    "norm computing its statistics in float16/bfloat16",
    {
        "LOWP_ERROR_MAX": LOWP_ERROR_MAX,
        "LOWP_FP16_SCALE": LOWP_FP16_SCALE,
        "LOWP_BF16_OFFSET": LOWP_BF16_OFFSET,
    },
    check,
)
