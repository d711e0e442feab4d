"""The router's HTTP API end to end: ``argus router --http-port`` as started by LocalCluster
(real workers with tiny models, TLS and a token on the public endpoints), spoken to with the
official ``openai`` client; and a taken HTTP port stopping the router, naming it."""

from __future__ import annotations

import base64
import io
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from argus.tools.local_cluster import ClusterSpec, LocalCluster, describe
from tests.editing_factories import encode, mask_png, pixels, region_of, template_rgb
from tests.service_process import self_signed_certificate

pytestmark = pytest.mark.e2e


TOKEN = "http-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("http")
    cert, key = self_signed_certificate(workdir)
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    spec = ClusterSpec(
        workdir=workdir,
        workers=1,
        controlnet=False,
        metrics=True,
        default_steps=4,
        # edits batched on the worker and placed by the router's mask-aware balancer
        worker_args=("--edit-batch", "4"),
        router_args=("--edit-batch", "4", "--edit-balancer", "mask-aware"),
        auth_token_file=str(token_file),
        tls_cert=cert,
        tls_key=key,
        start_timeout_s=120,  # a router that never prints its HTTP address fails in bounded time
    )
    with LocalCluster(spec) as started:
        yield started


def client(cluster: LocalCluster) -> openai.OpenAI:
    assert cluster.spec.tls_cert is not None
    trust = ssl.create_default_context(cafile=cluster.spec.tls_cert)
    return openai.OpenAI(
        base_url=cluster.router_http,
        api_key=TOKEN,
        max_retries=0,
        timeout=120,
        http_client=openai.DefaultHttpxClient(verify=trust),
    )


def metric(cluster: LocalCluster, part: str, name: str) -> float:
    """The sum of a part's samples named ``name`` (any labels) on its /metrics."""
    port = cluster.parts[part].metrics_port
    text = httpx.get(f"http://{cluster.spec.host}:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_openai_client_generates_through_argus_up_style_cluster(cluster: LocalCluster) -> None:
    url = cluster.router_http
    assert url.startswith("https://127.0.0.1:") and url.endswith("/v1")
    assert any(f"http {url}" in line for line in describe(cluster))
    assert cluster.spec.tls_cert is not None
    trust = ssl.create_default_context(cafile=cluster.spec.tls_cert)
    api = client(cluster)
    answer = api.images.generate(prompt="a lighthouse at dusk", n=2, size="64x64")
    assert answer.data is not None and len(answer.data) == 2
    for item in answer.data:
        assert item.b64_json is not None
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (64, 64)
        extra: Any = item.model_extra
        assert extra["level"] and extra["timing"]["total_ms"] > 0.0
    # streamed: the router's call to the worker's GenerateStream passes the internal plane
    events = list(api.images.generate(prompt="a red fox", size="64x64", stream=True))
    steps = [e.model_extra or {} for e in events if e.type == "argus.progress"]
    assert [p["step"] for p in steps if p["stage"] == "step"] == [1, 2, 3, 4]
    assert events[-1].type == "image_generation.completed"
    with httpx.Client(verify=trust, timeout=30) as plain:
        assert plain.get(url.removesuffix("/v1") + "/readyz").status_code == 200
        assert plain.get(f"{url}/models").status_code == 401  # no token


def test_concurrent_edits_are_batched_and_placed_by_the_mask_aware_balancer(
    cluster: LocalCluster,
) -> None:
    """Four edits of one template at once through the HTTP API: each is answered with its
    template outside the region; the router placed them with its balancer and the worker ran
    batched steps (its batch-size histogram)."""
    api = client(cluster)
    region = region_of(0.25)

    def edit(seed: int) -> Any:
        return api.images.edit(
            image=("template.png", encode(template_rgb()), "image/png"),
            mask=("mask.png", mask_png(region), "image/png"),
            prompt="a red boat on a lake",
            response_format="b64_json",
            extra_body={"steps": 8, "seed": seed},
        )

    placed = metric(cluster, "router", "argus_router_edits_placed_total")
    steps = metric(cluster, "worker-0", "argus_worker_edit_batch_size_count")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(edit, range(4)))
    for answer in answers:
        assert answer.data is not None and len(answer.data) == 1
        image = pixels(base64.b64decode(answer.data[0].b64_json or ""))
        assert np.array_equal(image[~region], template_rgb()[~region])
    assert metric(cluster, "router", "argus_router_edits_placed_total") - placed == 4
    assert metric(cluster, "worker-0", "argus_worker_edit_batch_size_count") - steps >= 8


def test_taken_http_port_stops_the_router_naming_it() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        command = [sys.executable, "-m", "argus", "router", "--allocator", "127.0.0.1:1"]
        result = subprocess.run(
            [*command, "--insecure-internal", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "--http-port" in result.stderr
    assert "Traceback" not in result.stderr
