"""The package's hygiene that review alone lets slip: no two modules import each other, however
indirectly, and module docstrings say what a module is, briefly, without tracker history.

Every import counts, also one inside a function: a circle of lazy imports still means neither
module can be read, tested or moved without the other. Docstrings are the first thing a
newcomer reads; history and dated figures belong in the commit log and ``docs/``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import argus

pytestmark = pytest.mark.unit

PACKAGE = Path(argus.__file__).parent
MAX_DOCSTRING_LINES = 40
TRACKER_REFERENCE = re.compile(r"\b(?:[Ii]ssues? \d+|items? \d+)\b")


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of ``argus`` but the generated ``argus/v1``, by dotted name."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "v1":
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``argus`` that ``name`` imports anywhere in its source (``from a import
    b`` counts as ``a.b`` when that is a module)."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = dict(modules())
    known = set(paths)
    return {name: imports_of(name, path, known) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_check_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_module_docstrings_are_short_and_carry_no_tracker_history() -> None:
    found = []
    for name, path in modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        lines = doc.count("\n") + 1
        if lines > MAX_DOCSTRING_LINES:
            found.append(f"{name}: docstring of {lines} lines (at most {MAX_DOCSTRING_LINES})")
        if reference := TRACKER_REFERENCE.search(doc):
            found.append(f"{name}: docstring names {reference.group(0)!r}")
    assert not found, "\n".join(found)
