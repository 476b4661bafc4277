"""Shared by the ``check_*.py`` examples: named expectations, ``--expect`` overrides, the verdict.

Each check script declares what it expects (a value with a tolerance, a bound, or an exact
string), measures through normprobe, and prints one line per quantity::

    [d] pre_ln_ratio   Pre-LN grad_ratio/lins   measured 0.3995   expected 0.4 ± 0.005   OK

It exits with status 1 when any line is a MISMATCH. ``--expect NAME=VALUE`` replaces the
expected value of NAME (its tolerance stays), which is how the tests show that a wrong
expectation really fails.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class Expect:
    """What one measured quantity should be.

    ``op`` is ``"~"`` (``|measured - value| <= tol``), ``"<"`` or ``">"`` (a bound), or ``"=="``
    (an exact string such as a discovered kind).
    """

    value: float | str
    tol: float = 0.0
    op: str = "~"

    def holds(self, measured: float | str) -> bool:
        if self.op == "==":
            return str(measured) == str(self.value)
        m, v = float(measured), float(self.value)
        if self.op == "<":
            return m < v
        if self.op == ">":
            return m > v
        return abs(m - v) <= self.tol

    def describe(self) -> str:
        if self.op == "==":
            return repr(self.value)
        if self.op in ("<", ">"):
            return f"{self.op} {self.value:.4g}"
        return f"{self.value:.4g} ± {self.tol:.2g}"


def _fmt(measured: float | str) -> str:
    return repr(measured) if isinstance(measured, str) else f"{measured:.4g}"


class Checks:
    """The expectations of one sanity check, its command line and its verdict."""

    def __init__(self, label: str, description: str, expected: dict[str, Expect]) -> None:
        self.label = label
        self.description = description
        self.expected = expected
        self.failed: list[str] = []

    def parser(self) -> argparse.ArgumentParser:
        names = "\n".join(f"  {n:<22} {e.describe()}" for n, e in self.expected.items())
        parser = argparse.ArgumentParser(
            description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"expectations (NAME, default):\n{names}\n\nExit status: 0 when every "
            "measurement matches its expectation, 1 otherwise.",
        )
        parser.add_argument(
            "--expect",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="replace the expected value of NAME (its tolerance or bound stays); repeatable",
        )
        return parser

    def parse(self, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
        """Parse the command line (``parser`` may carry the script's own options)."""
        parser = parser or self.parser()
        args = parser.parse_args()
        for item in args.expect:
            name, sep, value = item.partition("=")
            if not sep or name not in self.expected:
                parser.error(f"--expect {item!r}: NAME must be one of {list(self.expected)}")
            e = self.expected[name]
            if e.op == "==":
                e.value = value
            else:
                try:
                    e.value = float(value)
                except ValueError:
                    parser.error(f"--expect {item!r}: VALUE must be a number")
        return args

    def check(self, name: str, what: str, measured: float | str) -> bool:
        """Print measured against expected for ``name``; remember a mismatch."""
        e = self.expected[name]
        ok = e.holds(measured)
        if not ok:
            self.failed.append(name)
        print(
            f"[{self.label}] {name:<18} {what:<34} measured {_fmt(measured):<14} "
            f"expected {e.describe():<16} {'OK' if ok else 'MISMATCH'}"
        )
        return ok

    def verdict(self) -> int:
        """Print the summary line and return the exit status."""
        if self.failed:
            print(f"check [{self.label}] FAILED: {', '.join(self.failed)}")
            return 1
        print(f"check [{self.label}] passed")
        return 0
