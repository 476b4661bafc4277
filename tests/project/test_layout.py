"""The package's layout stays navigable: modules of one concern (at most `MODULE_LINES` lines),
functions of at most `FUNCTION_LINES` lines of code, and no import cycle, lazy imports included
(`if TYPE_CHECKING:` imports aside)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "normprobe"
MODULE_LINES = 500
FUNCTION_LINES = 60  # non-blank, non-comment lines, docstring left out


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _code_lines(source: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.lineno
    body = node.body
    docstring = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    skipped = range(body[0].lineno, (body[0].end_lineno or 0) + 1) if docstring else range(0)
    lines = range(first, (node.end_lineno or first) + 1)
    return sum(
        1
        for n in lines
        if n not in skipped and source[n - 1].strip() and not source[n - 1].strip().startswith("#")
    )


def test_modules_hold_at_most_500_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE))
        for path in _modules().values()
        if len(path.read_text().splitlines()) > MODULE_LINES
    }
    assert long == set(), f"split these modules by concern: {sorted(long)}"


def test_functions_hold_at_most_60_lines_of_code() -> None:
    long = []
    for path in _modules().values():
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _code_lines(source, node)
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert long == []


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        else:
            todo += ast.iter_child_nodes(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join([*base, node.module or ""]).strip(".") if node.level else node.module
            for alias in node.names:
                child = f"{target}.{alias.name}"
                if child in modules:
                    graph[name].add(child)
                elif target in modules:
                    graph[name].add(str(target))
    return graph


def test_no_import_cycle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for target in sorted(graph[name]):
            # a package's own __init__ re-exporting its modules is no cycle of theirs
            if not name.startswith(target + "."):
                visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
