"""The router service: plan-following routing, SLO admission, retries on a failing worker,
idempotent request ids and status codes for bad input.

An in-process allocator (fake clock, no loop thread) makes the plans from the heartbeats of
stub workers: tiny in-process Worker servicers that answer a fixed PNG at once, or fail.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from argus import rpc
from argus.allocator.client import AllocatorClient
from argus.allocator.control import ControlConfig
from argus.allocator.membership import WorkerReport
from argus.allocator.service import create_server as create_allocator
from argus.profiles import default_profiles
from argus.router.admission import RequestLedger, admit
from argus.router.app import StatsReporter, create_server
from argus.router.service import RETRY_AFTER_KEY, RouterCore, RouterServiceConfig
from argus.types import Strategy

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

PROFILES = default_profiles()
PNG = b"\x89PNG\r\n\x1a\nstub"
TIMEOUT = 10


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class StubClassifier:
    def __init__(self, level: int = 0) -> None:
        self.level = level

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Strategy, int]:
        return {Strategy.AC: self.level, Strategy.SM: self.level}


class StubWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Answers a fixed PNG at once, or fails every call with ``fail`` (a status code)."""

    def __init__(self, worker_id: str, fail: grpc.StatusCode | None = None) -> None:
        self.worker_id = worker_id
        self.fail = fail
        self.calls: list[Any] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append(request)
        if self.fail is not None:
            context.abort(self.fail, "stub failure")
        return worker_pb2.GenerateResponse(
            request_id=request.request_id,
            png=PNG,
            level=request.level,
            worker_id=self.worker_id,
            timing=worker_pb2.Timing(total_ms=1.0),
        )


class Cluster:
    """An allocator, stub workers and a router, all in process."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.servers: list[grpc.Server] = []
        server, port, self.allocator = create_allocator(
            PROFILES,
            "127.0.0.1:0",
            config=ControlConfig(period_s=60.0, heartbeat_s=1.0),
            clock=self.clock,
            epoch="test",
        )
        server.start()
        self.servers.append(server)
        self.client = AllocatorClient(f"127.0.0.1:{port}", timeout_s=TIMEOUT)
        self.workers: dict[str, StubWorker] = {}

    def add_worker(self, worker_id: str, fail: grpc.StatusCode | None = None) -> StubWorker:
        stub = StubWorker(worker_id, fail)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(stub, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.servers.append(server)
        report = WorkerReport(worker_id, f"127.0.0.1:{port}", PROFILES.worker_classes[0])
        self.client.heartbeat(report)
        self.workers[worker_id] = stub
        return stub

    def router(self, config: RouterServiceConfig | None = None, level: int = 0) -> Any:
        self.core = RouterCore(
            PROFILES,
            StubClassifier(level),
            config or RouterServiceConfig(),
            clock=self.clock,
        )
        self.core.install(self.client.get_plan())
        server, port, _ = create_server(self.core)
        server.start()
        self.servers.append(server)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return router_pb2_grpc.RouterStub(self.channel)

    def close(self) -> None:
        self.client.close()
        self.allocator.close()
        for server in self.servers:
            server.stop(grace=None)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.close()


def ask(stub: Any, **fields: Any) -> Any:
    fields.setdefault("prompt", "a red fox in the snow")
    return stub.Generate(router_pb2.RouterGenerateRequest(**fields), timeout=TIMEOUT)


def code_of(stub: Any, **fields: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as info:
        ask(stub, **fields)
    err: Any = info.value
    trailing = {k: v for k, v in (err.trailing_metadata() or ())}
    return err.code(), err.details(), trailing


def test_routing_follows_the_plan(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    stub = cluster.router()
    assignment = {w.worker_id: w.level for w in cluster.client.get_plan().workers}
    for i in range(8):
        reply = ask(stub, seed=i)
        assert reply.png == PNG
        assert reply.level == assignment[reply.worker_id]
        assert reply.strategy in (1, 2)
        assert reply.timing.attempts == 1
        assert reply.worker_response.png == b""
    sent = [c for w in cluster.workers.values() for c in w.calls]
    assert len(sent) == 8
    assert all(c.prompt == "a red fox in the snow" for c in sent)


def test_admission_rejects_what_misses_the_deadline(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    code, details, trailing = code_of(stub, deadline_ms=1)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "deadline" in details
    assert int(trailing[RETRY_AFTER_KEY]) >= 1
    assert cluster.workers["w1"].calls == []


def test_failing_worker_is_retried_elsewhere(cluster: Cluster) -> None:
    bad = cluster.add_worker("w1", fail=grpc.StatusCode.UNAVAILABLE)
    cluster.add_worker("w2")
    stub = cluster.router()
    for i in range(6):
        reply = ask(stub, seed=i)
        assert reply.worker_id == "w2"
    assert len(bad.calls) <= 1  # marked down after its first failure


def test_worker_errors_other_than_unavailable_are_passed_on(cluster: Cluster) -> None:
    cluster.add_worker("w1", fail=grpc.StatusCode.INVALID_ARGUMENT)
    stub = cluster.router()
    code, details, _ = code_of(stub)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "w1" in details


def test_duplicate_request_id_calls_the_worker_once(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    stub = cluster.router()
    first = ask(stub, request_id="r-1", seed=7)
    again = ask(stub, request_id="r-1", seed=7)
    assert again == first
    assert len(worker.calls) == 1
    code, details, _ = code_of(stub, request_id="r-1", seed=8)
    assert code is grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in details


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"width": 63}, "width"),
        ({"height": 100000}, "height"),
        ({"steps": 0}, "steps"),
        ({"prompt": "x" * (1 << 20)}, "prompt"),
        ({"request_id": "r" * 500}, "request_id"),
        ({"adapters": [{"kind": 1}]}, "adapters[0]"),
    ],
)
def test_garbage_gets_invalid_argument(cluster: Cluster, fields: Any, field: str) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    code, details, _ = code_of(stub, **fields)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field)
    assert ask(stub).png == PNG  # still serving


def test_empty_prompt_is_served(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    assert ask(cluster.router(), prompt="").png == PNG


def test_no_worker_is_unavailable(cluster: Cluster) -> None:
    code, _, trailing = code_of(cluster.router())
    assert code is grpc.StatusCode.UNAVAILABLE
    assert RETRY_AFTER_KEY in trailing


def test_reports_reach_the_allocator(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    ask(stub)
    ask(stub)
    reporter = StatsReporter(cluster.core, cluster.client, cluster.clock)
    reporter.report_once()
    arrivals, classified, _ = cluster.core.take_statistics()
    assert arrivals == [] and classified == []


def test_admit_and_ledger_units() -> None:
    assert admit(1.0, 2.0).admitted
    late = admit(3.0, 1.0)
    assert not late.admitted and late.retry_after_s == pytest.approx(2.0)
    clock = FakeClock()
    ledger: RequestLedger[int] = RequestLedger(clock, window_s=10.0, max_entries=2)
    future, owner = ledger.claim("a", 1)
    assert owner
    joined, owner = ledger.claim("a", 1)
    assert joined is future and not owner
    ledger.finish("a", 5)
    assert joined.result() == 5
    clock.now += 11.0
    _, owner = ledger.claim("a", 1)
    assert owner  # expired: runs again
    ledger.claim("b", 1)
    ledger.finish("a", 1)
    ledger.claim("c", 1)  # full: the finished "a" is dropped
    assert len(ledger) == 2


def test_concurrent_duplicates_join_the_first_call() -> None:
    clock = FakeClock()
    ledger: RequestLedger[int] = RequestLedger(clock, window_s=10.0, max_entries=8)
    ledger.claim("x", 1)
    results: list[int] = []
    joiner = threading.Thread(target=lambda: results.append(ledger.claim("x", 1)[0].result()))
    joiner.start()
    ledger.finish("x", 42)
    joiner.join(TIMEOUT)
    assert results == [42]
