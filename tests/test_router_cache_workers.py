"""Cache-aware routing between two real tiny workers over gRPC: the router learns what one
worker cached from the events on its reply and sends a close paraphrase there, where it
resumes from the cache, though Eq. 3 alone would have sent it to the other (the lower id of
two idle workers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.embedding import PromptEmbedder
from argus.plumbing import rpc
from argus.router.config import RouterServiceConfig
from argus.router.core import RouterCore
from argus.router.worker_calls import GrpcWorkers
from argus.types import Strategy
from argus.worker.engine import Worker
from argus.worker.service import create_server
from tests.router_cluster import PROFILES, FakeClock, StubClassifier
from tests.test_router_cache import plan_at
from tests.worker_factories import STEPS, edge_cache, make_worker

pytestmark = pytest.mark.integration

worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

LEVEL = "ac-k5"
BUS, BUS_NEAR, RAMEN = "a red bus in the snow", "a red bus driving through snow", "a bowl of ramen"


@pytest.fixture(scope="module")
def encoder() -> PromptEmbedder:
    return PromptEmbedder()


def serve_worker(name: str, root: Path, encoder: PromptEmbedder) -> tuple[Worker, grpc.Server, str]:
    cache = edge_cache(root, encoder.dim)
    worker = make_worker(cache=cache, encoder=encoder, warm=True, worker_id=name)
    server, port, _ = create_server(worker, "127.0.0.1:0", threads=4)
    server.start()
    return worker, server, f"127.0.0.1:{port}"


@pytest.fixture
def workers(tmp_path: Path, encoder: PromptEmbedder) -> Iterator[dict[str, tuple[Worker, str]]]:
    served = {name: serve_worker(name, tmp_path / name, encoder) for name in ("w1", "w2")}
    yield {name: (worker, address) for name, (worker, _, address) in served.items()}
    for worker, server, _ in served.values():
        server.stop(grace=None)
        worker.close()


def test_the_router_sends_a_paraphrase_to_the_worker_that_cached_the_prompt(
    workers: dict[str, tuple[Worker, str]], encoder: PromptEmbedder
) -> None:
    (w2, w2_address) = workers["w2"]
    with grpc.insecure_channel(w2_address) as channel:  # another client fills w2's cache
        request = worker_pb2.GenerateRequest(prompt=BUS, seed=4, level="ac-k0")
        worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=120)
    w2.flush()

    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    worker_class = PROFILES.worker_classes[0]
    control.heartbeat(WorkerReport("w2", w2_address, worker_class))
    index = [level.name for level in PROFILES.levels_for(Strategy.AC)].index(LEVEL)
    core = RouterCore(
        PROFILES,
        StubClassifier(index),
        RouterServiceConfig(default_deadline_ms=120_000),
        workers=GrpcWorkers(),
        clock=clock,
        embedder=encoder,
    )
    try:
        assert core.install(plan_at(control.current, LEVEL))  # w2 alone: it tells its cache

        def ask(prompt: str) -> Any:
            return core.generate(RouterRequest(prompt=prompt, width=64, height=64, steps=STEPS))

        assert ask(RAMEN).worker_id == "w2"
        assert core.cache is not None and core.cache.view.entries("w2") >= 1  # BUS

        control.heartbeat(WorkerReport("w1", workers["w1"][1], worker_class))
        assert core.install(plan_at(control.current, LEVEL))  # both at ac-k5
        near = ask(BUS_NEAR)  # Eq. 3 alone: w1, the lower id of two idle workers
        assert near.worker_id == "w2"
        assert near.worker_response.start_step == 5  # resumed from BUS's latent
        # the router embedded BUS_NEAR for its lookup; w2 took that vector, not its encoder's
        assert w2.cache is not None
        routed = w2.cache.metrics.registry.get_sample_value(
            "argus_worker_cache_prompt_vectors_total", {"source": "router"}
        )
        assert routed == 1.0
    finally:
        core.close()
