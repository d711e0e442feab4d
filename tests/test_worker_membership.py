"""Workers join the allocator and follow its plan (argus.worker.membership), against an
in-process allocator service on loopback with a fake clock (nothing ticks it but the tests).

Intervals come from the allocator's replies and the membership config, kept short; tests wait
for conditions with a generous deadline and never assert on elapsed time.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from argus.allocator.control import ControlConfig
from argus.allocator.service import AllocatorServicer, create_server
from argus.cli.main import main
from argus.contracts.generate import GenerateCall
from argus.contracts.workers import HeartbeatAnswer, WorkerReport
from argus.plumbing import rpc
from argus.plumbing.grpc_server import check_address
from argus.profiles import default_profiles
from argus.types import Strategy
from argus.worker.approx_cache.cache import (
    ApproximateCache,
    CacheStats,
    EdgeVectorIndex,
    LatentStore,
)
from argus.worker.engine import Worker
from argus.worker.membership import (
    MAX_SAMPLES,
    HeartbeatChannel,
    Membership,
    MembershipConfig,
    State,
    plan_change,
    retrieval_since,
)
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration


allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")

PROFILES = default_profiles()
AC_LEVELS = [lv.name for lv in PROFILES.levels_for(Strategy.AC)]
DEADLINE_S = 30.0  # how long a condition may take before the test fails instead of hanging
FAST = MembershipConfig(min_backoff_s=0.02, max_backoff_s=0.1, rpc_timeout_s=5.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Allocator:
    servicer: AllocatorServicer
    stub: Any
    address: str

    def plan(self) -> Any:
        return self.stub.GetPlan(allocator_pb2.GetPlanRequest(), timeout=10)

    def members(self) -> dict[str, Any]:
        return {w.worker_id: w for w in self.plan().workers}


@pytest.fixture
def allocator() -> Iterator[Callable[..., Allocator]]:
    """``allocator(address=...)`` serves one on loopback (heartbeats every 50 ms)."""
    started: list[tuple[grpc.Server, AllocatorServicer, grpc.Channel]] = []

    def start(address: str = "127.0.0.1:0") -> Allocator:
        server, port, servicer = create_server(
            PROFILES,
            address,
            config=ControlConfig(period_s=60.0, heartbeat_s=0.05),
            clock=FakeClock(),
            max_watchers=2,
            epoch="test-epoch",
        )
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, servicer, channel))
        stub = allocator_pb2_grpc.AllocatorStub(channel)
        return Allocator(servicer, stub, f"127.0.0.1:{port}")

    yield start
    for server, servicer, channel in started:
        servicer.close()
        channel.close()
        server.stop(grace=None)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = make_worker(worker_id="w7", warm=True)
    yield w
    w.close()


class RecordingClient(HeartbeatChannel):
    """The real channel, keeping every report it sent."""

    def __init__(self, address: str) -> None:
        super().__init__(address, max_reconnect_s=FAST.max_backoff_s)
        self.reports: list[WorkerReport] = []

    def heartbeat(self, report: WorkerReport) -> HeartbeatAnswer:
        self.reports.append(report)
        return super().heartbeat(report)


@pytest.fixture
def join() -> Iterator[Callable[..., Membership]]:
    """``join(worker, address, **kwargs)`` builds a Membership; every one is stopped at the end."""
    made: list[Membership] = []

    def build(worker: Worker, address: str, **kwargs: Any) -> Membership:
        kwargs.setdefault("config", FAST)
        kwargs.setdefault("advertise", "10.0.0.7:50053")
        kwargs.setdefault("worker_class", "a100")
        membership = Membership(worker, RecordingClient(address), **kwargs)
        made.append(membership)
        return membership

    yield build
    for membership in made:
        membership.stop()


def wait_until(condition: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(int(DEADLINE_S / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met in time")


@contextlib.contextmanager
def reserved_port() -> Iterator[socket.socket]:
    """A socket bound to a loopback port nothing listens on, held for the block so that no
    other process on a busy machine can take the port in between (a plain free port is free
    only until closed). Connecting to it is refused; close it to let a server bind the port
    (Argus servers do not share ports)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


# -- against the allocator service -----------------------------------------------------------


def test_a_worker_joins_and_appears_in_the_plan(
    allocator: Callable[..., Allocator], join: Callable[..., Membership], worker: Worker
) -> None:
    alloc = allocator()
    membership = join(worker, alloc.address)
    answer = membership.beat_once()
    assert answer is not None
    assert answer.assigned_level in AC_LEVELS  # a join re-plans at once
    assert answer.epoch == "test-epoch"
    member = alloc.members()["w7"]
    assert (member.address, member.worker_class) == ("10.0.0.7:50053", "a100")
    assert isinstance(membership.client, RecordingClient)
    report = membership.client.reports[-1]
    assert report.level == worker.level.name
    assert report.strategy is worker.strategy
    assert report.model == worker.registry.active_name
    assert report.model in report.loaded_models
    stats = membership.stats()
    assert (stats.state, stats.beats, stats.plan_version) == (State.MEMBER, 1, answer.plan_version)


def test_a_loaded_worker_joins_the_plan_only_after_its_warm_up(
    allocator: Callable[..., Allocator], join: Callable[..., Membership]
) -> None:
    cold = make_worker(worker_id="w-cold")  # the model is loaded, the pipeline never ran
    try:
        alloc = allocator()
        membership = join(cold, alloc.address)
        assert membership.beat_once() is None  # no heartbeat sent: not in the plan
        assert isinstance(membership.client, RecordingClient)
        assert membership.client.reports == []
        assert "w-cold" not in alloc.members()
        assert membership.stats().state is State.WAITING
        cold.warm_up()
        assert membership.beat_once() is not None
        assert "w-cold" in alloc.members()
    finally:
        cold.close()


def test_the_assigned_level_is_applied_through_configure(
    allocator: Callable[..., Allocator], join: Callable[..., Membership], worker: Worker
) -> None:
    alloc = allocator()
    first = join(worker, alloc.address).beat_once()
    assert first is not None
    assigned = first.assigned_level
    other = next(name for name in AC_LEVELS if name != assigned)
    worker.configure(level=other, wait=True)  # the worker drifts away from the plan
    membership = join(worker, alloc.address)
    membership.start()  # the loop's next heartbeat brings it back
    wait_until(lambda: worker.level.name == assigned)
    assert worker.strategy is first.strategy
    client = membership.client
    assert isinstance(client, RecordingClient)
    wait_until(lambda: client.reports[-1].level == assigned)  # and says so in its heartbeats


def test_stopping_sends_leaving_and_the_allocator_drops_the_worker_at_once(
    allocator: Callable[..., Allocator], join: Callable[..., Membership], worker: Worker
) -> None:
    alloc = allocator()
    membership = join(worker, alloc.address)
    membership.start()
    wait_until(lambda: "w7" in alloc.members())
    membership.stop()
    update = alloc.plan()  # no tick ran: the leave itself re-planned
    assert "w7" not in {w.worker_id for w in update.workers}
    assert update.reason == allocator_pb2.PLAN_REASON_WORKER_LEFT
    assert membership.stats().state is State.STOPPED
    membership.stop()  # idempotent


def test_an_unreachable_allocator_is_retried_while_the_worker_serves(
    allocator: Callable[..., Allocator],
    join: Callable[..., Membership],
    worker: Worker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with reserved_port() as held, caplog.at_level(logging.INFO, logger="argus.worker.membership"):
        address = f"127.0.0.1:{held.getsockname()[1]}"  # nothing listens here yet
        membership = join(worker, address)
        membership.start()
        wait_until(lambda: membership.stats().failures >= 3)
        assert membership.stats().state is State.UNREACHABLE
        result = worker.generate(GenerateCall(prompt="a lighthouse", level=worker.level.name))
        assert result.png  # the worker keeps serving
        held.close()
        alloc = allocator(address)  # the allocator comes up: the next retry joins
        wait_until(lambda: "w7" in alloc.members())
        # the allocator lists the worker as it answers the join; the worker logs on the answer
        wait_until(lambda: any("joined the allocator" in r.getMessage() for r in caplog.records))
    messages = [r.getMessage() for r in caplog.records]
    joined = [i for i, m in enumerate(messages) if "joined the allocator" in m]
    assert joined
    # up to the join: three or more failed attempts, one state change, one line. After it, a
    # heartbeat timing out on a loaded machine is a new state change with a line of its own.
    assert sum("unreachable" in m for m in messages[: joined[0]]) == 1


def test_stop_is_prompt_and_quiet_when_the_allocator_is_gone(
    join: Callable[..., Membership], worker: Worker
) -> None:
    with reserved_port() as held:
        address = f"127.0.0.1:{held.getsockname()[1]}"
        membership = join(worker, address, config=replace(FAST, rpc_timeout_s=0.5))
        membership.start()
        wait_until(lambda: membership.stats().failures >= 1)
        membership.stop()  # the leaving heartbeat fails: logged, not raised
    assert membership.stats().state is State.STOPPED


# -- decisions, with a scripted allocator ----------------------------------------------------


class ScriptedClient:
    """Answers every heartbeat with ``answer`` and keeps the reports."""

    def __init__(self, answer: HeartbeatAnswer) -> None:
        self.answer = answer
        self.reports: list[WorkerReport] = []
        self.timeout_s = 0.0

    def heartbeat(self, report: WorkerReport) -> HeartbeatAnswer:
        self.reports.append(report)
        return self.answer

    def close(self) -> None:
        pass


def answer(**fields: Any) -> HeartbeatAnswer:
    base = HeartbeatAnswer(
        plan_version=3,
        strategy=Strategy.AC,
        assigned_level="",
        probe_retrieval=False,
        probe_interval_s=10.0,
        heartbeat_interval_s=1.0,
        epoch="e",
    )
    return replace(base, **fields)


@pytest.fixture
def cached_worker(tmp_path: Path) -> Iterator[Worker]:
    index = EdgeVectorIndex(tmp_path / "edge", 8, optimize_after=None)
    store = LatentStore(tmp_path / "latents", fsync=False)
    cache = ApproximateCache(
        index, store, max_entries=10, max_bytes=None, registry=CollectorRegistry()
    )
    w = make_worker(cache=cache, worker_id="w8", warm=True)
    yield w
    w.close()


def test_probes_run_while_asked_and_are_reported_as_samples(cached_worker: Worker) -> None:
    client = ScriptedClient(answer(probe_retrieval=True))
    membership = Membership(
        cached_worker, client, advertise="h:1", worker_class="a100", config=FAST
    )
    membership.beat_once()
    assert membership.stats().probing
    latency = membership.probe_once()
    assert latency is not None and latency >= 0.0
    membership.beat_once()
    assert client.reports[-1].retrieval.samples_s == (latency,)
    membership.beat_once()  # reported once: the next heartbeat starts afresh
    assert client.reports[-1].retrieval.samples_s == ()
    cached_worker.cache.index.close()  # the vector database goes away
    assert membership.probe_once() is None
    membership.beat_once()
    assert client.reports[-1].retrieval.failures == 1
    assert membership.stats().probes == 2


def test_the_loop_probes_on_its_own_and_stops_when_the_allocator_says_so(
    cached_worker: Worker,
) -> None:
    client = ScriptedClient(answer(probe_retrieval=True, probe_interval_s=0.01))
    client.answer = replace(client.answer, heartbeat_interval_s=0.02)
    membership = Membership(
        cached_worker, client, advertise="h:1", worker_class="a100", config=FAST
    )
    membership.start()
    try:
        wait_until(lambda: any(r.retrieval.samples_s for r in client.reports))
        client.answer = replace(client.answer, probe_retrieval=False)
        wait_until(lambda: not membership.stats().probing)
        probes, beats = membership.stats().probes, len(client.reports)
        wait_until(lambda: len(client.reports) >= beats + 3)
    finally:
        membership.stop()
    assert membership.stats().probes <= probes + 1  # at most one was already under way
    assert client.reports[-1].leaving  # and the last word is the leave


def test_a_refused_level_is_logged_once_and_the_worker_keeps_its_level(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    before = worker.level.name
    # an SM level with the AC strategy: configure refuses it
    client = ScriptedClient(answer(assigned_level="sm-sd-1.5", strategy=Strategy.AC))
    membership = Membership(worker, client, advertise="h:1", worker_class="a100", config=FAST)
    with caplog.at_level(logging.ERROR, logger="argus.worker.membership"):
        for _ in range(3):
            membership.beat_once()
    assert worker.level.name == before
    assert sum("cannot serve assigned level" in r.getMessage() for r in caplog.records) == 1


def test_plan_change_only_when_the_plan_differs() -> None:
    assert plan_change(answer(assigned_level=""), "ac-k5", Strategy.AC) is None
    assert plan_change(answer(assigned_level="ac-k5"), "ac-k5", Strategy.AC) is None
    assert plan_change(answer(assigned_level="ac-k10"), "ac-k5", Strategy.AC) == (
        Strategy.AC,
        "ac-k10",
    )


def stats(hits: int, errors: int, other: int = 0, p50: float = 0.001) -> CacheStats:
    misses = {"empty": 0, "no-match": other, "index-error": errors}
    return CacheStats(0, 0, hits, misses, 0, 0, p50, 2 * p50, p50, 2 * p50, 100)


def test_retrieval_since_summarises_lookups_and_merges_probes() -> None:
    report = retrieval_since(stats(10, 1), stats(110, 3, other=5))
    assert (report.count, report.failures) == (105, 2)  # 100 hits + 5 misses
    assert report.p50_s == pytest.approx(0.002)
    assert report.p99_s == pytest.approx(0.004)
    assert retrieval_since(stats(5, 0), stats(5, 0)).p99_s == 0.0  # no lookups: no figures
    assert retrieval_since(None, None).count == 0  # no cache
    merged = retrieval_since(stats(0, 0), stats(200, 0), probes=[0.5, None])
    assert merged.samples_s[0] == 0.5
    assert len(merged.samples_s) == 201
    assert merged.failures == 1
    many = retrieval_since(stats(0, 0), stats(10_000, 0), probes=[0.5])
    assert len(many.samples_s) == MAX_SAMPLES


# -- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allocator", "nope"], "--allocator: expected HOST:PORT with a port in 1..65535"),
        (["--allocator", "alloc:0"], "--allocator: expected HOST:PORT"),
        (["--allocator", ":50052"], "--allocator: expected HOST:PORT"),
        (["--advertise", "10.0.0.1:99999"], "--advertise: expected HOST:PORT"),
        (["--worker-class", "tpu"], "worker_class: 'tpu' is not a worker class of the profile"),
    ],
)
def test_argus_worker_rejects_bad_cluster_flags(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["worker", *args, "--insecure-internal"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("WARNING: ")]
    assert len(lines) == 1 and message in lines[0]  # one line, beside the insecure warning


def test_check_address_accepts_hosts_and_ipv6() -> None:
    assert check_address("argus-allocator:50052", "x") == "argus-allocator:50052"
    assert check_address("[::1]:50052", "x") == "[::1]:50052"
    with pytest.raises(ValueError, match="x: expected HOST:PORT without spaces"):
        check_address("a b:1", "x")


def test_the_last_loads_parts_and_the_resident_parts_reach_the_allocator(
    allocator: Callable[..., Allocator],
    join: Callable[..., Membership],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A switch within the SD-1.x family loads only the UNet; the heartbeat carries that part
    and its seconds, and the parts resident, through the proto to the allocator's control."""
    shared = make_worker(worker_id="w-parts", level="sm-sd-1.5", warm=True)
    try:
        shared.registry.activate("sd-1.4").result(timeout=60)
        alloc = allocator()
        control = alloc.servicer.control
        received: list[WorkerReport] = []
        heartbeat = control.heartbeat

        def receive(report: WorkerReport, owner: str = "") -> HeartbeatAnswer:
            received.append(report)
            return heartbeat(report, owner)

        monkeypatch.setattr(control, "heartbeat", receive)
        membership = join(shared, alloc.address)
        assert membership.beat_once() is not None
        kept = received[-1]
        assert kept.worker_id == "w-parts"
        assert kept.last_load_model == "sd-1.4"
        assert [part for part, _ in kept.last_load_parts] == ["unet"]
        assert all(s > 0.0 for _, s in kept.last_load_parts)
        resident = {(c.part, c.models) for c in kept.resident_parts}
        assert ("unet", ("sd-1.4",)) in resident
        assert ("vae", ("sd-1.4",)) in resident  # the VAE sd-1.5 loaded, now sd-1.4's
        assert set(kept.resident_parts) == set(shared.registry.components())
    finally:
        shared.close()
