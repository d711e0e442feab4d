"""Streaming and cancellation over HTTP: the official ``openai`` client reads the server-sent
events of ``"stream": true`` (every step in order, the latent previews, then the image), and a
client that disconnects, streaming or not, stops the worker.

A real router core and a real worker (tiny random pipeline on the CPU, its gRPC server)
behind uvicorn, all on loopback.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from argus.router.http_app import create_app
from argus.router.http_server import HttpServer
from argus.router.metrics import RouterMetrics
from argus.worker.engine import Worker
from tests.router_cluster import PROFILES
from tests.test_router_stream import LONG_S, PATIENT, RealWorkerCluster
from tests.test_worker_deadlines import BOUND_S, LONG_STEPS, wait_until
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration


TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    made = make_worker(worker_id="worker-real")
    yield made
    made.close()


@pytest.fixture(scope="module")
def served(worker: Worker) -> Iterator[tuple[HttpServer, CollectorRegistry]]:
    cluster = RealWorkerCluster()
    cluster.add_real_worker(worker)
    registry = CollectorRegistry()
    cluster.start_router(PATIENT, metrics=RouterMetrics(PROFILES, registry))
    server = HttpServer(create_app(cluster.core, token=TOKEN), "127.0.0.1", 0)
    server.start()
    try:
        yield server, registry
    finally:
        server.stop()
        cluster.close()


def http_count(registry: CollectorRegistry, status: str) -> float:
    labels = {"route": "/v1/images/generations", "status": status}
    return registry.get_sample_value("argus_router_http_requests_total", labels) or 0.0


def cancelled(registry: CollectorRegistry) -> float:
    labels = {"code": "CANCELLED"}
    return registry.get_sample_value("argus_router_requests_total", labels) or 0.0


def long_body(stream: bool) -> dict[str, Any]:
    return {"prompt": "a slow fox", "steps": LONG_STEPS, "deadline_ms": LONG_S * 1000,
            "stream": stream}  # fmt: skip


def test_the_openai_client_streams_every_step_previews_and_the_image(served: Any) -> None:
    server, _ = served
    api = openai.OpenAI(base_url=server.base_url, api_key=TOKEN, max_retries=0, timeout=BOUND_S)
    events = list(
        api.images.generate(
            prompt="a red fox", size="64x64", stream=True, partial_images=2, extra_body={"steps": 4}
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "image_generation.completed"
    assert kinds.count("image_generation.partial_image") == 2
    progress: list[Any] = [e.model_extra or {} for e in events if e.type == "argus.progress"]
    stages = [(p["stage"], p["step"]) for p in progress]
    assert stages == [
        ("routed", 0),
        ("queued", 0),
        ("running", 0),
        *[("step", k) for k in range(1, 5)],
        ("decoding", 4),
    ]
    partial: list[Any] = [e for e in events if e.type == "image_generation.partial_image"]
    assert [p.partial_image_index for p in partial] == [0, 1]
    assert [(p.model_extra or {})["step"] for p in partial] == [2, 4]
    done: Any = events[-1]
    image = Image.open(io.BytesIO(base64.b64decode(done.b64_json)))
    assert (image.format, image.size) == ("PNG", (64, 64))
    assert (done.model_extra or {})["level"] == progress[0]["level"]


def test_a_stream_refused_before_routing_gets_a_plain_status(served: Any) -> None:
    server, _ = served
    answer = httpx.post(
        f"{server.base_url}/images/generations",
        json={
            "prompt": "x",
            "stream": True,
            "size": "1024x1024",
            "steps": 1000,
            "deadline_ms": 100,
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=BOUND_S,
    )
    assert answer.status_code == 504
    assert answer.headers["content-type"] == "application/json"
    assert "deadline_ms" in answer.json()["error"]["message"]


def test_closing_a_stream_stops_the_worker(served: Any, worker: Worker) -> None:
    server, registry = served
    before, counted = worker.stats(), cancelled(registry)
    with httpx.stream(
        "POST",
        f"{server.base_url}/images/generations",
        json=long_body(stream=True),
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=BOUND_S,
    ) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("step", 0) >= 2:
                break
    wait_until(lambda: worker.stats().cancelled > before.cancelled, "the worker stopped")
    assert worker.stats().denoise_steps - before.denoise_steps < LONG_STEPS
    wait_until(lambda: cancelled(registry) == counted + 1, "the router counted it")


def test_a_client_that_gives_up_on_a_plain_request_stops_the_worker(
    served: Any, worker: Worker
) -> None:
    server, registry = served
    before, counted, closed = worker.stats(), cancelled(registry), http_count(registry, "499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/images/generations",
            json=long_body(stream=False),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=httpx.Timeout(BOUND_S, read=2.0),
        )
    wait_until(lambda: worker.stats().cancelled > before.cancelled, "the worker stopped")
    assert worker.stats().denoise_steps - before.denoise_steps < LONG_STEPS
    wait_until(lambda: cancelled(registry) == counted + 1, "the router counted it")
    wait_until(lambda: http_count(registry, "499") == closed + 1, "the answer counted as 499")
