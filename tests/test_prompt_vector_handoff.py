"""The router's prompt vector rides on the Generate call, so the worker does not embed the
prompt again: the worker's lookup and insert take the vector when its encoder makes the same
vectors (``vectors_id``), embed the prompt themselves when it does not, and refuse a damaged
vector naming the field, in process and over gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client import CollectorRegistry

from argus.contracts.generate import CacheOutcome, GenerateCall
from argus.embedding import PromptEmbedder
from argus.plumbing import rpc
from argus.request_limits import InvalidRequestError
from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore
from argus.worker.approx_cache.use import router_vector
from argus.worker.service import create_server
from tests.worker_factories import make_worker

pytestmark = pytest.mark.unit

worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

BUS, RAMEN = "a red bus in the snow", "a bowl of ramen"


class CountingEncoder:
    """The worker's MiniLM, counting the prompts it embeds."""

    def __init__(self, encoder: PromptEmbedder) -> None:
        self.encoder = encoder
        self.dim = encoder.dim
        self.vectors_id = encoder.vectors_id
        self.embedded: list[str] = []

    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]:
        self.embedded.append(prompt)
        return self.encoder.embed_one(prompt)


@pytest.fixture(scope="module")
def minilm() -> PromptEmbedder:
    return PromptEmbedder()


@pytest.fixture
def encoder(minilm: PromptEmbedder) -> CountingEncoder:
    return CountingEncoder(minilm)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def worker(tmp_path: Path, encoder: CountingEncoder, registry: CollectorRegistry) -> Iterator[Any]:
    cache = ApproximateCache(
        EdgeVectorIndex(tmp_path / "edge", encoder.dim, optimize_after=None),
        LatentStore(tmp_path / "latents", fsync=False),
        max_entries=100,
        max_bytes=None,
        registry=registry,
    )
    worker = make_worker(cache=cache, encoder=encoder)
    yield worker
    worker.close()


def vector_of(encoder: CountingEncoder, prompt: str) -> tuple[float, ...]:
    return tuple(encoder.encoder.embed_one(prompt).tolist())


def vectors(registry: CollectorRegistry, source: str) -> float | None:
    return registry.get_sample_value("argus_worker_cache_prompt_vectors_total", {"source": source})


def test_the_worker_files_and_finds_prompts_by_the_routers_vector(
    worker: Any, encoder: CountingEncoder, registry: CollectorRegistry
) -> None:
    bus = vector_of(encoder, BUS)
    call = GenerateCall(BUS, level="ac-k0", prompt_embedding=bus, prompt_encoder=encoder.vectors_id)
    assert worker.generate(call).cache is CacheOutcome.NOT_USED  # K = 0: feeds the cache
    worker.flush()
    assert worker.stats().cache.entries == 1
    # a prompt about ramen sent with the bus's vector finds the bus: the vector decided
    odd = GenerateCall(
        RAMEN, level="ac-k5", prompt_embedding=bus, prompt_encoder=encoder.vectors_id
    )
    reply = worker.generate(odd)
    assert reply.cache is CacheOutcome.HIT
    assert reply.similarity == pytest.approx(1.0, abs=1e-4)
    assert encoder.embedded == []  # the insert and the lookup took the router's vector
    assert (vectors(registry, "router"), vectors(registry, "worker")) == (2.0, 0.0)


def test_a_vector_of_another_encoder_is_ignored_and_the_worker_embeds(
    worker: Any, encoder: CountingEncoder, registry: CollectorRegistry
) -> None:
    call = GenerateCall(
        RAMEN, level="ac-k5", prompt_embedding=vector_of(encoder, BUS), prompt_encoder="other"
    )
    assert worker.generate(call).cache is CacheOutcome.MISS  # empty cache
    assert encoder.embedded == [RAMEN]
    worker.flush()  # the miss's full run is filed under its own vector, embedded once
    assert encoder.embedded == [RAMEN]
    assert (vectors(registry, "router"), vectors(registry, "worker")) == (0.0, 1.0)


class Fake:
    dim = 4
    vectors_id = "fake"


@pytest.mark.parametrize(
    ("values", "encoder_id", "field", "words"),
    [
        ((1.0, 0.0, 0.0, 0.0), "", "prompt_encoder", "required"),
        ((1.0, 0.0, 0.0), "fake", "prompt_embedding", "3 values"),
        ((float("nan"), 0.0, 0.0, 0.0), "fake", "prompt_embedding", "finite unit"),
        ((2.0, 0.0, 0.0, 0.0), "fake", "prompt_embedding", "norm 2"),
        ((0.0, 0.0, 0.0, 0.0), "fake", "prompt_embedding", "norm 0"),
    ],
)
def test_a_damaged_vector_is_refused_naming_the_field(
    values: tuple[float, ...], encoder_id: str, field: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as refused:
        router_vector(Fake(), values, encoder_id)
    assert refused.value.field == field


def test_a_good_vector_is_taken_and_none_or_another_encoders_is_not() -> None:
    unit = (0.6, 0.8, 0.0, 0.0)
    taken = router_vector(Fake(), unit, "fake")
    assert taken is not None and taken.tolist() == pytest.approx(unit)
    assert router_vector(Fake(), (), "") is None
    assert router_vector(Fake(), unit, "another") is None
    assert router_vector(None, unit, "fake") is None  # a worker without an encoder


def test_over_grpc_a_damaged_vector_is_invalid_argument_naming_the_field(
    worker: Any, encoder: CountingEncoder
) -> None:
    server, port, _ = create_server(worker, "127.0.0.1:0", threads=2)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = worker_pb2.GenerateRequest(
                prompt=BUS, level="ac-k5", prompt_encoder=encoder.vectors_id
            )
            request.prompt_embedding.extend([1.0] * encoder.dim)  # norm sqrt(384)
            with pytest.raises(grpc.RpcError) as refused:
                worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60)
    finally:
        server.stop(grace=None)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_embedding" in (refused.value.details() or "")
    assert encoder.embedded == []
