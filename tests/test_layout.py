"""The package's layout, as the architecture draws it: no import cycles anywhere (imports
inside functions included, annotations-only imports excluded), and imports at the top of a
module except those of optional drivers. The layer contracts are import-linter's, in
pyproject.toml (``lint-imports``, run by CI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

PACKAGE = Path(__file__).parent.parent / "celery_dlock"
#: What may be imported inside a function: drivers that an extra installs.
OPTIONAL = (
    "google.",
    "celery_dlock.celery.",
    "psutil.",
    "prometheus_client.",
    "waitress.",
    "celery_dlock.cli.web.",
)


def test_no_module_imports_itself_back_through_another() -> None:
    graph = grimp.build_graph(
        "celery_dlock", include_external_packages=False, exclude_type_checking_imports=True
    )
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert cycles == []


def test_imports_inside_functions_are_for_optional_drivers_only() -> None:
    late = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                late += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}"
                    for name in names
                    if not f"{name}.".startswith(OPTIONAL)
                ]
    assert late == []


#: Past this many lines a module holds more than one concern (the architecture's "about 400").
MODULE_LINES = 480
#: What a module that is a table (statements, scripts) says in its first docstring line.
TABLE = ("Every statement", "The Lua scripts")


def test_no_module_is_past_its_bound_unless_it_is_a_table() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MODULE_LINES and not docstring.startswith(TABLE):
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert long == []
