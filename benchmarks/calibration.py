"""The calibration set: healthy trainings and trainings broken one way on purpose, and the
table of values each flag's threshold was set from.

    python benchmarks/calibration.py [--out DIR [--reuse]] [--only NAME ...] [--small]

Every run trains a small model for a few hundred steps on the character corpus that ships
with Python (`normprobe.corpus.CharCorpus`) or on synthetic images, with ``normprobe.attach``
in a plain loop, then reads its flags back with ``normprobe.report.report``. The healthy runs
must raise no *problem*; each broken run must raise, as a problem, the flag made for its
fault, naming where the fault was put. The table prints, per flag, the statistic it thresholds
on every run, healthy then broken, and the threshold between them (``*`` marks the run
broken for that flag). The 16 runs take about 12 minutes on 2 CPU cores; ``--out DIR --reuse``
reprints the table from runs already trained there. ``tests/diagnose/test_calibration.py`` runs the
same set (``benchmarks/calibration_set.py``) at `SMALL` size, in about 40 seconds.
"""

from __future__ import annotations

import argparse
import itertools
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from calibration_set import CASES, FULL, SMALL, Outcome, run_case

from normprobe.metrics import (
    attn_logits,
    bn_stats,
    grad_norm,
    logits,
    outliers,
    resid_cos,
    resid_rms,
    spikes,
    update_ratio,
)
from normprobe.metrics.core.base import SUSTAIN
from normprobe.report import RunReport


# --- the table ---------------------------------------------------------------------------------
def _finite(values: tuple[float, ...]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _rows(rep: RunReport, metric: str) -> list[tuple[float, ...]]:
    """The values of ``metric``'s row in every stack that has it."""
    return [t.values for t in rep.trends if t.metric == metric and _finite(t.values)]


def _held(rep: RunReport, metric: str, low: bool = False) -> float:
    """What a rule held over the last `SUSTAIN` logged steps reads: the smallest of those
    values (the largest for a rule on small values), worst stack first."""
    ends = [_finite(v)[-SUSTAIN:] for v in _rows(rep, metric)]
    held = [max(e) if low else min(e) for e in ends]
    return (min(held) if low else max(held)) if held else math.nan


def _peak(rep: RunReport, metric: str) -> float:
    return max((max(_finite(v)) for v in _rows(rep, metric)), default=math.nan)


def _jump(rep: RunReport) -> float:
    """The largest ratio of a block's stream RMS to its predecessor's, held at the last
    `SUSTAIN` logged steps, worst stack."""
    found = []
    for name, profiles in rep.profiles.items():
        if name.startswith("resid_rms/"):
            ends = [
                max((b / a for a, b in itertools.pairwise(p) if a > 0), default=math.nan)
                for _, p in profiles[-SUSTAIN:]
            ]
            found.append(min(ends))
    return max(found, default=math.nan)


def _spikes(rep: RunReport) -> float:
    return float(sum(1 for f in rep.flags if f.kind.endswith(" spike")))


@dataclass(frozen=True)
class Statistic:
    """What a flag thresholds, read from a run's report, and its threshold(s)."""

    kind: str
    what: str
    read: Callable[[RunReport], float]
    threshold: str


STATISTICS = [
    Statistic(
        "top-heavy gradients",
        "grad_ratio (last / first block), held at the end",
        lambda r: _held(r, "grad_ratio"),
        f"note >= {grad_norm.TOP_LIMIT:g}, problem >= {grad_norm.TOP_PROBLEM:g}",
    ),
    Statistic(
        "bottom-heavy gradients",
        "grad_ratio, held at the end (largest of the last steps)",
        lambda r: _held(r, "grad_ratio", low=True),
        f"note <= {grad_norm.BOTTOM_LIMIT:g}",
    ),
    Statistic(
        "residual growth",
        "resid_growth (last / first block), held at the end",
        lambda r: _held(r, "resid_growth"),
        f"note >= {resid_rms.GROWTH_MIN:g} with slope >= {resid_rms.SLOPE_LIMIT:g}, "
        f"or >= {resid_rms.GROWTH_LIMIT:g}",
    ),
    Statistic(
        "residual jump",
        "largest resid_rms ratio of a block to the one before, held at the end",
        _jump,
        f"problem >= {resid_rms.JUMP_LIMIT:g}",
    ),
    Statistic(
        "representation collapse",
        "resid_cos, mean over the deep half, held at the end",
        lambda r: _held(r, "resid_cos[deep]"),
        f"problem > {resid_cos.COLLAPSE_COS:g}",
    ),
    Statistic(
        "logit blow-up",
        "attn_logit_max, worst module, held at the end",
        lambda r: _held(r, "attn_logit_max[max]"),
        f"note >= {attn_logits.SOFT_CAP:g}, problem >= tau = {attn_logits.TAU:g}",
    ),
    Statistic(
        "logit blow-up (head)",
        "the output head's max |logit|, held at the end",
        lambda r: _held(r, "logits/max_abs"),
        f"note >= {logits.LIMIT:g}",
    ),
    Statistic(
        "update too large",
        "update_ratio (mean over blocks), largest logged",
        lambda r: _peak(r, "update_ratio[mean]"),
        f"problem >= {update_ratio.LIMIT:g}",
    ),
    Statistic(
        "massive activations",
        "outlier_ratio (max / median non-negligible |activation|), worst block, held at the end",
        lambda r: _held(r, "outlier_ratio[max]"),
        f"problem > {outliers.RATIO_LIMIT:g}",
    ),
    Statistic(
        "batchnorm drift",
        "bn_var_drift (|log| batch / running variance), worst BatchNorm, held at the end",
        lambda r: _held(r, "bn_var_drift[max]"),
        f"problem > {bn_stats.LIMITS['var_drift']:.3g}",
    ),
    Statistic(
        "batchnorm drift (gap)",
        "bn_gap (train vs eval output, / its RMS), worst BatchNorm, held at the end",
        lambda r: _held(r, "bn_gap[max]"),
        f"problem > {bn_stats.LIMITS['gap']:g}",
    ),
    Statistic(
        "nan onset",
        "modules with NaN/Inf outputs, largest logged",
        lambda r: _peak(r, "nonfinite/modules"),
        "problem > 0",
    ),
    Statistic(
        "nan onset in backward",
        "modules with NaN/Inf input gradients, largest logged",
        lambda r: _peak(r, "nonfinite/backward_modules"),
        "problem > 0 when one module made it",
    ),
    Statistic(
        "spikes",
        "spikes found (loss or gradient norm)",
        _spikes,
        f"note; problem when {spikes.RECUR} fall within {spikes.RECUR_STEPS} steps",
    ),
]


def _cell(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.3g}"


def table(outcomes: list[Outcome]) -> str:
    """Per flag: the statistic on every healthy run, then every broken one (``*`` the run
    broken for this flag), and the threshold; then each run's problems."""
    names = [o.case.name for o in outcomes]
    width = max(len(n) for n in names)
    lines = []
    for st in STATISTICS:
        lines += ["", f"{st.kind}: {st.what}; {st.threshold}"]
        for label, healthy in (("healthy", True), ("broken", False)):
            cells = []
            for o in outcomes:
                if o.case.healthy != healthy:
                    continue
                mark = "*" if o.case.fault and st.kind == o.case.fault.kind else ""
                cells.append(f"{o.case.name}{mark} {_cell(st.read(o.report))}")
            lines.append(f"  {label:<8}" + "  ".join(cells))
    lines += ["", "Problems raised (healthy: none; broken: the flag made for its fault):"]
    for o in outcomes:
        verdict = "ok" if o.caught else "WRONG"
        made = f"  [{o.case.fault.what}: {o.case.fault.kind}]" if o.case.fault else ""
        raised = ", ".join(o.problems) or "none"
        lines.append(f"  {o.case.name:<{width}}  {verdict:<5}  {raised}{made}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these cases")
    parser.add_argument("--small", action="store_true", help="the test's reduced runs")
    parser.add_argument(
        "--reuse", action="store_true", help="read runs already in --out instead of training"
    )
    args = parser.parse_args(argv)
    size = SMALL if args.small else FULL
    cases = [c for c in CASES if args.only is None or c.name in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        outcomes = []
        for case in cases:
            outcomes.append(run_case(case, size, root, args.reuse))
            print(f"{case.name}: problems {outcomes[-1].problems or 'none'}", flush=True)
        print(table(outcomes))
    return 0 if all(o.caught for o in outcomes) else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
