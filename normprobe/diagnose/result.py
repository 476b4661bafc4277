"""What `diagnose` returns: the findings, the report ``print()`` shows, and its JSON document.

``normprobe diagnose --json`` prints `Diagnosis.to_dict`:

* ``schema``: ``"normprobe.diagnose/1"``; a change that breaks readers changes the number;
* ``model``: the model's class name; ``loss``: the loss the backward ran from;
* ``findings``: ``{"code", "title", "evidence", "suggestion", "paths"}``, in the order of
  `CHECKS` (``evidence``: lines of measured numbers; ``paths``: the module paths concerned);
* ``checks``: per code of `CHECKS`, ``{"status", "reason"}``: status ``ok``, ``found`` or
  ``n/a``, with why it does not apply as the reason (else ``null``);
* ``measurements``: tag -> number, the probe's ``normprobe/...`` scalars of the step and the
  checks' own ``diagnose/...`` values.

Non-finite numbers are ``null``. Exit status as without ``--json``; on bad input (2) nothing is
printed to stdout, the error goes to stderr.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from ..discovery import ModelMap
from ..jsonout import json_number

# the ``schema`` of ``normprobe diagnose --json``
DIAGNOSE_SCHEMA = "normprobe.diagnose/1"


class DiagnoseInputError(ValueError):
    """An entry point, batch or loss that `diagnose` cannot work with."""


@dataclass(frozen=True)
class Finding:
    """One problem `diagnose` found.

    Attributes:
        code: the check that found it (a key of `CHECKS`).
        title: one line saying what is wrong.
        evidence: the measured numbers and layer paths, one line each.
        suggestion: what to do about it.
        paths: the module paths concerned.
    """

    code: str
    title: str
    evidence: tuple[str, ...]
    suggestion: str
    paths: tuple[str, ...] = ()


@dataclass
class Diagnosis:
    """What `diagnose` found; ``print()`` it for the report.

    Attributes:
        model_type: the model's class name.
        findings: the problems found, in the order of `CHECKS`.
        checks: per check of `CHECKS`: ``"ok"``, ``"found"`` or ``"n/a: <why>"``.
        measurements: the probe's scalars for the step (``normprobe/...``) and diagnose's own
            (``diagnose/...``).
        model_map: what discovery found.
        loss: the loss the backward ran from.
    """

    model_type: str
    findings: list[Finding]
    checks: dict[str, str]
    measurements: dict[str, float]
    model_map: ModelMap
    loss: float

    @property
    def codes(self) -> list[str]:
        """The codes of the findings, in order."""
        return [f.code for f in self.findings]

    def __str__(self) -> str:
        lines = [
            f"normprobe diagnose: {self.model_type}, one forward/backward (loss {self.loss:.4g})"
        ]
        if not self.findings:
            lines.append("No problems found.")
        else:
            n = len(self.findings)
            lines.append(f"{n} finding{'s' if n > 1 else ''}:")
        for i, f in enumerate(self.findings, 1):
            lines += _finding_lines(i, f)
        lines.append("")
        if self.model_map.doubts:
            lines += self._doubt_lines()
        ok = [c for c, s in self.checks.items() if s == "ok"]
        na = [f"{c} ({s[5:]})" for c, s in self.checks.items() if s.startswith("n/a")]
        if ok:
            lines += textwrap.wrap("Passed: " + ", ".join(ok), 100, subsequent_indent="  ")
        if na:
            lines += textwrap.wrap("Not applicable: " + "; ".join(na), 100, subsequent_indent="  ")
        return "\n".join(lines)

    def _doubt_lines(self) -> list[str]:
        lines = ["The model's map is unsure (the actions named refuse while it is):"]
        for d in self.model_map.doubts:
            lines += textwrap.wrap(
                f"- {d.kind} at {d.path or '<root>'}: {d.reason} [{', '.join(d.affects)}]",
                96,
                initial_indent="  ",
                subsequent_indent="    ",
            )
        lines.append("")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (`DIAGNOSE_SCHEMA`; keys in the module's docstring)."""
        checks = {}
        for code, state in self.checks.items():
            status, _, reason = state.partition(": ")
            checks[code] = {"status": status, "reason": reason or None}
        return {
            "schema": DIAGNOSE_SCHEMA,
            "model": self.model_type,
            "loss": json_number(self.loss),
            "findings": [
                {
                    "code": f.code,
                    "title": f.title,
                    "evidence": list(f.evidence),
                    "suggestion": f.suggestion,
                    "paths": list(f.paths),
                }
                for f in self.findings
            ],
            "checks": checks,
            "measurements": {tag: json_number(v) for tag, v in self.measurements.items()},
        }


def _finding_lines(i: int, f: Finding) -> list[str]:
    """Finding number ``i`` in the report: its title, evidence and suggestion, wrapped."""
    lines = ["", f"{i}. {f.title}  [{f.code}]"]
    for e in f.evidence:
        lines += textwrap.wrap(e, 96, initial_indent="   ", subsequent_indent="     ")
    lines += textwrap.wrap(
        f"-> {f.suggestion}", 96, initial_indent="   ", subsequent_indent="      "
    )
    return lines
