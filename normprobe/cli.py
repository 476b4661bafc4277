"""The ``normprobe`` command: ``normprobe diagnose ...`` and ``normprobe report ...``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .diagnose.cli import add_cli as add_diagnose
from .report.cli import add_cli as add_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="normprobe",
        description="Look at the normalization, residual and initialization behaviour of models.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_diagnose(commands)
    add_report(commands)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
