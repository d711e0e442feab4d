"""The ControlNet service: status codes for bad input (and serving on afterwards), session
limits, health, reflection, metrics, and the ``argus controlnet`` process."""

from __future__ import annotations

import io
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest

from argus.contracts.controlnet import ControlUnit
from argus.plumbing import rpc
from argus.worker.adapters.controlnet.client import RemoteControlNetExecutor
from argus.worker.adapters.controlnet.errors import (
    ControlNetBusyError,
    ControlNetUnavailableError,
    InvalidControlNetRequest,
    UnknownControlNetError,
)
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor, SessionSpec
from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
from argus.worker.adapters.controlnet.models import ControlNetCatalog
from argus.worker.adapters.controlnet.predictor import ControlNetPredictor
from argus.worker.adapters.controlnet.service import create_server
from argus.worker.adapters.controlnet.transport import step_to_pb, tensor_to_pb
from tests.service_process import read_address, start_argus
from tests.tls_factories import TestCA
from tests.worker_factories import spec, tiny_model

pytestmark = pytest.mark.integration


common_pb2: Any = rpc.load("common_pb2")
controlnet_pb2: Any = rpc.load("controlnet_pb2")
controlnet_pb2_grpc: Any = rpc.load("controlnet_pb2_grpc")

CONTROLNET = common_pb2.Adapter.Kind.CONTROLNET


def png(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LocalControlNetExecutor, str, CollectorRegistry]]:
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny(), max_models=4, max_sessions=2)
    registry = CollectorRegistry()
    metrics = ControlNetMetrics(executor.stats, registry)
    server, port, _ = create_server(executor, "127.0.0.1:0", threads=8, metrics=metrics)
    server.start()
    yield executor, f"127.0.0.1:{port}", registry
    server.stop(grace=None)


@pytest.fixture(scope="module")
def channel(served: Any) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(served[1]) as channel:
        yield channel


def sd15_open(**fields: Any) -> Any:
    """A valid ``open`` for the tiny SD-1.5 family: CFG batch 2, 77 tokens of width 32."""
    message = controlnet_pb2.ControlNetOpen(
        request_id="r",
        base_family="sd15",
        height=64,
        width=64,
        controlnets=[common_pb2.Adapter(kind=CONTROLNET, name="canny", control_image=png())],
        encoder_hidden_states=tensor_to_pb(torch.randn(2, 77, 32)),
    )
    for key, value in fields.items():
        if key == "controlnets":
            del message.controlnets[:]
            message.controlnets.extend(value)
        elif isinstance(value, torch.Tensor):
            getattr(message, key).CopyFrom(tensor_to_pb(value))
        elif value is None:
            message.ClearField(key)
        else:
            setattr(message, key, value)
    return controlnet_pb2.ControlNetRequest(open=message)


def step(sample: torch.Tensor | None = None, timestep: torch.Tensor | None = None) -> Any:
    sample = torch.randn(2, 4, 8, 8) if sample is None else sample
    timestep = torch.tensor(901.0) if timestep is None else timestep
    return step_to_pb(3, sample, timestep)


def run(channel: grpc.Channel, *requests: Any) -> list[Any]:
    stub = controlnet_pb2_grpc.ControlNetStub(channel)
    return list(stub.Run(iter(requests), timeout=60))


def test_a_session_answers_opened_then_one_residual_set_per_step(channel: grpc.Channel) -> None:
    replies = run(channel, sd15_open(), step(), step())
    assert [r.WhichOneof("kind") for r in replies] == ["opened", "residuals", "residuals"]
    assert len(replies[0].opened.cache_hits) == 1
    residuals = replies[1].residuals
    assert residuals.step == 3
    assert list(residuals.down[0].shape) == [2, 24, 8, 8]
    assert list(residuals.mid.shape) == [2, 48, 4, 4]
    assert residuals.compute_ms > 0


def adapter(**fields: Any) -> Any:
    fields.setdefault("kind", CONTROLNET)
    fields.setdefault("name", "canny")
    fields.setdefault("control_image", png())
    return common_pb2.Adapter(**fields)


BAD_OPENS = [
    ({"controlnets": [adapter(name="nope")]}, "NOT_FOUND", "controlnets[0].name"),
    (
        {"controlnets": [adapter(), adapter(name="ghost")]},
        "NOT_FOUND",
        "controlnets[1].name",
    ),
    (
        {
            "base_family": "sdxl",
            "controlnets": [adapter(name="shuffle")],
            "encoder_hidden_states": torch.randn(2, 77, 64),
            "text_embeds": torch.randn(2, 32),
            "time_ids": torch.randn(2, 6),
        },
        "INVALID_ARGUMENT",
        "controlnets[0].name",
    ),
    ({"base_family": ""}, "INVALID_ARGUMENT", "base_family"),
    ({"base_family": "sd3"}, "INVALID_ARGUMENT", "base_family"),
    (
        {"controlnets": [adapter(control_image=b"GIF89a")]},
        "INVALID_ARGUMENT",
        "controlnets[0].control_image",
    ),
    (
        {"controlnets": [adapter(control_image=b"")]},
        "INVALID_ARGUMENT",
        "controlnets[0].control_image",
    ),
    ({"controlnets": [adapter(kind=1)]}, "INVALID_ARGUMENT", "controlnets[0].kind"),
    ({"controlnets": [adapter(name="")]}, "INVALID_ARGUMENT", "controlnets[0].name"),
    ({"controlnets": []}, "INVALID_ARGUMENT", "controlnets"),
    ({"encoder_hidden_states": None}, "INVALID_ARGUMENT", "encoder_hidden_states"),
    (
        {"encoder_hidden_states": torch.zeros(2, 77, 32, dtype=torch.int64)},
        "INVALID_ARGUMENT",
        "encoder_hidden_states",
    ),
    (
        {"encoder_hidden_states": torch.randn(2, 77, 16)},
        "INVALID_ARGUMENT",
        "encoder_hidden_states",
    ),
    ({"encoder_hidden_states": torch.randn(77, 32)}, "INVALID_ARGUMENT", "encoder_hidden_states"),
    ({"text_embeds": torch.randn(2, 32)}, "INVALID_ARGUMENT", "text_embeds"),
    ({"height": 0}, "INVALID_ARGUMENT", "height"),
    ({"width": 60}, "INVALID_ARGUMENT", "width"),
    (
        {
            "base_family": "sdxl",
            "encoder_hidden_states": torch.randn(2, 77, 64),
            "text_embeds": torch.randn(2, 32),
        },
        "INVALID_ARGUMENT",
        "time_ids",
    ),
]


@pytest.mark.parametrize(("fields", "code", "field"), BAD_OPENS)
def test_bad_opens_get_a_status_naming_the_field(
    channel: grpc.Channel, fields: dict[str, Any], code: str, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        run(channel, sd15_open(**fields), step())
    assert err.value.code().name == code
    assert err.value.details().startswith(f"{field}: ")


def test_a_malformed_tensor_names_its_field(channel: grpc.Channel) -> None:
    request = sd15_open()
    request.open.encoder_hidden_states.data = b"\x00" * 12
    with pytest.raises(grpc.RpcError) as err:
        run(channel, request)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("encoder_hidden_states: 12 bytes")


BAD_STEPS = [
    (step(sample=torch.randn(2, 4, 8, 4)), "step.sample"),
    (step(sample=torch.randn(1, 4, 8, 8)), "step.sample"),
    (step(sample=torch.randn(2, 3, 8, 8)), "step.sample"),
    (step(sample=torch.zeros(2, 4, 8, 8, dtype=torch.int32)), "step.sample"),
    (step(timestep=torch.tensor([1.0, 2.0])), "step.timestep"),
    (controlnet_pb2.ControlNetRequest(step=controlnet_pb2.ControlNetStep(step=1)), "step.sample"),
    (sd15_open(), "open"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_STEPS)
def test_bad_steps_end_the_session_with_invalid_argument(
    channel: grpc.Channel, bad: Any, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        run(channel, sd15_open(), step(), bad)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: ")


@pytest.mark.parametrize("requests", [[], [step()]])
def test_a_stream_must_begin_with_open(channel: grpc.Channel, requests: list[Any]) -> None:
    with pytest.raises(grpc.RpcError) as err:
        run(channel, *requests)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("open: ")


def test_garbage_bytes_get_an_error_and_the_service_keeps_serving(
    served: Any, channel: grpc.Channel
) -> None:
    raw = channel.stream_stream("/argus.v1.ControlNet/Run")  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff\xff\x0f garbage"]), timeout=30))
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    replies = run(channel, sd15_open(), step())
    assert replies[-1].WhichOneof("kind") == "residuals"
    executor = served[0]
    assert executor.stats().sessions_open == 0
    assert executor.cache.stats().leased == 0


def sd15_spec(name: str = "canny", image: bytes | None = None) -> SessionSpec:
    return SessionSpec(
        family="sd15",
        height=64,
        width=64,
        units=(ControlUnit(name, 1.0, png() if image is None else image),),
        encoder_hidden_states=torch.randn(2, 77, 32),
    )


def test_the_client_raises_the_local_error_classes(served: Any) -> None:
    remote = RemoteControlNetExecutor(served[1], timeout_s=30)
    try:
        with pytest.raises(UnknownControlNetError) as unknown:
            remote.open(sd15_spec("nope"))
        assert unknown.value.field == "controlnets[0].name"
        with pytest.raises(InvalidControlNetRequest) as bad:
            remote.open(sd15_spec(image=b"junk"))
        assert bad.value.field == "controlnets[0].control_image"
        session = remote.open(sd15_spec())
        with pytest.raises(InvalidControlNetRequest, match=r"^step\.sample"):
            session.submit(0, torch.randn(2, 4, 4, 4), torch.tensor(1.0)).result(timeout=30)
        with pytest.raises(InvalidControlNetRequest):  # the session is over
            session.submit(1, torch.randn(2, 4, 8, 8), torch.tensor(1.0))
        session.close()
    finally:
        remote.close()


def test_a_full_service_refuses_new_sessions_until_one_ends(served: Any) -> None:
    remote = RemoteControlNetExecutor(served[1], timeout_s=30)
    try:
        first, second = remote.open(sd15_spec()), remote.open(sd15_spec())
        with pytest.raises(ControlNetBusyError, match="limit is 2"):
            remote.open(sd15_spec())
        first.close()
        deadline = time.monotonic() + 10
        while served[0].stats().sessions_open > 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        third = remote.open(sd15_spec())
        residuals = third.submit(0, torch.randn(2, 4, 8, 8), torch.tensor(5.0)).result(timeout=30)
        assert residuals.mid.shape == (2, 48, 4, 4)
        second.close()
        third.close()
    finally:
        remote.close()


def test_no_service_is_unavailable() -> None:
    remote = RemoteControlNetExecutor("127.0.0.1:1", timeout_s=5)
    try:
        with pytest.raises(ControlNetUnavailableError):
            remote.wait_ready(0.2)
        with pytest.raises(ControlNetUnavailableError):
            remote.open(sd15_spec())
    finally:
        remote.close()


def test_health_reflection_stats_and_metrics(served: Any, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "argus.v1.ControlNet"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"argus.v1.ControlNet", "grpc.health.v1.Health"} <= names

    # on its own, whatever ran before it in this module's server: a load or a hit, then a
    # hit, then a session refused NOT_FOUND (an unknown ControlNet)
    run(channel, sd15_open(), step())
    run(channel, sd15_open(), step())
    with pytest.raises(grpc.RpcError) as refused:
        run(channel, sd15_open(controlnets=[adapter(name="nope")]))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    stats = controlnet_pb2_grpc.ControlNetStub(channel).Stats(
        controlnet_pb2.ControlNetStatsRequest(), timeout=10
    )
    assert stats.policy == "lru"
    assert "sd15/canny" in stats.resident
    assert stats.hits >= 1 and stats.loads >= 1
    assert stats.sessions_open == 0
    text = generate_latest(served[2]).decode()
    assert re.search(r"^argus_controlnet_cache_hits_total [1-9]", text, re.M)
    assert re.search(r"^argus_controlnet_cache_loads_total [1-9]", text, re.M)
    assert 'argus_controlnet_sessions_total{code="OK"}' in text
    assert 'argus_controlnet_sessions_total{code="NOT_FOUND"}' in text
    assert "argus_controlnet_step_seconds_count" in text
    assert "argus_controlnet_cache_resident_bytes" in text


# -- the process ---------------------------------------------------------------------------


def test_argus_controlnet_process_serves_and_stops_on_sigterm(cluster_ca: TestCA) -> None:
    process = start_argus(
        *("controlnet", "--port", "0", "--base-family", "sd15", "--policy", "lfu"),
        *("--cache-size", "2", "--preload", "canny", "--device", "cpu"),
        *("--internal-tls-dir", str(cluster_ca.directory("controlnet", "controlnet"))),
    )
    try:
        deadline = time.monotonic() + 120
        address = read_address(process, "service")
        with cluster_ca.channel(address, "worker", "w-1") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="argus.v1.ControlNet")
            while health.Check(check, timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as err:  # this service serves sd15 only
                run(channel, sd15_open(base_family="sdxl"))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("base_family: ")
        remote = RemoteControlNetExecutor(
            address, timeout_s=60, tls=cluster_ca.tls("worker", "w-1")
        )
        try:
            model = tiny_model("sd-1.5")
            units = (ControlUnit("canny", 1.0, png(1)),)
            predictor = ControlNetPredictor(model, remote, units)
            model.denoise(spec(steps=2), predictor=predictor)
            assert predictor.stats.cache_hits == (True,)  # preloaded
            stats = remote.stats()
            assert stats.cache.policy == "lfu"
            assert stats.cache.resident == ("sd15/canny",)
            assert stats.steps_total == 2
        finally:
            remote.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port: 70000"),
        (["--cache-size", "0"], "--cache-size: must be >= 1, got 0"),
        (["--cache-bytes", "0"], "--cache-bytes: must be >= 1, got 0"),
        (["--max-sessions", "0"], "--max-sessions: must be >= 1, got 0"),
        (["--catalog", "/nonexistent/catalog"], "not a directory"),
    ],
)
def test_cli_usage_errors(args: list[str], message: str, capsys: Any) -> None:
    from argus.cli.main import main

    assert main(["controlnet", *args, "--insecure-internal"]) == 2
    assert message in capsys.readouterr().err
