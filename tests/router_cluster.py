"""An Argus cluster in one process, for tests that talk to a real router over gRPC.

An in-process allocator (fake clock, no loop thread) makes the plans from the heartbeats of
stub workers: tiny Worker servicers that answer a fixed PNG at once, or fail every call with a
status. The router is the real ``RouterCore`` with a stub classifier behind the real
``create_server``. Its clock is the fake one too, so admission sees no time pass.
"""

from __future__ import annotations

import io
import threading
from concurrent import futures
from dataclasses import replace
from typing import Any

import grpc
from PIL import Image

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.allocator.service import create_server as create_allocator
from argus.contracts.allocator_client import AllocatorClient
from argus.contracts.workers import WorkerReport
from argus.plumbing import rpc
from argus.profiles import default_profiles
from argus.router.app import PrometheusStats, ServerSecurity, create_server
from argus.router.config import RouterServiceConfig
from argus.router.core import RouterCore
from argus.router.policy import RouterPolicy
from argus.router.stats import NO_STATS
from argus.router.worker_calls import GrpcWorkers
from argus.types import ShiftMap, Strategy

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
    """Every prompt's optimal level is ``level`` in both strategies."""

    def __init__(self, level: int = 0) -> None:
        self.level = level

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Strategy, int]:
        return {Strategy.AC: self.level, Strategy.SM: self.level}


class StubWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Answers a fixed PNG at once at the level asked for, or fails every call with ``fail``;
    while ``hold`` is set to an unset event, calls wait for it (a request in service)."""

    def __init__(self, worker_id: str, fail: grpc.StatusCode | None = None) -> None:
        self.worker_id = worker_id
        self.fail = fail
        self.hold: threading.Event | None = None
        self._lock = threading.Lock()
        self.calls: list[Any] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.calls.append(request)
            hold = self.hold
        if hold is not None:
            hold.wait(TIMEOUT)
        if self.fail is not None:
            context.abort(self.fail, "stub failure")
        return worker_pb2.GenerateResponse(
            request_id=request.request_id,
            png=PNG,
            level=request.level,
            worker_id=self.worker_id,
            timing=worker_pb2.Timing(total_ms=1.0),
        )


class PngWorker(StubWorker):
    """A stub worker answering a real PNG of the size asked for; seeds in ``fail_seeds``
    fail with INTERNAL (which does not mark the worker down)."""

    fail_seeds: frozenset[int] = frozenset()

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.seed in self.fail_seeds:
            context.abort(grpc.StatusCode.INTERNAL, "stub failure for this seed")
        reply = super().Generate(request, context)
        size = (request.width or 64, request.height or 64)
        out = io.BytesIO()
        Image.new("RGB", size, (request.seed % 256, 0, 0)).save(out, format="PNG")
        reply.png = out.getvalue()
        return reply


class Cluster:
    """An allocator, stub workers and a router, all in process; ``close`` stops them."""

    worker_type: type[StubWorker] = StubWorker  # what add_worker serves

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.servers: list[grpc.Server] = []
        self.channel: grpc.Channel | None = None
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
        stub = self.worker_type(worker_id, fail)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(stub, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.servers.append(server)
        report = WorkerReport(worker_id, f"127.0.0.1:{port}", PROFILES.worker_classes[0])
        self.client.heartbeat(report)
        self.workers[worker_id] = stub
        return stub

    def start_router(
        self,
        config: RouterServiceConfig | None = None,
        level: int = 0,
        *,
        classifier: Any = None,
        metrics: Any = None,
        security: ServerSecurity | None = None,
        drift: Any = None,
    ) -> str:
        """Start the router on the allocator's current plan; returns its address."""
        self.core = RouterCore(
            PROFILES,
            classifier or StubClassifier(level),
            config or RouterServiceConfig(),
            workers=GrpcWorkers(),
            clock=self.clock,
            stats=NO_STATS if metrics is None else PrometheusStats(metrics),
            drift=drift,
        )
        self.core.install(self.client.get_plan())
        server, port, _ = create_server(self.core, security=security or ServerSecurity())
        server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    def router(
        self, config: RouterServiceConfig | None = None, level: int = 0, **options: Any
    ) -> Any:
        """Start the router and return a RouterStub on it."""
        self.channel = grpc.insecure_channel(self.start_router(config, level, **options))
        return router_pb2_grpc.RouterStub(self.channel)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.client.close()
        self.allocator.close()
        for server in self.servers:
            server.stop(grace=None)


def assigned_policy(assignment: dict[str, str], strategy: Strategy, **options: Any) -> RouterPolicy:
    """A router policy on a ``strategy`` plan whose workers serve ``assignment``'s levels,
    every prompt targeting its classified level (an identity shift map); ``options`` go to
    :class:`~argus.router.policy.RouterPolicy` (``cache_rules``)."""
    control = AllocatorControl(
        PROFILES,
        ControlConfig(period_s=60.0, heartbeat_s=1.0, strategies=(strategy,)),
        clock=FakeClock(),
        epoch="t",
    )
    worker_class = PROFILES.worker_classes[0]
    for worker_id in assignment:
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", worker_class))
    decider = RouterPolicy(PROFILES, RouterServiceConfig(), **options)
    plan = control.current.plan
    assert plan.strategy is strategy
    levels = plan.allocation.levels
    allocation = replace(
        plan.allocation,
        assignment=dict(assignment),
        workers_per_level=tuple(sum(v == level for v in assignment.values()) for level in levels),
    )
    routed = replace(plan, allocation=allocation, shift_map=ShiftMap.identity(levels))
    decider.install(routed, dict.fromkeys(assignment, worker_class), 0.0)
    return decider
