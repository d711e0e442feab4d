"""The router's OpenAI-compatible HTTP endpoint, driven by the official ``openai`` client and
httpx against a real RouterCore (stub workers, in-process allocator) behind uvicorn on
loopback."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from argus.router.config import RouterServiceConfig
from argus.router.core import RouterCore
from argus.router.http_app import create_app
from argus.router.http_server import HttpServer
from argus.router.metrics import RouterMetrics
from argus.router.worker_calls import GrpcWorkers
from tests.router_cluster import PROFILES, TIMEOUT, Cluster, FakeClock, PngWorker, StubClassifier

pytestmark = pytest.mark.integration


TOKEN = "s3cret-token"


class HttpCluster(Cluster):
    worker_type = PngWorker


def serve_http(core: RouterCore, token: str | None = TOKEN) -> HttpServer:
    server = HttpServer(create_app(core, token=token), "127.0.0.1", 0)
    server.start()
    return server


def client(server: HttpServer, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT)


@pytest.fixture
def cluster() -> Iterator[HttpCluster]:
    made = HttpCluster()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def served(cluster: HttpCluster) -> Iterator[tuple[HttpCluster, HttpServer, CollectorRegistry]]:
    cluster.add_worker("w0")
    cluster.add_worker("w1")
    registry = CollectorRegistry()
    cluster.start_router(metrics=RouterMetrics(PROFILES, registry))
    server = serve_http(cluster.core)
    try:
        yield cluster, server, registry
    finally:
        server.stop()


def test_generates_n_images_with_levels_and_distinct_seeds(served: Any) -> None:
    cluster, server, registry = served
    answer = client(server).images.generate(
        prompt="a red fox", n=2, size="64x64", response_format="b64_json", extra_body={"seed": 7}
    )
    assert answer.data is not None and len(answer.data) == 2
    for item in answer.data:
        assert item.b64_json is not None
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (64, 64)
        extra: Any = item.model_extra
        assert extra["level"] in {level.name for level in PROFILES.levels}
        assert extra["timing"]["total_ms"] >= 0.0
    calls = [c for w in cluster.workers.values() for c in w.calls]
    assert sorted(c.seed for c in calls) == [7, 8]
    assert all((c.width, c.height) == (64, 64) for c in calls)
    counted = registry.get_sample_value(
        "argus_router_http_requests_total", {"route": "/v1/images/generations", "status": "200"}
    )
    assert counted == 1.0


def test_bad_size_is_400_naming_size(served: Any) -> None:
    _, server, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).images.generate(prompt="x", size="63x64")
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    assert body["param"] == "size" and "multiple of 8" in body["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "model": "dall-e-3"}, "model"),
        ({"n": 1}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "partial_images": 2}, "partial_images"),
        ({"prompt": "x", "stream": True, "n": 2}, "n"),
        ({"prompt": "x", "stream": True, "partial_images": -1}, "partial_images"),
        ({"prompt": "x", "steps": 0}, "steps"),
    ],
)
def test_bad_fields_are_400_naming_them(served: Any, body: dict[str, Any], param: str) -> None:
    _, server, _ = served
    answer = httpx.post(
        f"{server.base_url}/images/generations",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "message"),
    [  # the bounds the gRPC API refuses in the same words (its previews: partial_images)
        ({"max_level_index": 2**31}, "max_level_index: 2147483648 outside 0..2147483647"),
        ({"stream": True, "partial_images": 1001}, "partial_images: 1001 outside 0..1000"),
    ],
)
def test_bounds_are_refused_naming_the_real_bound(
    served: Any, body: dict[str, Any], message: str
) -> None:
    _, server, _ = served
    answer = httpx.post(
        f"{server.base_url}/images/generations",
        json={"prompt": "x", **body},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == message


def test_malformed_json_400_and_large_body_413(served: Any) -> None:
    _, server, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    url = f"{server.base_url}/images/generations"
    bad = httpx.post(url, content=b"{not json", headers=auth, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("body:")
    assert bad.json()["error"]["param"] == "body"  # as every refusal of the body
    huge = httpx.post(url, content=b" " * (9 * 1024 * 1024), headers=auth, timeout=TIMEOUT)
    assert huge.status_code == 413
    assert huge.json()["error"]["param"] == "body"
    assert huge.headers["connection"] == "close"  # the rest of the body is not read
    chunked = iter([b" " * (1 << 20)] * 9)  # no Content-Length: counted as it arrives
    streamed = httpx.post(url, content=chunked, headers=auth, timeout=TIMEOUT)
    assert streamed.status_code == 413
    assert streamed.json()["error"]["param"] == "body"


def test_an_early_refusal_lingers_for_a_client_still_sending_its_body(served: Any) -> None:
    """A 413 given on the headers, while the client goes on sending: the server answers,
    half-closes and drops the rest for a while. Closing at once would reset the connection
    as more of the body arrived, and a reset destroys whatever of the answer the kernel had
    not sent yet (CI saw httpx get the 413's headers without its body)."""
    _, server, _ = served
    head = (
        "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {64 << 20}\r\n\r\n"
    ).encode()
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head + b" " * (64 << 10))
        answer = b""
        while chunk := sock.recv(1 << 16):  # the answer, then the server's FIN
            answer += chunk
        for _ in range(8):  # still read and dropped, not reset
            sock.sendall(b" " * (64 << 10))
            time.sleep(0.02)
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), status
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["param"] == "body"


def test_wrong_missing_or_doubled_token_is_401(served: Any) -> None:
    _, server, _ = served
    with pytest.raises(openai.AuthenticationError):
        client(server, token="wrong").images.generate(prompt="x")
    url = f"{server.base_url}/models"
    missing = httpx.get(url, timeout=TIMEOUT)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer ")  # RFC 6750
    assert missing.json()["error"]["type"] == "authentication_error"
    doubled = httpx.Headers([("authorization", f"Bearer {TOKEN}")] * 2)
    assert httpx.get(url, headers=doubled, timeout=TIMEOUT).status_code == 401
    assert httpx.get(url, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_overload_is_429_with_retry_after(cluster: HttpCluster) -> None:
    stub = cluster.add_worker("w0")
    stub.hold = threading.Event()
    cluster.start_router(RouterServiceConfig(max_in_flight=1))
    server = serve_http(cluster.core)
    api = client(server)
    first = threading.Thread(target=lambda: api.images.generate(prompt="a", size="64x64"))
    try:
        first.start()
        for _ in range(1000):  # until the first request holds the router's only slot
            if stub.calls:
                break
            threading.Event().wait(0.01)
        assert stub.calls
        with pytest.raises(openai.RateLimitError) as caught:
            api.images.generate(prompt="b", size="64x64")
        assert caught.value.status_code == 429
        assert caught.value.response.headers["retry-after"] == "1"
    finally:
        stub.hold.set()
        first.join(TIMEOUT)
        server.stop()


def test_a_request_that_cannot_make_its_deadline_is_504(served: Any) -> None:
    _, server, _ = served
    with pytest.raises(openai.APIStatusError) as caught:
        client(server).images.generate(
            prompt="x", size="1024x1024", extra_body={"steps": 1000, "deadline_ms": 100}
        )
    assert caught.value.status_code == 504
    body: Any = caught.value.body
    assert body["type"] == "timeout_error" and "deadline_ms" in body["message"]


def test_no_worker_is_503_and_readyz_follows_the_plan(cluster: HttpCluster) -> None:
    core = RouterCore(
        PROFILES, StubClassifier(), RouterServiceConfig(), workers=GrpcWorkers(), clock=FakeClock()
    )
    server = serve_http(core, token=None)
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{server.port}/readyz").status_code == 503
        with pytest.raises(openai.InternalServerError) as caught:
            client(server, token="any").images.generate(prompt="x")
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "1"
        cluster.add_worker("w0")
        core.install(cluster.client.get_plan())
        assert httpx.get(f"http://127.0.0.1:{server.port}/readyz").status_code == 200
        served = client(server, token="any").images.generate(prompt="x").data
        assert served is not None and len(served) == 1
    finally:
        server.stop()
        core.close()


def test_models_lists_the_served_model_and_its_levels(served: Any) -> None:
    _, server, _ = served
    models = list(client(server).models.list())
    assert [m.id for m in models] == ["argus"]
    extra: Any = models[0].model_extra
    assert [level["name"] for level in extra["levels"]] == [lv.name for lv in PROFILES.levels]


def test_partial_failure_is_200_with_errors_all_failed_is_the_first_status(
    served: Any,
) -> None:
    cluster, server, _ = served
    for worker in cluster.workers.values():
        assert isinstance(worker, PngWorker)
        worker.fail_seeds = frozenset({11, 20, 21})
    url = f"{server.base_url}/images/generations"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    some = httpx.post(url, json={"prompt": "x", "n": 2, "seed": 10}, headers=auth)
    assert some.status_code == 200
    body = some.json()
    assert len(body["data"]) == 1
    assert [(e["index"], e["status"]) for e in body["errors"]] == [(1, 502)]
    assert "stub failure" in body["errors"][0]["error"]["message"]
    none = httpx.post(url, json={"prompt": "x", "n": 2, "seed": 20}, headers=auth)
    assert none.status_code == 502
    assert "stub failure" in none.json()["error"]["message"]
    assert "data" not in none.json()


def test_taken_port_names_it() -> None:
    core = RouterCore(
        PROFILES, StubClassifier(), RouterServiceConfig(), workers=GrpcWorkers(), clock=FakeClock()
    )
    first = serve_http(core)
    try:
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{first.port}"):
            HttpServer(create_app(core), "127.0.0.1", first.port)
    finally:
        first.stop()
