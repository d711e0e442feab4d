"""Test-session settings that must be in place before any test module imports grpc."""

import os
from collections.abc import Iterator
from typing import Any

# Tests start real worker processes (subprocess, fork + exec) while the test process holds
# live gRPC channels; grpc's fork handlers can then stall the parent's new connections.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from tests.tls_factories import TestCA

TIERS = ("unit", "integration", "e2e")
"""The tiers every test belongs to, exactly one each (registered in pyproject.toml): ``unit``
runs in one process with no server; ``integration`` starts several services in process or
talks to one over real sockets or as a subprocess; ``e2e`` runs whole clusters (``argus up``,
LocalCluster)."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse to run when a test has no tier marker, or more than one, naming the tests."""
    wrong = [
        item.nodeid
        for item in items
        if sum(item.get_closest_marker(tier) is not None for tier in TIERS) != 1
    ]
    if wrong:
        shown = ", ".join(wrong[:10]) + (f" and {len(wrong) - 10} more" if len(wrong) > 10 else "")
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {', '.join(TIERS)} "
            f"(a module's `pytestmark = pytest.mark.unit`, or one per test): {shown}"
        )


@pytest.fixture(scope="session")
def cluster_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    """One cluster CA for the session; tests issue the certificates they need from it."""
    return TestCA(tmp_path_factory.mktemp("cluster-ca"))


@pytest.fixture(scope="module")
def tiny_worker() -> Iterator[Any]:
    """A worker with the tiny random pipeline on the CPU, one per test module."""
    from tests.worker_factories import make_worker

    made = make_worker()
    yield made
    made.close()


@pytest.fixture(scope="module")
def tiny_worker_stub(tiny_worker: Any) -> Iterator[Any]:
    """A WorkerStub on ``tiny_worker`` behind its real gRPC server on loopback."""
    import grpc

    from argus.plumbing import rpc
    from argus.worker.service import create_server

    server, port, _ = create_server(tiny_worker)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield rpc.load("worker_pb2_grpc").WorkerStub(channel)
    channel.close()
    server.stop(grace=None)
