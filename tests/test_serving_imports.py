"""The serving processes load no solver: a worker and a router, started as ``argus up`` starts
them (their real flags, mutual TLS on the internal plane, loopback), import neither PuLP nor
HiGHS nor any module of the allocator's package, at start, while heartbeating and reporting,
or while serving a request.

Every process of the cluster runs with ``PYTHONPROFILEIMPORTTIME=1`` (``python -X
importtime``), which logs each import as it happens, lazy ones inside ``serve`` and the
classifier's included. The allocator's log must show PuLP and HiGHS: that proves the logs are
read right, so an empty list for the others means something. Neither process imports another
service's package either (the router no worker module, the worker no router module, neither
the simulator): services meet in ``argus.contracts``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from argus.plumbing import rpc
from argus.tools.local_cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.e2e


router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \| *([\w.]+)")
SOLVER_PACKAGES = ("pulp", "highspy")
OTHER_SERVICES = {  # what each serving process must not import: services meet in contracts
    "worker-0": ("argus.allocator", "argus.router", "argus.sim"),
    "router": ("argus.allocator", "argus.worker", "argus.sim"),
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REQUEST_DEADLINE_S = 300  # the request only has to run the path; admission must not refuse it


def imported_modules(log: str) -> set[str]:
    """The modules an ``-X importtime`` log says were imported. Its lines read ``import time:
    SELF | CUMULATIVE | <indent>NAME``; one may follow other output on the same line (the
    process's own prints share the file), so they are found anywhere."""
    return set(IMPORT_LINE.findall(log))


def within(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """Those of ``modules`` that are one of ``packages`` or inside one, sorted."""
    return sorted(
        name for name in modules if any(name == p or name.startswith(p + ".") for p in packages)
    )


def test_the_importtime_log_is_read_as_python_writes_it() -> None:
    log = (
        "argus worker w listening on 127.0.0.1:1\n"
        "import time: self [us] | cumulative | imported package\n"
        "import time:       120 |        120 |     highspy._core\n"
        "import time:        80 |        200 |   highspy\n"
        "argus worker w readyimport time:        10 |         10 | argus.allocator.client\n"
    )
    modules = imported_modules(log)
    assert modules == {"highspy._core", "highspy", "argus.allocator.client"}
    assert within(modules, SOLVER_PACKAGES) == ["highspy", "highspy._core"]
    assert within(modules, OTHER_SERVICES["router"]) == ["argus.allocator.client"]
    assert within({"argus.allocator_tools", "pulpit", "argus.contracts.plans"}, ("pulp",)) == []


def test_worker_and_router_processes_import_no_solver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # the children inherit it
    spec = ClusterSpec(workdir=tmp_path, workers=1, controlnet=False, default_steps=4)
    with LocalCluster(spec) as cluster:  # returns once the router serves on a plan with it
        with cluster.channel() as channel:  # a deadline no loaded machine misses
            request = router_pb2.RouterGenerateRequest(
                prompt="a red fox in the snow", deadline_ms=REQUEST_DEADLINE_S * 1000
            )
            stub = router_pb2_grpc.RouterStub(channel)
            reply = stub.Generate(request, timeout=REQUEST_DEADLINE_S + 30)
        assert reply.png.startswith(PNG_MAGIC)
        logs = {name: part.log_text() for name, part in cluster.parts.items()}

    allocator = imported_modules(logs["allocator"])
    assert set(SOLVER_PACKAGES) <= allocator, "the allocator's importtime log was not read"
    for name, others in OTHER_SERVICES.items():
        modules = imported_modules(logs[name])
        assert "argus.contracts.workers" in modules, f"{name}: its importtime log was not read"
        assert within(modules, SOLVER_PACKAGES) == [], f"{name} imported a solver"
        assert within(modules, others) == [], f"{name} imported another service's modules"
