"""The router's edges: classifier failures and malformed bytes as statuses, bearer-token auth,
TLS, minimum quality and step limits, metrics, and plans it cannot route on.

In process (tests/router_cluster.py): a real RouterCore behind the real server, stub workers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from argus.classifier.prompts import InvalidPromptError
from argus.classifier.serving import BatcherClosed
from argus.contracts.generate import GenerateCall
from argus.plumbing import rpc
from argus.plumbing.grpc_server import tls_credentials
from argus.router.app import ServerSecurity
from argus.router.config import RouterServiceConfig
from argus.router.core import CallCancel
from argus.router.metrics import RouterMetrics
from argus.router.worker_calls import GrpcWorkers, WorkerChannels
from argus.types import Strategy
from tests.router_cluster import PNG, PROFILES, TIMEOUT, Cluster, StubWorker
from tests.service_process import self_signed_certificate

pytestmark = pytest.mark.integration


router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")
TOKEN = "s3cret-token"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    made.add_worker("w1")
    made.add_worker("w2")
    yield made
    made.close()


def status(call: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=TIMEOUT, **kwargs)
    return err.value.code(), err.value.details() or ""


def request(**fields: Any) -> Any:
    return router_pb2.RouterGenerateRequest(prompt=fields.pop("prompt", "a fox"), **fields)


class FailingClassifier:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Strategy, int]:
        if prompt == "fail":
            raise self.error
        return {Strategy.AC: 0, Strategy.SM: 0}


@pytest.mark.parametrize(
    ("error", "code", "starts"),
    [
        (InvalidPromptError("lone surrogate"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
        (BatcherClosed("closed"), grpc.StatusCode.UNAVAILABLE, "router shutting down"),
    ],
)
def test_classifier_failures_become_statuses(
    cluster: Cluster, error: BaseException, code: grpc.StatusCode, starts: str
) -> None:
    stub = cluster.router(classifier=FailingClassifier(error))
    got, details = status(stub.Generate, request(prompt="fail"))
    assert got is code and details.startswith(starts)
    assert stub.Generate(request(), timeout=TIMEOUT).png == PNG  # still serving


def test_malformed_bytes_get_invalid_argument(cluster: Cluster) -> None:
    cluster.router()
    assert cluster.channel is not None
    raw = cluster.channel.unary_unary("/argus.v1.Router/Generate")  # bytes in, bytes out
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x02\xc3\x28"):
        code, details = status(raw, garbage)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request")
    served = router_pb2.RouterGenerateResponse.FromString(
        raw(request().SerializeToString(), timeout=TIMEOUT)
    )
    assert served.png == PNG


def test_bearer_token_is_required_except_for_health(cluster: Cluster) -> None:
    stub = cluster.router(security=ServerSecurity(token=TOKEN))
    code, details = status(stub.Generate, request())
    assert code is grpc.StatusCode.UNAUTHENTICATED and "authorization" in details
    for wrong in ("Bearer nope", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x"):
        code, _ = status(stub.Generate, request(), metadata=(("authorization", wrong),))
        assert code is grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {TOKEN}"),)
    assert stub.Generate(request(), timeout=TIMEOUT, metadata=good).png == PNG
    assert cluster.channel is not None
    health = health_pb2_grpc.HealthStub(cluster.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_endpoint_serves_tls_clients_only(cluster: Cluster, tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    address = cluster.start_router(security=ServerSecurity(credentials=tls_credentials(cert, key)))
    trust = grpc.ssl_channel_credentials(Path(cert).read_bytes())
    with grpc.secure_channel(address, trust) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        assert stub.Generate(request(), timeout=TIMEOUT).png == PNG
    with grpc.insecure_channel(address) as plain:
        code, _ = status(router_pb2_grpc.RouterStub(plain).Generate, request())
        assert code is grpc.StatusCode.UNAVAILABLE


def test_bad_tls_files_are_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(OSError, match=r"junk\.pem"):
        tls_credentials(str(junk), str(junk))


def test_minimum_quality_and_steps_cap_the_served_level(cluster: Cluster) -> None:
    stub = cluster.router(level=4)  # every prompt classified to a fast level
    for fields in ({"max_level_index": 0}, {"steps": 5}):
        reply = stub.Generate(request(**fields), timeout=TIMEOUT)
        assert reply.level_index == 0 and reply.level == "ac-k0"  # K = 5 needs N > 5


def test_metrics_count_served_rejected_and_retried(cluster: Cluster) -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(PROFILES, registry)
    cluster.add_worker("w0", fail=grpc.StatusCode.UNAVAILABLE)  # ids sort first: tried first
    stub = cluster.router(metrics=metrics)
    for seed in range(4):
        stub.Generate(request(seed=seed), timeout=TIMEOUT)
    status(stub.Generate, request(deadline_ms=1))

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("argus_router_requests_total", code="OK") == 4
    assert value("argus_router_requests_total", code="DEADLINE_EXCEEDED") == 1
    assert value("argus_router_admissions_rejected_total", reason="deadline") == 1
    assert value("argus_router_retries_total") >= 1
    assert value("argus_router_request_seconds_count", level="ac-k0", strategy="AC") == 4
    assert value("argus_router_served_quality_count") == 4
    assert value("argus_router_slo_violations_total") == 0
    assert value("argus_router_plan_version") == cluster.client.get_plan().version
    assert (
        value("argus_router_strategy", strategy="AC")
        + value("argus_router_strategy", strategy="SM")
        == 1
    )


def test_a_plan_with_an_unknown_worker_class_is_refused(cluster: Cluster) -> None:
    stub = cluster.router()
    good = cluster.client.get_plan()
    stranger = replace(good.workers[0], worker_class="tpu-v9")
    bad = replace(good, workers=(stranger, *good.workers[1:]))
    assert cluster.core.install(bad) is False
    assert stub.Generate(request(), timeout=TIMEOUT).png == PNG  # the old plan still serves


def test_slo_defaults_to_the_simulators_rule() -> None:
    from argus.profiles.synthetic_quality import synthetic_quality_table
    from argus.sim.arrivals import poisson
    from argus.sim.cluster import SimConfig, Simulation

    # the faster class first, at a speed no constant guesses: a router that took another
    # class, or another factor than the simulator's, would differ from it here
    profiles = replace(PROFILES.with_speed({"h100": 1.3}), worker_classes=("h100", "a100"))
    workload = poisson(60.0, 1.0, seed=0)
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [v.name for v in profiles.levels_for(s)])
        for s in Strategy
    }
    cluster = SimConfig(worker_class=profiles.worker_classes[0], gpus=1)
    simulated = Simulation(profiles, quality, workload, cluster).slo_s
    assert RouterServiceConfig().slo_for(profiles) == pytest.approx(simulated)
    assert RouterServiceConfig().slo_for(PROFILES) == pytest.approx(3 * 4.2)  # SDXL on A100
    assert RouterServiceConfig(slo_s=2.0).slo_for(PROFILES) == 2.0
    with pytest.raises(ValueError, match="slo_s"):
        RouterServiceConfig(slo_s=0.0)


# -- worker channels ------------------------------------------------------------------------


class FakeChannel:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def unary_unary(self, *args: object, **kwargs: object) -> object:
        return lambda *a, **k: None

    def unary_stream(self, *args: object, **kwargs: object) -> object:
        return lambda *a, **k: FakeWatch()


class FakeWatch:
    """A health watch that stays open."""

    def done(self) -> bool:
        return False


def test_a_channel_dropped_from_the_plan_closes_only_after_its_grace() -> None:
    from argus.router.worker_calls import WorkerChannels

    now = [0.0]
    made: list[FakeChannel] = []

    def factory(address: str) -> FakeChannel:
        made.append(FakeChannel(address))
        return made[-1]

    channels = WorkerChannels(factory, grace_s=60.0, clock=lambda: now[0])  # type: ignore[arg-type]
    channels.stub("w1:1"), channels.stub("w2:1")
    channels.keep_only({"w2:1"})  # w1 left the plan; a call on its channel may still run
    assert not made[0].closed
    channels.stub("w1:1")  # it rejoins at the same address: a new channel
    assert len(made) == 3
    now[0] = 61.0
    channels.keep_only({"w1:1", "w2:1"})
    assert made[0].closed and not made[1].closed and not made[2].closed
    channels.close()
    assert all(channel.closed for channel in made)


class CountingHealth(health.HealthServicer):  # type: ignore[misc]
    """The health service, counting Watch calls; each ends at once with ``end`` when set."""

    def __init__(self, end: grpc.StatusCode | None = None) -> None:
        super().__init__()
        self.end = end
        self.watches = 0

    def Watch(
        self, request: Any, context: grpc.ServicerContext, send_response_callback: Any = None
    ) -> Any:
        self.watches += 1
        if self.end is not None:
            context.abort(self.end, "watch refused")
        return super().Watch(request, context, send_response_callback)


SERVER = "stub-worker-server"  # its handler threads' names start so


@contextlib.contextmanager
def worker_server(health_service: health.HealthServicer | None) -> Iterator[str]:
    """A stub worker on loopback, with ``health_service`` when given; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=SERVER))
    worker_pb2_grpc.add_WorkerServicer_to_server(StubWorker("w1"), server)
    if health_service is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


class WatchCalls(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """The router's side of its health watches: how many it opened, and each one's end.

    Counted where the router opens them, so a watch opened by mistake shows at once (the
    server counts it only when the call reaches it)."""

    def __init__(self) -> None:
        self.opened = 0
        self._ended = threading.Semaphore(0)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        if details.method.endswith("/Watch"):
            self.opened += 1
            call.add_done_callback(lambda _: self._ended.release())
        return call

    def channel(self, address: str) -> grpc.Channel:
        """A ``WorkerChannels`` factory: the worker's channel, through this interceptor."""
        return grpc.intercept_channel(grpc.insecure_channel(address), self)

    def wait_ended(self) -> None:
        """Return once one more watch has ended on the router's side."""
        assert self._ended.acquire(timeout=TIMEOUT), "the watch did not end"


def call_worker(workers: GrpcWorkers, address: str, calls: int) -> None:
    for i in range(calls):
        reply = workers.generate(
            address,
            GenerateCall("a fox", "ac-k0", seed=i),
            timeout_s=TIMEOUT,
            cancel=CallCancel(),
            progress=None,
        )
        assert reply.png == PNG


def test_a_workers_channel_keeps_its_completion_thread_between_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router holds the worker's health watch open, so calls one after another do not
    each start the channel's completion thread (and wait for it to run)."""
    watched = CountingHealth()
    with worker_server(watched) as address:
        workers = GrpcWorkers(WorkerChannels())
        call_worker(workers, address, 1)  # the channel and its watch open
        started: list[threading.Thread] = []
        start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            if not thread.name.startswith(SERVER):  # the client's threads, not the server's
                started.append(thread)
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", counted)
        call_worker(workers, address, 10)
        monkeypatch.undo()
        workers.close()
    assert started == []
    assert watched.watches == 1


def test_a_worker_without_health_is_called_and_not_watched_again() -> None:
    unimplemented = CountingHealth(end=grpc.StatusCode.UNIMPLEMENTED)
    watches = WatchCalls()
    with worker_server(unimplemented) as address:
        workers = GrpcWorkers(WorkerChannels(watches.channel, rewatch_s=0.0))
        call_worker(workers, address, 1)
        watches.wait_ended()  # UNIMPLEMENTED reached the router
        call_worker(workers, address, 4)  # each would open a watch again, were it not heeded
        workers.close()
    assert watches.opened == 1
    assert unimplemented.watches == 1
    with worker_server(None) as address:  # no health service at all: calls still answered
        workers = GrpcWorkers(WorkerChannels(rewatch_s=0.0))
        call_worker(workers, address, 3)
        workers.close()


def test_an_ended_watch_is_opened_again_after_rewatch_s() -> None:
    now = [0.0]
    ending = CountingHealth(end=grpc.StatusCode.UNAVAILABLE)
    watches = WatchCalls()
    with worker_server(ending) as address:
        channels = WorkerChannels(watches.channel, rewatch_s=5.0, clock=lambda: now[0])
        workers = GrpcWorkers(channels)
        call_worker(workers, address, 1)
        watches.wait_ended()  # the watch has ended, as the router sees it
        call_worker(workers, address, 3)  # within rewatch_s of opening it: not opened again
        assert watches.opened == 1
        assert ending.watches == 1
        now[0] = 6.0
        deadline = time.monotonic() + TIMEOUT
        while ending.watches < 2 and time.monotonic() < deadline:
            call_worker(workers, address, 1)  # the next use after rewatch_s opens it again
            time.sleep(0.01)
        workers.close()
    assert ending.watches == 2
