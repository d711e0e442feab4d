"""The internal plane's defences, against real gRPC servers on loopback: mutual TLS (no
certificate, no connection), roles per method, worker ids bound to their identity, malformed
bytes answered INVALID_ARGUMENT by every service, ports that cannot be shared, one
``authorization`` header only, and routers that refuse images of the wrong size."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from argus.allocator.control import ControlConfig
from argus.allocator.membership import Membership, NotOwnerError
from argus.allocator.service import AllocatorServicer
from argus.allocator.service import create_server as create_allocator
from argus.cli.main import main
from argus.contracts.allocator_client import AllocatorClient
from argus.contracts.routers import RouterReport
from argus.contracts.workers import WorkerReport
from argus.plumbing import rpc
from argus.plumbing.grpc_server import bind, new_server
from argus.plumbing.internal_tls import Identity, InternalTLS, channel
from argus.profiles import default_profiles
from argus.router.app import ServerSecurity
from argus.tools.local_cluster import ClusterSpec, LocalCluster
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
from argus.worker.adapters.controlnet.models import ControlNetCatalog
from argus.worker.adapters.controlnet.service import create_server as create_controlnet
from argus.worker.service import create_server as create_worker
from tests.router_cluster import Cluster, StubWorker
from tests.service_process import START_TIMEOUT_S
from tests.tls_factories import TestCA
from tests.worker_factories import make_worker

pytestmark = pytest.mark.e2e


allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")
controlnet_pb2: Any = rpc.load("controlnet_pb2")
controlnet_pb2_grpc: Any = rpc.load("controlnet_pb2_grpc")
router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

PROFILES = default_profiles()
CLASS = PROFILES.worker_classes[0]
TIMEOUT = 10
GARBAGE = b"\xff\xff\xff\xff\x0f not a protobuf message"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def code_of(call: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=TIMEOUT, **kwargs)
        if hasattr(result, "__next__"):  # a stream: the status comes with the first read
            next(result)
    return err.value.code(), err.value.details() or ""


# -- the allocator -------------------------------------------------------------------------


class Allocator:
    def __init__(self, servicer: AllocatorServicer, address: str, clock: FakeClock) -> None:
        self.servicer = servicer
        self.address = address
        self.clock = clock

    def workers(self) -> dict[str, str]:
        """worker id → address, as the allocator plans for them."""
        return {m.worker_id: m.report.address for m in self.servicer.control._members.members()}

    def forecast_qpm(self) -> float:
        return float(self.servicer.control._allocator.forecast(self.clock()).qpm)


@pytest.fixture(scope="module")
def allocator(cluster_ca: TestCA) -> Iterator[Allocator]:
    clock = FakeClock()
    server, port, servicer = create_allocator(
        PROFILES,
        config=ControlConfig(period_s=60.0, heartbeat_s=30.0),
        clock=clock,
        tls=cluster_ca.tls("allocator", "allocator"),
    )
    server.start()
    yield Allocator(servicer, f"127.0.0.1:{port}", clock)
    servicer.close()
    server.stop(grace=None)


def arrivals(router_id: str, sequence: int, count: int) -> RouterReport:
    """A report of ``count`` arrivals just now from ``router_id``."""
    return RouterReport(router_id, sequence, count, (0.0,) * count)


def client(address: str, tls: InternalTLS | None) -> AllocatorClient:
    return AllocatorClient(address, timeout_s=TIMEOUT, tls=tls)


def test_a_caller_without_a_certificate_of_the_cluster_cannot_register(
    allocator: Allocator, cluster_ca: TestCA, tmp_path: Path
) -> None:
    before = allocator.workers()
    rogue_ca = TestCA(tmp_path)  # a certificate that names a worker, from another CA
    for tls in (None, rogue_ca.tls("worker", "rogue")):
        rogue = client(allocator.address, tls)
        with pytest.raises(grpc.RpcError) as err:
            rogue.heartbeat(WorkerReport("rogue", "127.0.0.1:6666", CLASS))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # the handshake failed
        rogue.close()
    # TLS without a client certificate: the server requires one
    server_only = grpc.ssl_channel_credentials(root_certificates=cluster_ca.tls("worker", "x").ca)
    with grpc.secure_channel(
        allocator.address,
        server_only,
        options=[("grpc.ssl_target_name_override", "argus.internal")],
    ) as anonymous:
        stub = allocator_pb2_grpc.AllocatorStub(anonymous)
        code, _ = code_of(stub.Heartbeat, allocator_pb2.WorkerHeartbeat(worker_id="rogue"))
        assert code is grpc.StatusCode.UNAVAILABLE
    assert allocator.workers() == before
    # the same call with a worker certificate of the cluster joins
    legit = client(allocator.address, cluster_ca.tls("worker", "worker-3"))
    legit.heartbeat(WorkerReport("worker-3", "127.0.0.1:7003", CLASS))
    assert allocator.workers()["worker-3"] == "127.0.0.1:7003"
    legit.close()


def test_a_worker_id_belongs_to_the_identity_that_registered_it(
    allocator: Allocator, cluster_ca: TestCA
) -> None:
    owner = client(allocator.address, cluster_ca.tls("worker", "worker-1"))
    owner.heartbeat(WorkerReport("worker-1", "127.0.0.1:7001", CLASS))
    rogue = client(allocator.address, cluster_ca.tls("worker", "worker-9"))
    forged = [
        WorkerReport("worker-1", "127.0.0.1:7001", CLASS),  # heartbeat for it
        WorkerReport("worker-1", "127.0.0.1:7001", CLASS, leaving=True),  # leave for it
        WorkerReport("worker-1", "127.0.0.1:6666", CLASS),  # move it
    ]
    for report in forged:
        with pytest.raises(grpc.RpcError) as err:
            rogue.heartbeat(report)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "worker_id: 'worker-1'" in (err.value.details() or "")
    assert allocator.workers()["worker-1"] == "127.0.0.1:7001"
    rogue.heartbeat(WorkerReport("worker-9", "127.0.0.1:7009", CLASS))  # its own id: fine
    owner.heartbeat(WorkerReport("worker-1", "127.0.0.1:7011", CLASS))  # its owner moves it
    assert allocator.workers()["worker-1"] == "127.0.0.1:7011"
    owner.close()
    rogue.close()


def test_a_router_id_belongs_to_the_identity_that_first_reported_it(
    allocator: Allocator, cluster_ca: TestCA
) -> None:
    owner = client(allocator.address, cluster_ca.tls("router", "router-a"))
    owner.report(arrivals("router-a", 1, 10), PROFILES)
    forecast = allocator.forecast_qpm()
    rogue = client(allocator.address, cluster_ca.tls("router", "router-b"))
    with pytest.raises(grpc.RpcError) as err:  # a router of the cluster, speaking for another
        rogue.report(arrivals("router-a", 2, 5000), PROFILES)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "router_id: 'router-a'" in (err.value.details() or "")
    assert allocator.forecast_qpm() == forecast  # nothing of the forged report counted
    rogue.report(arrivals("router-b", 1, 10), PROFILES)  # its own id: fine
    owner.report(arrivals("router-a", 2, 10), PROFILES)  # the owner goes on
    owner.close()
    rogue.close()


def test_only_routers_report_and_only_workers_heartbeat(
    allocator: Allocator, cluster_ca: TestCA
) -> None:
    forecast = allocator.forecast_qpm()
    worker = client(allocator.address, cluster_ca.tls("worker", "worker-4"))
    with pytest.raises(grpc.RpcError) as err:
        worker.report(arrivals("router-0", 1, 5000), PROFILES)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "/argus.v1.Allocator/ReportRouter" in (err.value.details() or "")
    assert allocator.forecast_qpm() == forecast
    router = client(allocator.address, cluster_ca.tls("router", "router-0"))
    with pytest.raises(grpc.RpcError) as err:
        router.heartbeat(WorkerReport("worker-5", "127.0.0.1:7005", CLASS))
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "worker-5" not in allocator.workers()
    router.report(arrivals("router-0", 1, 50), PROFILES)  # a router may
    assert allocator.forecast_qpm() > forecast
    assert router.get_plan().version >= 1
    with pytest.raises(grpc.RpcError) as err:
        worker.get_plan()  # plans go to routers (and operators)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    worker.close()
    router.close()


# -- a worker and the ControlNet service ---------------------------------------------------


@pytest.fixture(scope="module")
def worker_address(cluster_ca: TestCA) -> Iterator[str]:
    worker = make_worker(max_queue=4, warm=True)
    server, port, _ = create_worker(
        worker, "127.0.0.1:0", threads=4, tls=cluster_ca.tls("worker", "worker-1")
    )
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)
    worker.close()


def worker_stub(address: str, tls: InternalTLS | None) -> tuple[grpc.Channel, Any]:
    ch = channel(address, tls)
    return ch, worker_pb2_grpc.WorkerStub(ch)


def test_a_worker_serves_generate_to_routers_and_configure_to_the_allocator_only(
    worker_address: str, cluster_ca: TestCA
) -> None:
    request = worker_pb2.GenerateRequest(prompt="a tram", steps=2)
    anonymous, stub = worker_stub(worker_address, None)
    code, _ = code_of(stub.Generate, request)
    assert code is grpc.StatusCode.UNAVAILABLE  # no certificate: no connection at all
    anonymous.close()
    as_router, stub = worker_stub(worker_address, cluster_ca.tls("router", "router-0"))
    assert stub.Generate(request, timeout=60).png
    code, details = code_of(stub.Configure, worker_pb2.ConfigureRequest(level="ac-k0"))
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith("/argus.v1.Worker/Configure: router/router-0 may not call it")
    as_router.close()
    as_worker, stub = worker_stub(worker_address, cluster_ca.tls("worker", "worker-2"))
    code, _ = code_of(stub.Generate, request)  # another worker cannot use it directly
    assert code is grpc.StatusCode.PERMISSION_DENIED
    as_worker.close()
    as_allocator, stub = worker_stub(worker_address, cluster_ca.tls("allocator", "allocator"))
    assert stub.Configure(worker_pb2.ConfigureRequest(level="ac-k0"), timeout=60).level
    health = health_pb2_grpc.HealthStub(as_allocator)  # health: any certificate of the cluster
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == 1
    as_allocator.close()


@pytest.fixture(scope="module")
def controlnet_address(cluster_ca: TestCA) -> Iterator[str]:
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny(), max_models=2, max_sessions=2)
    server, port, _ = create_controlnet(
        executor, "127.0.0.1:0", threads=4, tls=cluster_ca.tls("controlnet", "controlnet")
    )
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)
    executor.close()


def test_the_controlnet_service_answers_workers_only(
    controlnet_address: str, cluster_ca: TestCA
) -> None:
    stats = controlnet_pb2.ControlNetStatsRequest()
    with cluster_ca.channel(controlnet_address, "worker", "worker-1") as ch:
        controlnet_pb2_grpc.ControlNetStub(ch).Stats(stats, timeout=TIMEOUT)
    with cluster_ca.channel(controlnet_address, "router", "router-0") as ch:
        stub = controlnet_pb2_grpc.ControlNetStub(ch)
        code, _ = code_of(stub.Run, iter([controlnet_pb2.ControlNetRequest()]))
        assert code is grpc.StatusCode.PERMISSION_DENIED
    with channel(controlnet_address, None) as ch:
        code, _ = code_of(controlnet_pb2_grpc.ControlNetStub(ch).Stats, stats)
        assert code is grpc.StatusCode.UNAVAILABLE


# -- malformed bytes -----------------------------------------------------------------------


def raw_unary(ch: grpc.Channel, method: str) -> Any:
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)


def test_random_bytes_are_invalid_argument_on_every_service(
    allocator: Allocator, worker_address: str, controlnet_address: str, cluster_ca: TestCA
) -> None:
    with cluster_ca.channel(allocator.address, "worker", "worker-1") as ch:
        code, details = code_of(raw_unary(ch, "/argus.v1.Allocator/Heartbeat"), GARBAGE)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid WorkerHeartbeat" in details
    with cluster_ca.channel(allocator.address, "router", "router-0") as ch:
        code, _ = code_of(raw_unary(ch, "/argus.v1.Allocator/ReportRouter"), GARBAGE)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        watch: Any = ch.unary_stream("/argus.v1.Allocator/WatchPlan")
        code, details = code_of(watch, GARBAGE)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid WatchPlanRequest" in details
    with cluster_ca.channel(worker_address, "router", "router-0") as ch:
        code, details = code_of(raw_unary(ch, "/argus.v1.Worker/Generate"), GARBAGE)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid GenerateRequest" in details
    with cluster_ca.channel(controlnet_address, "worker", "worker-1") as ch:
        run: Any = ch.stream_stream("/argus.v1.ControlNet/Run")
        code, details = code_of(run, iter([GARBAGE]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid ControlNetRequest" in details
        # the service keeps serving
        controlnet_pb2_grpc.ControlNetStub(ch).Stats(
            controlnet_pb2.ControlNetStatsRequest(), timeout=TIMEOUT
        )


# -- ports ---------------------------------------------------------------------------------


def test_a_second_server_on_a_taken_port_fails_naming_the_port() -> None:
    first = new_server(threads=1, thread_prefix="t", max_receive_bytes=1024, max_send_bytes=1024)
    port = bind(first, "127.0.0.1:0")
    first.start()
    try:
        second = new_server(
            threads=1, thread_prefix="t", max_receive_bytes=1024, max_send_bytes=1024
        )
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            bind(second, f"127.0.0.1:{port}")
    finally:
        first.stop(grace=None)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def run_argus(*args: str) -> tuple[int, str]:
    """``python -m argus ARGS`` to its end: the exit code and what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "argus", *args],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_cli_exits_naming_a_taken_port(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", "--port", str(taken_port)]) == 2
    assert f"--port: 127.0.0.1:{taken_port} is taken" in capsys.readouterr().err
    plain = ("--insecure-internal", "--classifier", "none")
    code, printed = run_argus("allocator", "--port", str(taken_port), *plain)
    assert code == 2 and f"cannot bind 127.0.0.1:{taken_port}" in printed
    code, printed = run_argus("allocator", "--metrics-port", str(taken_port), *plain)
    assert code == 2 and f"metrics port 127.0.0.1:{taken_port}: cannot bind" in printed


def test_service_commands_refuse_to_start_without_internal_tls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (["allocator"], ["router", "--allocator", "127.0.0.1:1"], ["controlnet"]):
        assert main(command) == 2
        assert "--internal-tls-dir: required" in capsys.readouterr().err


# -- the local cluster's certificates ------------------------------------------------------


def test_a_local_cluster_gives_each_part_its_own_certificate_and_never_the_ca_key(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(ClusterSpec(workdir=tmp_path))
    directory = cluster.tls_dir(Identity("worker", "worker-0"))
    assert sorted(p.name for p in directory.iterdir()) == ["ca.crt", "worker.crt", "worker.key"]
    assert os.stat(directory / "worker.key").st_mode & 0o077 == 0
    assert InternalTLS.load(directory, "worker").identity == Identity("worker", "worker-0")


# -- the router: one token header, images of the size asked for ----------------------------


def tiny_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


SIZE = (32, 48)


class SizedWorker(StubWorker):
    """Answers a real PNG of ``SIZE`` whatever the request asked for."""

    def __init__(self, worker_id: str, fail: grpc.StatusCode | None = None) -> None:
        super().__init__(worker_id, fail)
        self.png = tiny_png(*SIZE)

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        reply = super().Generate(request, context)
        reply.png = self.png
        return reply


def test_two_authorization_headers_are_refused_even_with_one_right() -> None:
    cluster = Cluster()
    try:
        cluster.add_worker("w0")
        address = cluster.start_router(security=ServerSecurity(token="secret"))
        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            request = router_pb2.RouterGenerateRequest(prompt="a kite", request_id="r1")
            both = (("authorization", "Bearer wrong"), ("authorization", "Bearer secret"))
            for metadata in (both, both[::-1]):
                code, _ = code_of(stub.Generate, request, metadata=metadata)
                assert code is grpc.StatusCode.UNAUTHENTICATED
            assert stub.Generate(request, timeout=TIMEOUT, metadata=both[1:]).png
    finally:
        cluster.close()


def test_a_router_refuses_an_image_of_another_size_than_asked() -> None:
    cluster = Cluster()
    cluster.worker_type = SizedWorker
    try:
        cluster.add_worker("w0")
        stub = cluster.router()
        asked = router_pb2.RouterGenerateRequest(prompt="a kite", request_id="r1")
        asked.width, asked.height = 64, 64
        code, details = code_of(stub.Generate, asked)
        assert code is grpc.StatusCode.INTERNAL
        assert details == "worker w0: returned 32x48, not the 64x64 image asked for; refused"
        asked.request_id, asked.width, asked.height = "r2", 32, 48
        assert stub.Generate(asked, timeout=TIMEOUT).png == tiny_png(32, 48)
    finally:
        cluster.close()


# -- certificates and the issue-cert command -----------------------------------------------


def test_issue_cert_makes_a_ca_once_and_certificates_that_load_only_for_their_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "ca"
    assert main(["issue-cert", "--new-ca", "--ca-dir", str(ca)]) == 0
    assert os.stat(ca / "ca.key").st_mode & 0o077 == 0
    assert main(["issue-cert", "--new-ca", "--ca-dir", str(ca)]) == 2  # never replaced
    assert "already holds a CA key" in capsys.readouterr().err
    out = tmp_path / "w"
    issue = ["issue-cert", "--ca-dir", str(ca), "--out", str(out), "--identity"]
    assert main([*issue, "worker/w-1"]) == 0
    assert InternalTLS.load(out, "worker").identity == Identity("worker", "w-1")
    with pytest.raises(OSError, match=r"router\.crt: cannot read"):
        InternalTLS.load(out, "router")
    (out / "router.crt").write_bytes((out / "worker.crt").read_bytes())
    with pytest.raises(OSError, match="identity worker/w-1, expected role router"):
        InternalTLS.load(out, "router")
    for bad, message in (
        ("worker/../etc", "name: expected letters"),
        ("wizard/w-1", "role: expected one of"),
        ("worker", "identity: expected ROLE/NAME"),
    ):
        assert main([*issue, bad]) == 2
        assert message in capsys.readouterr().err


def test_a_dead_workers_id_stays_with_its_identity_within_a_bound() -> None:
    members = Membership(timeout_s=3.0, max_workers=1)

    def beat(worker_id: str, owner: str, now: float) -> None:
        members.heartbeat(WorkerReport(worker_id, "127.0.0.1:7001", CLASS), now, owner)

    beat("worker-1", "worker/worker-1", 0.0)
    assert members.expire(10.0) == ("worker-1",)  # dead: planned around, id still bound
    with pytest.raises(NotOwnerError, match="worker_id: 'worker-1'"):
        beat("worker-1", "worker/rogue", 11.0)
    # beyond 2 x max_workers bindings, those of the oldest ids no longer live are dropped
    for i, now in ((2, 20.0), (3, 30.0)):
        beat(f"worker-{i}", f"worker/worker-{i}", now)
        members.expire(now + 5.0)
    beat("worker-1", "worker/rogue", 40.0)  # worker-1's binding was the oldest: gone
    assert members.get("worker-1") is not None
