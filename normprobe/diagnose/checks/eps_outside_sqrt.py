"""``eps-outside-sqrt``: norms computing x / (sqrt(var) + eps), as discovery places their eps."""

from __future__ import annotations

from ..result import Finding
from .base import Check, CheckResult, Context, collapse_paths

CODE = "eps-outside-sqrt"


def check(ctx: Context) -> CheckResult:
    custom = [n for n in ctx.model_map.norms if n.eps is not None]
    if not custom:
        return [], "no norm with an eps"
    outside = [n for n in custom if n.eps_placement == "outside-sqrt"]
    if not outside:
        return [], None
    eps = sorted({n.eps for n in outside if n.eps is not None})
    return [
        Finding(
            CODE,
            "eps outside the square root",
            (
                f"{len(outside)} norms compute x / (sqrt(var) + eps) with eps "
                f"{', '.join(f'{e:g}' for e in eps)}: {collapse_paths([n.path for n in outside])}",
            ),
            "use sqrt(var + eps), the convention of torch, HF and the papers: eps outside the "
            "root acts like eps² inside (far too small to guard float16 against var ≈ 0), and "
            "weights moved to a standard norm change output on small inputs. "
            "normprobe.convert_norms(model, 'rmsnorm' or 'layernorm') swaps in torch's layers.",
            tuple(n.path for n in outside),
        )
    ], None


# a check of the model's structure: no threshold
CHECK = Check(CODE, "eps outside the square root", {}, check)
