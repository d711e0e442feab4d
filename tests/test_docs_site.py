"""The manual (``docs/``, built by MkDocs from ``mkdocs.yml``) against the code it describes.

Every ``argus`` subcommand has a page with every flag its parser takes, every route of the
router's HTTP app and every field it accepts is on the HTTP API page, every gRPC method of
``proto/`` is on the gRPC page, every metric the processes export is on its service's page,
and nothing is documented that the code does not have. The code is introspected, not
restated: the subcommands and their parsers as ``argus.cli.main.main`` builds them, the routes
from the Starlette app the router serves, the accepted fields from that app's own answer to an
unknown one, the metrics from the registries each process builds. The helpers at the top are
the one place that knows where those live.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMMAND_PAGES = DOCS / "commands"
HTTP_PAGE = DOCS / "api" / "http.md"
GRPC_PAGE = DOCS / "api" / "grpc.md"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
SERVICE = re.compile(r"^service (\w+) \{(.*?)^\}", re.M | re.S)  # a .proto's service block
RPC = re.compile(r"^\s*rpc (\w+)\(", re.M)


# -- where the code keeps what the manual describes ------------------------------------------


def argus_subcommands() -> list[str]:
    """The subcommands of the parser ``argus.cli.main.main`` builds, recorded as it adds them
    (``argus --help`` builds the top-level parser and nothing else)."""
    from argus.cli.main import main

    names: list[str] = []
    add_parser = argparse._SubParsersAction.add_parser

    def recording(self: Any, name: str, **kwargs: Any) -> Any:
        names.append(name)
        return add_parser(self, name, **kwargs)

    with (
        mock.patch.object(argparse._SubParsersAction, "add_parser", recording),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        main(["--help"])
    return names


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def argus_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``argus NAME`` parses its arguments with, taken as ``main`` hands it its
    arguments (so nothing runs)."""
    from argus.cli.main import main

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Built(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main([name])
        except _Built as built:
            return built.parser
    raise AssertionError(f"argus {name}: main never parsed its arguments")


def router_http_app() -> Any:
    """The router's HTTP app (Starlette), on a real router core with a stub classifier."""
    from argus.router.config import RouterServiceConfig
    from argus.router.core import RouterCore
    from argus.router.http_app import create_app
    from argus.router.worker_calls import GrpcWorkers
    from tests.router_cluster import PROFILES, StubClassifier

    core = RouterCore(PROFILES, StubClassifier(0), RouterServiceConfig(), workers=GrpcWorkers())
    return create_app(core)


def exported_metric_families() -> dict[str, str]:
    """Name → type of every ``argus_*`` family the processes' metrics modules export, each
    built on a registry of its own as its process builds it."""
    from prometheus_client import CollectorRegistry

    from argus.allocator.metrics import AllocatorMetrics
    from argus.profiles import default_profiles
    from argus.router.metrics import RouterMetrics
    from argus.worker.adapters.controlnet.cache import CacheStats
    from argus.worker.adapters.controlnet.executor import ExecutorStats
    from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
    from argus.worker.approx_cache.cache import CacheMetrics
    from argus.worker.metrics import WorkerMetrics

    registries = [CollectorRegistry() for _ in range(4)]
    AllocatorMetrics(default_profiles(), registries[0])
    RouterMetrics(default_profiles(), registries[1])
    WorkerMetrics(registries[2])
    CacheMetrics(registries[2])
    idle = ExecutorStats(CacheStats("lru", 0, 0, 0, 0, 0, 0.0, (), 0, 0), 0, 0, 0)
    ControlNetMetrics(lambda: idle, registries[3])
    return {family.name: family.type for registry in registries for family in registry.collect()}


# -- reading the manual ----------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The body under the Markdown heading line ``heading``, up to the next heading of its
    level or above."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    body = []
    for line in lines[start + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        body.append(line)
    return "\n".join(body)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row in ``text``, header and rule rows left out."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return [row for row in rows if row and row[0] not in ("flag", "metric", "method", "route")]


def command_page(name: str) -> str:
    return (COMMAND_PAGES / f"{name}.md").read_text()


def documented_flags(page: str) -> set[str]:
    """The options the page's flag table lists (its first column, ``--x VALUE`` or ``--x``)."""
    flags = set()
    for row in table_rows(section(page, "## Flags")):
        flags.update(re.findall(r"`(--?[A-Za-z0-9][\w-]*)", row[0]))
    return flags


def nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def all_docs_text() -> str:
    return "\n".join(path.read_text() for path in sorted(DOCS.rglob("*.md")))


# -- the tests -------------------------------------------------------------------------------


def test_every_subcommand_has_its_page_and_every_page_a_subcommand() -> None:
    names = argus_subcommands()
    assert "plan" in names and "up" in names  # the recording saw the real parser
    for name in names:
        page = COMMAND_PAGES / f"{name}.md"
        assert page.is_file(), f"argus {name}: no page {page.relative_to(ROOT)}"
        assert page.read_text().startswith(f"# argus {name}\n"), f"{page.name}: title"
    pages = {p.stem for p in COMMAND_PAGES.glob("*.md")} - {"index"}
    assert pages <= set(names), f"pages for no subcommand: {sorted(pages - set(names))}"
    index = (COMMAND_PAGES / "index.md").read_text()
    for name in names:
        assert f"[`argus {name}`]({name}.md)" in index, f"argus {name}: not in commands/index.md"


@pytest.mark.parametrize("name", argus_subcommands())
def test_every_flag_is_on_its_command_page_and_nothing_more(name: str) -> None:
    parser = argus_parser(name)
    options = {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}
    documented = documented_flags(command_page(name))
    assert options - documented == set(), f"argus {name}: flags not on its page"
    assert documented - options == set(), f"argus {name}: documented flags it does not take"


def test_every_route_of_the_http_app_is_documented_and_nothing_more() -> None:
    app = router_http_app()
    served = {
        (method, route.path)
        for route in app.routes
        for method in (route.methods or ())
        if method != "HEAD"  # Starlette adds it to every GET
    }
    assert ("POST", "/v1/images/generations") in served
    page = HTTP_PAGE.read_text()
    pattern = rf"^## `({'|'.join(METHODS)}) (/\S*)`$"
    documented = {(m[1], m[2]) for m in re.finditer(pattern, page, flags=re.M)}
    assert served - documented == set(), "routes the app serves that api/http.md lacks"
    assert documented - served == set(), "routes api/http.md documents that the app lacks"
    routes_table = {tuple(row[0].strip("`").split(" ", 1)) for row in table_rows(page)[:5]}
    assert served <= routes_table, "the Routes table lacks a route"


def accepted_fields(app: Any, path: str, form: bool) -> set[str]:
    """The fields ``path`` accepts, as the app lists them when refusing an unknown one."""
    from starlette.testclient import TestClient

    unknown = "no_such_field"
    with TestClient(app) as client:
        if form:
            answer = client.post(path, files={unknown: (None, "1")})
        else:
            answer = client.post(path, json={unknown: 1})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == unknown, error
    supported = error["message"].split("supported:", 1)[1]
    return {field.strip() for field in supported.split(",")}


@pytest.mark.parametrize(
    ("path", "form"), [("/v1/images/generations", False), ("/v1/images/edits", True)]
)
def test_every_field_a_route_accepts_is_documented_under_it(path: str, form: bool) -> None:
    fields = accepted_fields(router_http_app(), path, form)
    assert "prompt" in fields
    body = section(HTTP_PAGE.read_text(), f"## `POST {path}`")
    missing = {field for field in fields if f"`{field}`" not in body}
    assert missing == set(), f"{path}: fields not documented under its heading"


def test_every_grpc_method_is_documented_and_nothing_more() -> None:
    methods = set()
    for proto in sorted((ROOT / "proto" / "argus" / "v1").glob("*.proto")):
        for service, body in SERVICE.findall(proto.read_text()):
            methods.update(f"{service}.{rpc}" for rpc in RPC.findall(body))
    assert "Router.Generate" in methods
    table = section(GRPC_PAGE.read_text(), "## Services")
    documented = {row[0].strip("`") for row in table_rows(table)}
    assert methods - documented == set(), "methods api/grpc.md's table lacks"
    assert documented - methods == set(), "methods api/grpc.md documents that proto/ lacks"


def test_every_exported_metric_is_on_a_service_page_and_nothing_more() -> None:
    families = exported_metric_families()
    assert "argus_router_requests" in families
    documented = {}
    for page in ("router", "allocator", "worker", "controlnet"):
        for row in table_rows(section(command_page(page), "## Metrics")):
            documented[row[0].strip("`")] = row[1]
    exported = {
        name + "_total" if kind == "counter" else name: kind for name, kind in families.items()
    }
    assert exported.keys() - documented.keys() == set(), "metrics no service page lists"
    assert documented.keys() - exported.keys() == set(), "documented metrics nothing exports"
    wrong = {name for name, kind in documented.items() if exported[name] != kind}
    assert wrong == set(), "metrics documented with another type"


def test_every_page_of_the_navigation_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs_dir = ROOT / config.get("docs_dir", "docs")
    pages = nav_pages(config["nav"])
    assert "index.md" in pages and "architecture.md" in pages
    missing = [page for page in pages if not (docs_dir / page).is_file()]
    assert missing == [], f"mkdocs.yml names pages docs/ lacks: {missing}"
    assert len(pages) == len(set(pages)), "a page is in the navigation twice"


def test_the_readme_keeps_the_set_up_commands_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    install = (
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 "
        "&& .venv/bin/pip install -e '.[dev]' && "
    )
    for command in (
        install + ".venv/bin/argus up --workers 2 --demo 8 --out demo-out",
        install + ".venv/bin/pytest -n 2",
    ):
        assert f"\n{command}\n" in readme, command
        assert f"\n{command}\n" in (DOCS / "getting-started.md").read_text(), command
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which is missing"
    assert len(readme.splitlines()) <= 300, "the README is a short introduction; the rest: docs/"
    text = all_docs_text()
    assert "SYNTHETIC" in readme and "SYNTHETIC" in text
