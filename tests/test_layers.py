"""The floors of ``argus``: a module imports only from its own floor and the floors below, and the
three services, one floor, never import each other.

:data:`FLOORS` is the one statement of the layering; the drawing in ``docs/architecture.md``
mirrors it. Every module of ``argus/`` (the generated ``argus/v1`` aside) is parsed with
:mod:`ast`, and every import in it counts: at module level, inside a function (the lazy imports
of the command line and of the services' ``serve``), and under ``TYPE_CHECKING`` too, since a
type named from a floor above ties the module to that floor as much as a call does (mypy loads
it, and the drawing would lie about what the module needs to be read). A module or package
that is in no floor fails too, so a new one is placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import argus

pytestmark = pytest.mark.unit

PACKAGE = Path(argus.__file__).parent

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "domain values and plumbing",
        (
            "argus",
            "argus.types",
            "argus.defaults",
            "argus.slo",
            "argus.request_limits",
            "argus.prompt_split",
            "argus.traces",
            "argus.embedding",
            "argus.plumbing",
            "argus.v1",
        ),
    ),
    ("contracts", ("argus.contracts",)),
    ("classifier and profiles", ("argus.classifier", "argus.profiles")),
    ("services", ("argus.allocator", "argus.router", "argus.worker")),
    ("simulator", ("argus.sim",)),
    ("tools and command line", ("argus.tools", "argus.cli", "argus.__main__")),
)
"""Bottom first: each entry is a floor's name and the modules and packages on it (a package
stands for all its modules; ``argus`` is the root package's ``__init__`` alone)."""

SERVICES = ("argus.allocator", "argus.router", "argus.worker")
"""The services share a floor but none may import another: they meet in ``argus.contracts``."""


@dataclass(frozen=True)
class Place:
    """Where a module stands: its floor's index (0 is the bottom) and the unit that owns it (the
    package or root module named in :data:`FLOORS`)."""

    floor: int
    unit: str


def place_of(module: str) -> Place | None:
    """The floor of ``module`` by the longest name in :data:`FLOORS` that is it or contains it;
    None for a module of ``argus`` no floor names."""
    best: Place | None = None
    for index, (_, units) in enumerate(FLOORS):
        for unit in units:
            # the root package holds only its own __init__; its modules are named one by one
            inside = module == unit or (unit != "argus" and module.startswith(unit + "."))
            if inside and (best is None or len(unit) > len(best.unit)):
                best = Place(index, unit)
    return best


def module_name(path: Path) -> str:
    """``argus/worker/engine.py`` -> ``argus.worker.engine``; a package's ``__init__`` is the
    package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` (under ``argus``) is a module or package on disk, as opposed to a name
    defined in a package's ``__init__``."""
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported_modules(importer: str, source: str, *, is_package: bool) -> Iterator[str]:
    """Every module of ``argus`` that ``source`` imports, anywhere in its tree: ``from argus
    import x`` counts as ``argus.x`` when that is a module, relative imports are resolved."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = importer.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield child if base.startswith("argus") and is_module(child) else base


def violations_in(importer: str, source: str, *, is_package: bool = False) -> list[str]:
    """What is wrong with ``importer``'s imports, one line each naming importer and imported."""
    where = place_of(importer)
    if where is None:
        return [f"{importer} is on no floor: add it to FLOORS (and the drawing)"]
    found = []
    for imported in sorted(set(imported_modules(importer, source, is_package=is_package))):
        if imported != "argus" and not imported.startswith("argus."):
            continue
        there = place_of(imported)
        if there is None:
            found.append(f"{importer} imports {imported}, which is on no floor")
        elif there.floor > where.floor:
            found.append(
                f"{importer} ({FLOORS[where.floor][0]}) imports {imported} "
                f"({FLOORS[there.floor][0]}), a floor above"
            )
        elif there.unit != where.unit and {there.unit, where.unit} <= set(SERVICES):
            found.append(f"{importer} imports {imported}: one service imports another")
    return found


def argus_modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package but the generated ``argus/v1``."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if "v1" not in path.relative_to(PACKAGE).parts[:1]:
            yield module_name(path), path


def test_no_module_imports_up_a_floor_or_another_service() -> None:
    found = [
        line
        for name, path in argus_modules()
        for line in violations_in(
            name, path.read_text(encoding="utf-8"), is_package=path.name == "__init__.py"
        )
    ]
    assert not found, "imports against the floors:\n" + "\n".join(found)


def test_every_package_and_root_module_is_on_a_floor() -> None:
    units = {unit for _, floor_units in FLOORS for unit in floor_units}
    on_disk = {module_name(path) for path in PACKAGE.glob("*.py") if path.name != "__init__.py"} | {
        f"argus.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")
    }
    assert on_disk - units == set()
    assert units - on_disk - {"argus"} == set(), "FLOORS names a module that does not exist"


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        ("argus.worker.scoring", "from argus.tools.profiler import PickScorer", "a floor above"),
        ("argus.classifier.distill", "def f():\n    from argus.sim import quality", "floor above"),
        (
            "argus.contracts.generate",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import argus.router.core",
            "a floor above",
        ),
        ("argus.router.core", "from argus.worker import engine", "one service imports another"),
        ("argus.types", "from argus import slo, tools", "a floor above"),
        ("argus.worker.adapters.lora.errors", "from ....tools import live", "a floor above"),
        ("argus.newthing", "import os", "on no floor"),
    ],
)
def test_the_check_names_importer_and_imported(importer: str, source: str, expected: str) -> None:
    """The checker on hand-written sources: a module-level, a function-level, a TYPE_CHECKING and
    a relative import up a floor, two services, and a module no floor holds are each caught."""
    found = violations_in(importer, source)
    assert len(found) == 1, found
    assert expected in found[0] and importer in found[0]


def test_imports_down_and_within_a_service_pass() -> None:
    source = (
        "from argus import defaults\nfrom argus.plumbing import rpc\n"
        "from argus.contracts.generate import GenerateCall\nfrom argus.classifier import serving\n"
        "from argus.router.values import RouterRequest\nimport numpy\n"
    )
    assert violations_in("argus.router.core", source) == []
