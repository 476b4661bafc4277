"""``normprobe diagnose module:function``: import the entry, run `diagnose`, print the report.

With ``--json`` it prints `Diagnosis.to_dict` (keys in `normprobe.diagnose.result`). Exit status:
0 no finding, 1 findings, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from torch import nn

from ..jsonout import dumps
from .api import diagnose
from .inputs import Batch, LossFn, loss_caller, split_batch
from .result import DIAGNOSE_SCHEMA, DiagnoseInputError

_EPILOG = """\
ENTRY names a function, module:function, returning (model, batch) or (model, batch, loss_fn);
batch is what diagnose() takes: a tensor, a tuple of positional inputs or a dict of keyword
inputs. loss_fn is called as loss_fn(output), or as loss_fn(output, batch) when it requires two
parameters (output: what the model returned on batch) and returns the scalar tensor to
backpropagate; without it the loss is the model's own .loss, else the mean of squares of its
logits. Exit status: 0 no finding, 1 findings, 2 bad input (entry not found, wrong return
value, a loss_fn of another signature, the model failing on the batch). --json prints the
report as JSON (schema normprobe.diagnose/1: model, loss, findings, checks, measurements).
"""


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``diagnose`` subcommand on an argparse ``add_subparsers()`` object.

    The subcommand's ``run`` default takes the parsed arguments and returns the exit status:
    0 without findings, 1 with findings, 2 for bad input.

    Example::

        parser = argparse.ArgumentParser(prog="normprobe")
        commands = parser.add_subparsers(dest="command", required=True)
        add_cli(commands)
        args = parser.parse_args(["diagnose", "mymodels:build", "--path", "src"])
        raise SystemExit(args.run(args))
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "diagnose",
        help="one forward/backward on a batch, and a report of what looks wrong",
        description="Run one forward/backward of a model on a batch and report problems with "
        "its normalization, residual stream and initialization, with the evidence and a fix.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("entry", metavar="ENTRY", help="module:function building the model")
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="directory to import ENTRY's module from (repeatable; the current directory is "
        "always searched)",
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="run the step in the model's current mode instead of training mode",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON document ({DIAGNOSE_SCHEMA}) instead of the report",
    )
    parser.set_defaults(run=run_cli)
    return parser


def load_entry(entry: str, paths: Sequence[str] = ()) -> tuple[nn.Module, Batch, LossFn | None]:
    """Import ``module:function``, call it and check what it returns.

    Raises:
        DiagnoseInputError: a malformed entry, a module or function that is not there, or a
            return value that is not ``(model, batch)`` / ``(model, batch, loss_fn)``.
    """
    module_name, sep, func_name = entry.partition(":")
    if not sep or not module_name or not func_name:
        raise DiagnoseInputError(
            f"ENTRY must be module:function, like mymodels:build, got {entry!r}"
        )
    module = _import_entry_module(entry, module_name, paths)
    func = getattr(module, func_name, None)
    if not callable(func):
        known = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and n[:1] != "_"
        )
        raise DiagnoseInputError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
            f"{func_name!r}; functions there: {known[:10]}"
        )
    model, batch, *rest = _checked_result(entry, func())
    loss_fn = rest[0] if rest else None
    try:  # a bad batch type or loss_fn fails here, naming the entry
        split_batch(batch)
        loss_caller(loss_fn)
    except DiagnoseInputError as err:
        raise DiagnoseInputError(f"{entry}: {err}") from err
    return model, batch, loss_fn


def _import_entry_module(entry: str, module_name: str, paths: Sequence[str]) -> ModuleType:
    """Import ``module_name`` with ``paths`` and the current directory first on the path."""
    for p in [*paths, "."][::-1]:
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise DiagnoseInputError(
                f"no module {module_name!r} on the import path (from ENTRY {entry!r}); run from "
                "its directory or add it with --path DIR"
            ) from err
        raise


def _checked_result(entry: str, result: Any) -> tuple[Any, ...]:
    """The entry's return value when it is ``(model, batch)`` or ``(model, batch, loss_fn)``."""
    ok = (
        isinstance(result, tuple)
        and len(result) in (2, 3)
        and isinstance(result[0], nn.Module)
        and (len(result) == 2 or result[2] is None or callable(result[2]))
    )
    if not ok:
        got = (
            f"a tuple of ({', '.join(type(r).__name__ for r in result)})"
            if isinstance(result, tuple)
            else type(result).__name__
        )
        raise DiagnoseInputError(
            f"{entry} must return (model, batch) or (model, batch, loss_fn) with model an "
            f"nn.Module, got {got}"
        )
    return tuple(result)


def run_cli(args: argparse.Namespace) -> int:
    """``normprobe diagnose``: print the report; 0 no finding, 1 findings, 2 bad input."""
    try:
        model, batch, loss_fn = load_entry(args.entry, args.path)
        result = diagnose(model, batch, loss_fn, train=not args.eval)
    except DiagnoseInputError as err:
        print(f"normprobe diagnose: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        traceback.print_exc()
        print(
            f"normprobe diagnose: error: {args.entry} failed: {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 2
    print(dumps(result.to_dict()) if args.json else result)
    return 1 if result.findings else 0
