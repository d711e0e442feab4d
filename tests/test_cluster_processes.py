"""The cluster as real processes (``argus.tools.local_cluster``): the public API under garbage and
wrong credentials, ``argus client``, ``argus up --classifier`` reaching the router and the
allocator alike, a worker killed under load, and a vector database outage that sends the
cluster to SM and back.

Each test starts allocator, workers and router as ``python -m argus`` processes with tiny
models on the CPU; they take tens of seconds, not minutes.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from argus.classifier.serving import classifier_key, default_classifier_dir
from argus.cli.main import main as argus_main
from argus.contracts.allocator_client import AllocatorClient
from argus.plumbing import rpc
from argus.profiles import default_profiles
from argus.tools.client import Connection, RequestFailed, RouterClient
from argus.tools.local_cluster import ClusterSpec, LocalCluster
from argus.types import Strategy
from tests.service_process import self_signed_certificate

pytestmark = pytest.mark.e2e


router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
common_pb2: Any = rpc.load("common_pb2")
TOKEN = "cluster-token"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- the public API of a secured cluster ---------------------------------------------------


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("secure")
    cert, key = self_signed_certificate(workdir)
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    spec = ClusterSpec(
        workdir=workdir,
        workers=1,
        controlnet=False,
        metrics=False,
        default_steps=4,
        auth_token_file=str(token_file),
        tls_cert=cert,
        tls_key=key,
    )
    with LocalCluster(spec) as cluster:
        yield cluster


def call(cluster: LocalCluster, request: Any, metadata: Any = None, raw: bool = False) -> Any:
    metadata = (("authorization", f"Bearer {TOKEN}"),) if metadata is None else metadata
    with cluster.channel() as channel:
        if raw:
            method = channel.unary_unary("/argus.v1.Router/Generate")
            return method(request, timeout=60, metadata=metadata)
        return router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60, metadata=metadata)


def code_of(cluster: LocalCluster, request: Any, **options: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(cluster, request, **options)
    return err.value.code(), err.value.details() or ""


BAD_REQUESTS = [
    ({"prompt": "x" * (1 << 20)}, "prompt"),
    ({"width": 0}, "width"),
    ({"width": 63}, "width"),
    ({"height": 100_000}, "height"),
    ({"steps": 0}, "steps"),
    ({"guidance_scale": float("nan")}, "guidance_scale"),
    ({"request_id": "r" * 500}, "request_id"),
]


def test_garbage_and_wrong_credentials_get_the_right_status(secure: LocalCluster) -> None:
    for fields, field in BAD_REQUESTS:
        request = router_pb2.RouterGenerateRequest(**({"prompt": "a cat"} | fields))
        code, details = code_of(secure, request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (fields.keys(), code)
        assert details.startswith(field), details
    unknown = router_pb2.RouterGenerateRequest(prompt="a cat")
    unknown.adapters.add(kind=common_pb2.Adapter.LORA, name="no-such-lora")
    code, details = code_of(secure, unknown)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "adapters" in details
    code, details = code_of(secure, b"\xff\x00garbage", raw=True)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request")
    plain = router_pb2.RouterGenerateRequest(prompt="a cat")
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        code, _ = code_of(secure, plain, metadata=metadata)
        assert code is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(secure.router) as channel:  # plaintext to a TLS port
        with pytest.raises(grpc.RpcError) as err:
            router_pb2_grpc.RouterStub(channel).Generate(plain, timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    # an empty prompt is refused naming it; and the router still serves
    code, details = code_of(secure, router_pb2.RouterGenerateRequest(prompt=""))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt")
    assert call(secure, plain).png.startswith(PNG_MAGIC)
    assert all(part.alive() for part in secure.parts.values())


def thread_nices(pid: int) -> set[int]:
    """The nice value of each of a process's threads (Linux keeps one per thread)."""
    nices = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        fields = stat.read_text().rpartition(")")[2].split()
        nices.add(int(fields[16]))  # field 19 of proc(5), counted after the command name
    return nices


def test_compute_processes_run_every_thread_below_the_control_plane(secure: LocalCluster) -> None:
    """The workers and the ControlNet service take ``compute_nice`` before any thread starts
    (torch's and gRPC's threads inherit it), so on shared cores the router's admission and
    refusals are not queued behind denoising; the router and the allocator keep ours."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, ours + secure.spec.compute_nice)
    assert secure.spec.compute_nice > 0
    compute = [n for n in secure.parts if n.startswith("worker") or n == "controlnet"]
    assert compute and len(compute) < len(secure.parts)
    for name, part in secure.parts.items():
        expected = lowered if name in compute else ours
        assert thread_nices(part.process.pid) == {expected}, name


def test_client_command_saves_images(secure: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "images"
    token_file = secure.spec.auth_token_file
    assert token_file is not None and secure.spec.tls_cert is not None
    args = ["client", "--router", secure.router, "--prompt", "a red fox", "--prompt", "a boat"]
    args += ["--auth-token-file", token_file, "--tls-ca", secure.spec.tls_cert]
    assert argus_main([*args, "--out", str(out), "--count", "3"]) == 0
    images = sorted(out.glob("*.png"))
    assert len(images) == 3 and all(p.read_bytes().startswith(PNG_MAGIC) for p in images)
    wrong = tmp_path / "wrong-token"
    wrong.write_text("nope")
    args[args.index(token_file)] = str(wrong)
    assert argus_main([*args, "--out", str(tmp_path / "none")]) == 1  # UNAUTHENTICATED lines


# -- one classifier for the router and the allocator -----------------------------------------


def test_up_gives_the_router_and_the_allocator_the_same_classifier(tmp_path: Path) -> None:
    classifier = shutil.copytree(default_classifier_dir(), tmp_path / "classifier")
    (classifier / "sm" / "calibration.json").unlink()  # SM: classified and planned by level
    workdir = tmp_path / "up"
    args = ["up", "--workers", "1", "--no-controlnet", "--no-metrics", "--steps", "4"]
    args += ["--port", "0", "--workdir", str(workdir), "--exit-after-demo"]
    assert argus_main([*args, "--classifier", str(classifier)]) == 0
    allocator = (workdir / "logs" / "allocator.log").read_text()
    router = (workdir / "logs" / "router.log").read_text()
    where = f"classifier {classifier_key(classifier)} ({classifier})"
    assert f"{where}: AC planned with the Q(v | c) of its calibrated classes" in allocator
    assert f"{where}: the SM artifact has no calibration.json" in allocator
    assert where in router


def test_up_demo_runs_once_every_worker_is_ready_and_saves_every_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo-out"
    args = ["up", "--workers", "1", "--no-controlnet", "--no-metrics", "--steps", "4"]
    args += ["--port", "0", "--workdir", str(tmp_path / "up"), "--out", str(out)]
    assert argus_main([*args, "--demo", "3", "--exit-after-demo"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.png")) == ["0000.png", "0001.png", "0002.png"]
    lines = printed.splitlines()
    order = [
        next(i for i, line in enumerate(lines) if line.startswith(prefix))
        for prefix in (
            "argus up: allocator ready (",
            "argus up: worker-0 ready (",
            "argus up: router ready (",
            "argus up: cluster ready (",
            "argus up: demo:",
        )
    ]
    assert order == sorted(order)
    assert "router 0" in lines[-1] and "worker-0 0" in lines[-1]  # stopped, none killed


# -- faults under load ---------------------------------------------------------------------


class Load:
    """Closed-loop clients sending requests until stopped; every outcome is kept."""

    def __init__(self, connection: Connection, clients: int, **options: Any) -> None:
        self.client = RouterClient(connection)
        self.options = options
        self.outcomes: list[tuple[float, str, str]] = []  # (finished at, code, worker)
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        self._runs = [self._pool.submit(self._run, i) for i in range(clients)]

    def _run(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            with self._lock:
                self.sent += 1
            prompt = f"a lighthouse at dusk, study {i % 4}"  # repeats: the cache has hits
            try:
                reply = self.client.generate(prompt, seed=index * 1000 + i, **self.options)
                outcome = ("OK", reply.worker_id)
            except RequestFailed as err:
                outcome = (err.code.name, "")
            with self._lock:
                self.outcomes.append((time.monotonic(), *outcome))

    def served(self) -> int:
        with self._lock:
            return sum(code == "OK" for _, code, _ in self.outcomes)

    def wait_served(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.served() < count:
            assert time.monotonic() < deadline, f"only {self.served()} served: {self.codes()}"
            time.sleep(0.1)

    def codes(self) -> Counter[str]:
        with self._lock:
            return Counter(code for _, code, _ in self.outcomes)

    def stop(self) -> None:
        self._stop.set()
        for run in self._runs:
            run.result(timeout=120)  # every request ended: an image or an explicit status
        self._pool.shutdown()
        self.client.close()


def wait_plan(cluster: LocalCluster, predicate: Any, timeout_s: float) -> Any:
    client = AllocatorClient(cluster.allocator, tls=cluster.internal_tls())
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            plan = client.get_plan()
            if predicate(plan):
                return plan
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError("the plan never changed as expected")


def test_killed_worker_is_planned_around_and_requests_end(tmp_path: Path) -> None:
    spec = ClusterSpec(
        workdir=tmp_path, workers=2, controlnet=False, metrics=False, heartbeat_s=0.5
    )
    with LocalCluster(spec) as cluster:
        load = Load(Connection(cluster.router), clients=3, steps=4, deadline_ms=60_000)
        try:
            load.wait_served(4, timeout_s=120)
            cluster.kill("worker-1")
            killed_at = time.monotonic()
            plan = wait_plan(
                cluster, lambda p: "worker-1" not in {w.worker_id for w in p.workers}, 60
            )
            dropped_after_s = time.monotonic() - killed_at
            time.sleep(1.0)  # requests routed before the plan reached the router may still end
            after = load.served()
            load.wait_served(after + 6, timeout_s=120)
        finally:
            load.stop()
        assert [w.worker_id for w in plan.workers] == ["worker-0"]
        assert "(worker_dead): worker worker-1" in cluster.parts["allocator"].log_tail(400)
        codes = load.codes()
        assert sum(codes.values()) == load.sent  # every request sent ended, one way or another
        assert set(codes) <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
        # after the drop only the live worker serves; failures (a deadline missed on a loaded
        # machine) name no worker and say nothing about routing
        late = {
            w
            for t, code, w in load.outcomes
            if code == "OK" and t > killed_at + dropped_after_s + 1
        }
        assert late == {"worker-0"}
        print(f"worker dropped from the plan {dropped_after_s:.2f} s after SIGKILL; {codes}")


def outage_profile(path: Path) -> str:
    """The default levels with CPU-sized numbers: K = 0 slow enough that a few requests a
    second push the plan to cached levels (which look up the index), SM levels worse than AC
    so that the allocator chooses AC while retrieval is healthy."""
    profiles = default_profiles()
    latency = {"ac-k0": 8.0, "ac-k5": 1.0, "ac-k10": 0.9, "ac-k15": 0.8, "ac-k20": 0.7}
    lines = ['worker_classes = ["a100"]']
    for level in profiles.levels:
        quality = level.quality if level.strategy is Strategy.AC else level.quality * 0.5
        seconds = latency.get(level.name, 0.6)
        lines += [
            "[[levels]]",
            f'name = "{level.name}"',
            f'strategy = "{level.strategy.value}"',
            f'model = "{level.model}"',
            f"skip_steps = {level.skip_steps}",
            f"quality = {quality}",
            f"profiles.a100 = {{ latency_s = {seconds}, load_time_s = 1.0, gpu_memory_gib = 1.0 }}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_vector_database_outage_switches_to_sm_and_back_without_failures(
    tmp_path: Path,
) -> None:
    outage = tmp_path / "index-down"
    spec = ClusterSpec(
        workdir=tmp_path,
        workers=2,
        controlnet=False,
        metrics=False,
        heartbeat_s=0.5,
        period_s=5.0,
        retrieval_window_s=3.0,
        index_outage_file=str(outage),
        profile=outage_profile(tmp_path / "profile.toml"),
        # the paper's switch (§4.6): AC while retrieval is healthy, SM while it is not. Under
        # ``best`` the classifier's calibrated Q(v | c), not this profile's halved SM quality,
        # prices SM, and may rightly keep SM after recovery
        allocator_args=("--strategy-choice", "ac-first"),
    )
    with LocalCluster(spec) as cluster:
        load = Load(Connection(cluster.router), clients=3, deadline_ms=120_000)
        try:
            wait_plan(
                cluster,
                lambda p: (
                    p.plan.strategy is Strategy.AC and any(w.level != "ac-k0" for w in p.workers)
                ),
                180,
            )
            load.wait_served(load.served() + 4, timeout_s=120)
            outage.touch()  # the vector database goes away
            down = wait_plan(cluster, lambda p: p.plan.strategy is Strategy.SM, 120)
            assert not down.retrieval_healthy
            load.wait_served(load.served() + 4, timeout_s=120)
            outage.unlink()  # and comes back
            up = wait_plan(cluster, lambda p: p.plan.strategy is Strategy.AC, 180)
            assert up.retrieval_healthy
            load.wait_served(load.served() + 4, timeout_s=120)
        finally:
            load.stop()
        codes = load.codes()
        assert codes == Counter({"OK": load.sent}), codes  # zero failed requests
