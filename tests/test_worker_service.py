"""The worker's gRPC service: Generate/Configure/Stats, status codes for bad input, health,
reflection, and the ``argus worker`` process."""

from __future__ import annotations

import io
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from argus.plumbing import rpc
from argus.worker.service import create_server
from tests.service_process import START_TIMEOUT_S, read_address, start_argus
from tests.tls_factories import TestCA
from tests.worker_factories import STEPS, make_worker

pytestmark = pytest.mark.integration


worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, grpc.Channel, str]]:
    worker = make_worker(max_queue=8, warm=True)
    server, port, _ = create_server(worker, "127.0.0.1:0", threads=4)
    server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    yield worker, channel, address
    channel.close()
    server.stop(grace=None)
    worker.close()


def stub(channel: grpc.Channel) -> Any:
    return worker_pb2_grpc.WorkerStub(channel)


def test_generate_returns_a_png_and_its_breakdown(served: Any) -> None:
    _, channel, _ = served
    request = worker_pb2.GenerateRequest(request_id="r1", prompt="a kite", seed=5, level="ac-k5")
    request.width, request.height = 48, 32
    reply = stub(channel).Generate(request, timeout=60)
    image = Image.open(io.BytesIO(reply.png))
    assert image.format == "PNG"
    assert image.size == (48, 32)
    assert reply.request_id == "r1"
    assert reply.level == "ac-k5"
    assert reply.model == "sdxl"
    assert reply.steps_run == STEPS
    assert reply.worker_id == "worker-0"
    assert reply.timing.total_ms >= reply.timing.denoise_ms > 0
    assert worker_pb2.CacheOutcome.Name(reply.cache) == "CACHE_NOT_USED"


BAD = [
    ({"width": 0}, "width"),
    ({"width": -8}, "width"),
    ({"height": 100}, "height"),
    ({"width": 100_000}, "width"),
    ({"steps": 0}, "steps"),
    ({"steps": -1}, "steps"),
    ({"steps": 5000}, "steps"),
    ({"level": "sm-nope"}, "level"),
    ({"level": "ac-k25", "steps": 25}, "level"),
    ({"prompt": "p" * 70_000}, "prompt"),
]


@pytest.mark.parametrize(("fields", "name"), BAD)
def test_bad_input_is_invalid_argument_naming_the_field(
    served: Any, fields: dict[str, Any], name: str
) -> None:
    _, channel, _ = served
    request = worker_pb2.GenerateRequest(prompt="x")
    for key, value in fields.items():
        setattr(request, key, value)
    with pytest.raises(grpc.RpcError) as err:
        stub(channel).Generate(request, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{name}:")


def test_malformed_bytes_get_an_error_and_the_worker_keeps_serving(served: Any) -> None:
    _, channel, _ = served
    raw = channel.unary_unary("/argus.v1.Worker/Generate")  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\xff\x0f garbage", timeout=30)
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    # non-UTF-8 bytes in the prompt field (field 2, length-delimited)
    with pytest.raises(grpc.RpcError):
        raw(b"\x12\x02\xc3\x28", timeout=30)
    reply = stub(channel).Generate(worker_pb2.GenerateRequest(prompt="still here"), timeout=60)
    assert reply.png.startswith(b"\x89PNG")


def test_configure_errors_have_status_codes(served: Any) -> None:
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        stub(channel).Configure(worker_pb2.ConfigureRequest(variant="sd-9"), timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "variant" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub(channel).Configure(worker_pb2.ConfigureRequest(level="ac-k999"), timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("level:")


def test_stats_report_models_queue_and_counts(served: Any) -> None:
    _, channel, _ = served
    stats = stub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
    assert stats.worker_id == "worker-0"
    assert stats.queue_length == 0
    assert stats.completed >= 0
    assert [m.name for m in stats.models] == ["sdxl"]
    assert stats.models[0].active
    assert worker_pb2.ModelState.State.Name(stats.models[0].state) == "READY"
    assert stats.memory_used_bytes > 0
    assert stats.memory_budget_bytes >= stats.memory_used_bytes


def test_health_and_reflection(served: Any) -> None:
    _, channel, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "argus.v1.Worker"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"argus.v1.Worker", "grpc.health.v1.Health"} <= names


def test_health_is_serving_only_after_the_model_loads_and_warms_up() -> None:
    worker = make_worker(load=False)
    server, port, servicer = create_server(worker, "127.0.0.1:0", threads=2)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="argus.v1.Worker")
            assert (
                health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            with pytest.raises(grpc.RpcError) as err:
                stub(channel).Generate(worker_pb2.GenerateRequest(prompt="x"), timeout=10)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            request = worker_pb2.ConfigureRequest(wait=True)
            stub(channel).Configure(request, timeout=60)
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert health.Check(check, timeout=10).status == not_serving  # loaded, not run yet
            worker.warm_up()
            servicer.update_health()
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace=None)
        worker.close()


def test_argus_worker_process_serves_and_stops_on_sigterm(
    tmp_path: Any, cluster_ca: TestCA
) -> None:
    process = start_argus(
        *("worker", "--model", "tiny", "--port", "0", "--worker-id", "w-proc"),
        *("--default-steps", "4", "--no-cache"),
        *("--internal-tls-dir", str(cluster_ca.directory("worker", "w-proc"))),
    )
    try:
        address = read_address(process, "worker")
        deadline = time.monotonic() + START_TIMEOUT_S  # bound, not a budget: see read_address
        check = health_pb2.HealthCheckRequest(service="argus.v1.Worker")
        statuses = []
        while True:
            # a new channel per attempt: a channel that failed to connect once can sit in
            # reconnect backoff (a fresh-clone run once hung in channel_ready_future here)
            with cluster_ca.channel(address, "operator") as probe:
                try:
                    status = health_pb2_grpc.HealthStub(probe).Check(check, timeout=5).status
                except grpc.RpcError:
                    status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            statuses.append(status)
            assert time.monotonic() < deadline, f"never SERVING; saw {statuses[-5:]}"
            time.sleep(0.1)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses  # loading, warming up
        with cluster_ca.channel(address, "router") as channel:
            stats = stub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
            assert stats.completed == 0  # the warm-up run is not counted as a request
            reply = stub(channel).Generate(worker_pb2.GenerateRequest(prompt="a tram"), timeout=60)
            assert reply.worker_id == "w-proc"
            assert reply.steps_run == 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_argus_generate_saves_the_png(served: Any, tmp_path: Any, capsys: Any) -> None:
    from argus.cli.main import main

    _, _, address = served
    out = tmp_path / "kite.png"
    assert main(["generate", "--address", address, "--prompt", "a kite", "--out", str(out)]) == 0
    assert Image.open(out).format == "PNG"
    assert '"level": "ac-k0"' in capsys.readouterr().out
    bad = ["generate", "--address", address, "--prompt", "a kite", "--steps", "0"]
    assert main([*bad, "--out", str(out)]) == 2
    assert "INVALID_ARGUMENT: steps:" in capsys.readouterr().err
