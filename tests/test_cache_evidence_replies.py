"""The approximate cache's evidence on every reply: the worker's gRPC answer (outcome, the
neighbour's similarity, the step resumed at, the routed K, the cache's changes after the
caller's cursor; a corrupt latent is a miss, never an error), carried through the router's
gRPC reply, and the ``cache`` object of each HTTP ``data`` item, read with the official
``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from argus.embedding import PromptEmbedder
from argus.plumbing import rpc
from argus.router.http_app import create_app
from argus.router.http_server import HttpServer
from argus.worker.service import create_server
from tests.router_cluster import TIMEOUT, Cluster, PngWorker
from tests.worker_factories import STEPS, edge_cache, make_worker

pytestmark = pytest.mark.integration

worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")
router_pb2: Any = rpc.load("router_pb2")


# -- the worker's gRPC reply -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    root = tmp_path_factory.mktemp("cache")
    encoder = PromptEmbedder()
    cache = edge_cache(root, encoder.dim)
    worker = make_worker(cache=cache, encoder=encoder, warm=True)
    server, port, _ = create_server(worker, "127.0.0.1:0", threads=4)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield worker, worker_pb2_grpc.WorkerStub(channel), root
    channel.close()
    server.stop(grace=None)
    worker.close()


def call(stub: Any, prompt: str, level: str, after: int | None = None, log: str = "") -> Any:
    request = worker_pb2.GenerateRequest(prompt=prompt, seed=4, level=level, cache_log_id=log)
    if after is not None:
        request.cache_events_after = after
    return stub.Generate(request, timeout=120)  # tiny models on a loaded CPU


def test_the_workers_reply_carries_the_evidence_and_the_caches_changes(served: Any) -> None:
    worker, stub, _ = served
    full = call(stub, "a red bus in the snow", "ac-k0", after=0)
    assert worker_pb2.CacheOutcome.Name(full.cache) == "CACHE_NOT_USED"
    assert (full.routed_step, full.start_step, full.HasField("similarity")) == (0, 0, False)
    assert full.cache_log_id and full.cache_events_last == 0 and not full.cache_events
    worker.flush()

    near = call(stub, "a red bus driving through snow", "ac-k5", full.cache_events_last)
    assert worker_pb2.CacheOutcome.Name(near.cache) == "CACHE_HIT"
    assert (near.routed_step, near.start_step, near.steps_run) == (5, 5, STEPS - 5)
    assert near.HasField("similarity") and 0.9 < near.similarity < 1.0
    (event,) = near.cache_events  # the first request's insert, on a later reply
    assert event.WhichOneof("event") == "insert"
    assert event.insert.tag == '["sdxl", "euler", 64, 64, 10]'
    assert len(event.insert.embedding) == 384
    assert (near.cache_log_id, near.cache_events_last) == (full.cache_log_id, 1)
    assert not near.cache_events_truncated

    far = call(stub, "a bowl of ramen", "ac-k5")  # no cursor: no events
    assert worker_pb2.CacheOutcome.Name(far.cache) == "CACHE_MISS"
    assert (far.cache_miss_reason, far.start_step, far.steps_run) == ("below-floor", 0, STEPS)
    assert far.HasField("similarity") and far.similarity < 0.65
    assert not far.cache_log_id and not far.cache_events


def test_a_corrupt_latent_is_a_miss_never_an_error(served: Any) -> None:
    worker, stub, root = served
    call(stub, "a paper crane on a desk", "ac-k0")
    worker.flush()
    for path in (root / "latents").rglob("*.safetensors"):
        path.write_bytes(path.read_bytes()[:-7] + b"garbage")
    reply = call(stub, "a paper crane on a desk", "ac-k5")  # OK, not an RPC error
    assert worker_pb2.CacheOutcome.Name(reply.cache) == "CACHE_MISS"
    assert reply.cache_miss_reason == "corrupt-latent"
    assert reply.steps_run == STEPS and reply.png.startswith(b"\x89PNG")
    assert reply.HasField("similarity")  # the neighbour was found; its file was bad


# -- through the router ------------------------------------------------------------------------


class EvidenceWorker(PngWorker):
    """A stub worker whose answers carry cache evidence: a hit whose similarity lowered K
    (even seeds) or a miss below the floor (odd seeds)."""

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        reply = super().Generate(request, context)
        reply.routed_step = 10
        if request.seed % 2 == 0:
            reply.cache, reply.similarity, reply.start_step = worker_pb2.CACHE_HIT, 0.7, 5
        else:
            reply.cache, reply.similarity = worker_pb2.CACHE_MISS, 0.25
            reply.cache_miss_reason = "below-floor"
        return reply


class EvidenceCluster(Cluster):
    worker_type = EvidenceWorker


@pytest.fixture
def cluster() -> Iterator[EvidenceCluster]:
    made = EvidenceCluster()
    made.add_worker("w0")
    try:
        yield made
    finally:
        made.close()


def test_the_routers_grpc_reply_carries_the_workers_evidence(cluster: EvidenceCluster) -> None:
    router = cluster.router()
    request = router_pb2.RouterGenerateRequest(prompt="a red fox", seed=2, width=64, height=64)
    evidence = router.Generate(request, timeout=TIMEOUT).worker_response
    assert worker_pb2.CacheOutcome.Name(evidence.cache) == "CACHE_HIT"
    assert (evidence.start_step, evidence.routed_step) == (5, 10)
    assert evidence.similarity == pytest.approx(0.7)


def test_each_http_data_item_carries_a_cache_object(cluster: EvidenceCluster) -> None:
    cluster.start_router()
    server = HttpServer(create_app(cluster.core), "127.0.0.1", 0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)
        answer = client.images.generate(
            prompt="a red fox", n=2, size="64x64", extra_body={"seed": 4}
        )
    finally:
        server.stop()
    assert answer.data is not None
    hit, miss = (item.model_extra["cache"] for item in answer.data)  # type: ignore[index]
    assert hit == {
        "outcome": "hit",
        "similarity": pytest.approx(0.7),
        "resumed_step": 5,
        "routed_step": 10,
        "miss_reason": "",
    }
    assert miss == {
        "outcome": "miss",
        "similarity": pytest.approx(0.25),
        "resumed_step": 0,
        "routed_step": 10,
        "miss_reason": "below-floor",
    }
