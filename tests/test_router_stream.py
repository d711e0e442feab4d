"""The router's GenerateStream and cancellation end to end: a real router in front of a real
worker (tiny random pipeline on the CPU, its real gRPC server), on loopback.

The stream shows the level chosen, the worker's queue, every step in order and then the
image; a client that cancels, a stream or a plain Generate call, stops the worker's
denoising within one step and the router counts the request as cancelled.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from argus.allocator.membership import WorkerReport
from argus.plumbing import rpc
from argus.router.config import RouterServiceConfig
from argus.router.metrics import RouterMetrics
from argus.worker.engine import Worker
from argus.worker.service import create_server as create_worker
from tests.router_cluster import PROFILES, Cluster
from tests.test_worker_deadlines import BOUND_S, LONG_STEPS, wait_until
from tests.test_worker_stream import cancel_within_one_step
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration


router_pb2: Any = rpc.load("router_pb2")
worker_pb2: Any = rpc.load("worker_pb2")
Stage = worker_pb2.Progress.Stage


# the default 30 s deadline is short for a CPU shared with other work
PATIENT = RouterServiceConfig(default_deadline_ms=int(BOUND_S * 1000))


class RealWorkerCluster(Cluster):
    def add_real_worker(self, worker: Worker) -> None:
        server, port, _ = create_worker(worker)
        server.start()
        self.servers.append(server)
        report = WorkerReport(
            worker.config.worker_id, f"127.0.0.1:{port}", PROFILES.worker_classes[0]
        )
        self.client.heartbeat(report)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    made = make_worker(worker_id="worker-real")
    yield made
    made.close()


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def router(worker: Worker, registry: CollectorRegistry) -> Iterator[Any]:
    cluster = RealWorkerCluster()
    cluster.add_real_worker(worker)
    stub = cluster.router(PATIENT, metrics=RouterMetrics(PROFILES, registry))
    yield stub
    cluster.close()


LONG_S = 600  # admission prices 1000 steps at about 110 s on the profile's idle worker


def long_request() -> Any:
    """A request that runs far longer than any test waits: it only ends by being cancelled."""
    return router_pb2.RouterGenerateRequest(
        prompt="a slow fox", steps=LONG_STEPS, deadline_ms=LONG_S * 1000
    )


def cancelled_requests(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("argus_router_requests_total", {"code": "CANCELLED"})
    return value or 0.0


def test_the_stream_shows_routing_the_queue_every_step_and_then_the_image(router: Any) -> None:
    request = router_pb2.RouterGenerateRequest(
        prompt="a red fox", steps=5, width=64, height=64, previews=1
    )
    events = list(router.GenerateStream(request, timeout=BOUND_S))
    progress = [e.progress for e in events[:-1]]
    assert [(Stage.Name(p.stage), p.step) for p in progress] == [
        ("ROUTED", 0),
        ("QUEUED", 0),
        ("RUNNING", 0),
        *[("STEP", k) for k in range(1, 6)],
        ("DECODING", 5),
    ]
    routed = progress[0]
    assert routed.worker_id == "worker-real"
    last = events[-1].response
    assert (routed.level, last.level) == (last.level, last.level)
    assert last.worker_id == "worker-real"
    assert Image.open(io.BytesIO(last.png)).size == (64, 64)
    assert [p.step for p in progress if p.preview_png] == [5]


def test_cancelling_a_stream_stops_the_worker_within_one_step(
    router: Any, worker: Worker, registry: CollectorRegistry
) -> None:
    counted = cancelled_requests(registry)
    cancel_within_one_step(router.GenerateStream(long_request(), timeout=LONG_S), worker)
    wait_until(lambda: cancelled_requests(registry) == counted + 1, "the router counted it")


def test_cancelling_a_generate_call_stops_the_worker_too(
    router: Any, worker: Worker, registry: CollectorRegistry
) -> None:
    before, counted = worker.stats(), cancelled_requests(registry)
    call = router.Generate.future(long_request(), timeout=LONG_S)
    wait_until(lambda: worker.stats().denoise_steps > before.denoise_steps + 1, "it runs")
    call.cancel()
    wait_until(lambda: worker.stats().cancelled > before.cancelled, "the worker stopped")
    assert worker.stats().denoise_steps - before.denoise_steps < LONG_STEPS
    wait_until(lambda: cancelled_requests(registry) == counted + 1, "the router counted it")
    reply = router.Generate(router_pb2.RouterGenerateRequest(prompt="next", steps=2))
    assert reply.worker_response.steps_run == 2  # the slot is free again


def test_a_refused_stream_ends_with_the_status_and_no_event(router: Any) -> None:
    request = router_pb2.RouterGenerateRequest(prompt="x", width=65, height=64)
    stream = router.GenerateStream(request, timeout=BOUND_S)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("width")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_client_command_draws_a_progress_bar(worker: Worker, tmp_path: Any) -> None:
    from argus.cli.client import send_prompts
    from argus.tools.client import Connection, RouterClient

    cluster = RealWorkerCluster()
    try:
        cluster.add_real_worker(worker)
        address = cluster.start_router(PATIENT)
        logged, terminal = io.StringIO(), Terminal()
        with RouterClient(Connection(address)) as client:
            for out in (logged, terminal):
                failed = send_prompts(
                    client, ["a red fox"], tmp_path, count=1, concurrency=4, stream=out,
                    steps=3, size=64,
                )  # fmt: skip
                assert failed == 0
    finally:
        cluster.close()
    lines = logged.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [
        "routed",
        "queued,",
        "running",
        "step",
        "decoding",
    ]
    assert "3/3 |" + "#" * 30 + "|" in terminal.getvalue()
    assert terminal.getvalue().count("\r") == 7  # routed, queued, running, 3 steps, decoding
    assert Image.open(tmp_path / "0000.png").size == (64, 64)
