"""A worker's certificate speaks only for that worker: the allocator takes a heartbeat (a join,
a move, a leave) only when its ``worker_id`` is the name in the caller's certificate
(``argus://worker/NAME``). Played as the intruder holding worker-1's certificate, against a
real allocator on loopback with mutual TLS."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from argus.allocator.control import ControlConfig
from argus.allocator.membership import NotOwnerError
from argus.allocator.service import AllocatorServicer, check_worker_identity
from argus.allocator.service import create_server as create_allocator
from argus.contracts.allocator_client import AllocatorClient
from argus.contracts.workers import WorkerReport
from argus.plumbing.internal_tls import Identity
from argus.profiles import default_profiles
from tests.tls_factories import TestCA

pytestmark = pytest.mark.integration


PROFILES = default_profiles()
CLASS = PROFILES.worker_classes[0]
TIMEOUT = 10


@pytest.fixture(scope="module")
def allocator(cluster_ca: TestCA) -> Iterator[tuple[str, AllocatorServicer]]:
    server, port, servicer = create_allocator(
        PROFILES,
        config=ControlConfig(period_s=60.0, heartbeat_s=30.0),
        clock=lambda: 1000.0,
        tls=cluster_ca.tls("allocator", "allocator"),
    )
    server.start()
    yield f"127.0.0.1:{port}", servicer
    servicer.close()
    server.stop(grace=None)


def members(servicer: AllocatorServicer) -> dict[str, str]:
    """worker id → address, as the allocator plans for them."""
    return {m.worker_id: m.report.address for m in servicer.control._members.members()}


def refused(client: AllocatorClient, report: WorkerReport) -> str:
    """The details of a heartbeat refused with PERMISSION_DENIED."""
    with pytest.raises(grpc.RpcError) as err:
        client.heartbeat(report)
    call: Any = err.value
    assert call.code() is grpc.StatusCode.PERMISSION_DENIED, call.details()
    return str(call.details())


def test_a_worker_certificate_heartbeats_only_as_its_own_worker(
    allocator: tuple[str, AllocatorServicer], cluster_ca: TestCA
) -> None:
    address, servicer = allocator
    intruder = AllocatorClient(address, timeout_s=TIMEOUT, tls=cluster_ca.tls("worker", "worker-1"))
    try:
        for made_up in ("worker-2", "worker-99", "w"):  # another worker's id, or none at all
            details = refused(intruder, WorkerReport(made_up, "127.0.0.1:6666", CLASS))
            assert details.startswith(f"worker_id: {made_up!r}")
            assert made_up not in members(servicer)
        answer = intruder.heartbeat(WorkerReport("worker-1", "127.0.0.1:7001", CLASS))
        assert answer is not None and members(servicer)["worker-1"] == "127.0.0.1:7001"
    finally:
        intruder.close()
    honest = AllocatorClient(address, timeout_s=TIMEOUT, tls=cluster_ca.tls("worker", "worker-2"))
    try:  # the refused attempts bound nothing: worker-2 joins under its own certificate
        honest.heartbeat(WorkerReport("worker-2", "127.0.0.1:7002", CLASS))
        assert members(servicer)["worker-2"] == "127.0.0.1:7002"
        leave = WorkerReport("worker-1", "127.0.0.1:7001", CLASS, leaving=True)
        assert refused(honest, leave).startswith("worker_id: 'worker-1'")  # nor leave for it
        assert "worker-1" in members(servicer)
    finally:
        honest.close()


def test_the_check_itself() -> None:
    check_worker_identity("worker-1", Identity("worker", "worker-1"))
    check_worker_identity("anything", None)  # plaintext plane: no identity to hold it to
    with pytest.raises(NotOwnerError, match=r"^worker_id: 'worker-2'"):
        check_worker_identity("worker-2", Identity("worker", "worker-1"))
