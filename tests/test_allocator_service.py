"""The allocator's gRPC service: membership, plans and their watchers, router statistics,
AC↔SM switching, status codes for bad input, metrics, and the ``argus allocator`` process.

In-process tests drive the control with a fake clock and call ``tick`` themselves (no loop
thread), so nothing depends on how fast this machine is; the process test runs the real loop.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.allocator.feed import FeedClosedError, FeedFullError, LatestFeed
from argus.allocator.metrics import AllocatorMetrics
from argus.allocator.planner import PlannerMode
from argus.allocator.service import AllocatorServicer, create_server
from argus.classifier.serving import (
    classifier_key,
    default_classifier_dir,
    read_planning_classes,
)
from argus.cli.main import main
from argus.contracts.allocator_client import AllocatorClient, PlanWatcher
from argus.contracts.plans import ReplanReason, plan_from_pb, plan_to_pb
from argus.contracts.routers import RouterReport, class_quality_to_pb
from argus.contracts.workers import RetrievalReport, WorkerReport
from argus.plumbing import rpc
from argus.profiles import default_profiles
from argus.types import ClassQuality, Plan, Strategy
from tests.service_process import read_address, start_argus
from tests.tls_factories import TestCA

pytestmark = pytest.mark.integration


allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")

PROFILES = default_profiles()
AC_LEVELS = [lv.name for lv in PROFILES.levels_for(Strategy.AC)]
SM_LEVELS = [lv.name for lv in PROFILES.levels_for(Strategy.SM)]
AC, SM = 1, 2  # argus.v1.Strategy
TIMEOUT = 10  # seconds any single RPC may take before a test fails instead of hanging


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Allocator:
    """A served allocator with a fake clock; ``tick`` runs what the loop thread would."""

    clock: FakeClock
    servicer: AllocatorServicer
    stub: Any
    channel: grpc.Channel
    registry: CollectorRegistry
    address: str

    def tick(self) -> Any:
        return self.servicer.control.tick()

    def beat(self, worker_id: str, **fields: Any) -> Any:
        fields.setdefault("address", f"127.0.0.1:{5000 + int(worker_id.lstrip('w'))}")
        request = allocator_pb2.WorkerHeartbeat(worker_id=worker_id, **fields)
        return self.stub.Heartbeat(request, timeout=TIMEOUT)

    def plan(self) -> Any:
        return self.stub.GetPlan(allocator_pb2.GetPlanRequest(), timeout=TIMEOUT)

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(config, max_watchers=..., **create_server_options)`` starts an allocator; all
    stop at teardown."""
    started: list[tuple[grpc.Server, AllocatorServicer, grpc.Channel]] = []

    def start(
        config: ControlConfig | None = None, max_watchers: int = 4, **options: Any
    ) -> Allocator:
        clock = FakeClock()
        registry = CollectorRegistry()
        server, port, servicer = create_server(
            PROFILES,
            "127.0.0.1:0",
            config=config or ControlConfig(period_s=60.0, heartbeat_s=1.0),
            clock=clock,
            max_watchers=max_watchers,
            metrics=AllocatorMetrics(PROFILES, registry),
            epoch="test-epoch",
            **options,
        )
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, servicer, channel))
        stub = allocator_pb2_grpc.AllocatorStub(channel)
        return Allocator(clock, servicer, stub, channel, registry, f"127.0.0.1:{port}")

    yield start
    for server, servicer, channel in started:
        servicer.close()
        channel.close()
        server.stop(grace=None)


def levels_of(update: Any) -> dict[str, str]:
    return {w.worker_id: w.level for w in update.workers}


# -- membership and plans ------------------------------------------------------------------


def test_workers_join_and_the_plan_assigns_them_levels(serve: Any) -> None:
    alloc = serve()
    assert alloc.plan().version == 1  # the startup plan exists before any worker
    assert alloc.plan().reason == allocator_pb2.PLAN_REASON_STARTUP
    for i in range(3):
        reply = alloc.beat(f"w{i}", worker_class="a100", queue_length=0)
        # a join re-plans at once: the first reply already carries the worker's level
        assert reply.plan_version == 2 + i
        assert reply.assigned_level in AC_LEVELS
        assert reply.strategy == AC
        assert reply.heartbeat_interval_s == 1.0
        assert reply.epoch == "test-epoch"
        assert not reply.probe_retrieval
    update = alloc.plan()
    assert update.reason == allocator_pb2.PLAN_REASON_WORKER_JOINED
    assert update.reason_detail == "worker w2 joined at 127.0.0.1:5002"
    assert [(w.worker_id, w.address) for w in update.workers] == [
        ("w0", "127.0.0.1:5000"),
        ("w1", "127.0.0.1:5001"),
        ("w2", "127.0.0.1:5002"),
    ]
    assert [lv.name for lv in update.levels] == AC_LEVELS
    assert sum(lv.workers for lv in update.levels) == 3
    for level in update.levels:  # every PASM row is a distribution over the levels
        assert len(level.pasm_row) == len(AC_LEVELS)
        assert math.isclose(sum(level.pasm_row), 1.0)
    # a heartbeat that changes nothing does not re-plan
    assert alloc.beat("w1", worker_class="a100", queue_length=1).plan_version == 4
    # the router's view of the update is exactly what the allocator published
    published = plan_from_pb(update)
    assert published == alloc.servicer.control.current
    assert published.worker_classes() == {"w0": "a100", "w1": "a100", "w2": "a100"}
    assert plan_from_pb(plan_to_pb(published)) == published
    assert alloc.metric("argus_allocator_plans_total", reason="worker_joined") == 3
    assert alloc.metric("argus_allocator_workers_alive") == 3


def test_a_watcher_gets_the_current_plan_at_once_then_each_update(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=100.0))
    alloc.beat("w0")
    stream = alloc.stub.WatchPlan(allocator_pb2.WatchPlanRequest(watcher_id="r0"), timeout=30)
    try:
        first = next(stream)
        assert first.version == 2
        assert first.epoch == "test-epoch"
        assert set(levels_of(first)) == {"w0"}
        assert alloc.metric("argus_allocator_plan_watchers") == 1
        alloc.beat("w1")
        second = next(stream)
        assert second.version == 3
        assert second.reason == allocator_pb2.PLAN_REASON_WORKER_JOINED
        assert set(levels_of(second)) == {"w0", "w1"}
        alloc.clock.advance(60.0)
        assert alloc.tick().reason is ReplanReason.PERIODIC
        third = next(stream)
        assert (third.version, third.reason) == (4, allocator_pb2.PLAN_REASON_PERIODIC)
    finally:
        stream.cancel()


def test_a_slow_watcher_skips_to_the_latest_plan_in_constant_memory() -> None:
    feed: LatestFeed[int] = LatestFeed(max_readers=2)
    fast, slow = feed.reader(), feed.reader()
    with pytest.raises(FeedFullError):
        feed.reader()
    assert fast.next(0) is None  # nothing published yet
    for item in range(1, 101):
        feed.publish(item)
        assert fast.next(0) == item  # a fast reader sees every plan
    assert slow.next(0) == 100  # a slow one only the latest: nothing was queued for it
    assert slow.next(0) is None
    slow.close()
    assert feed.readers == 1
    feed.reader().close()  # the freed place can be taken again
    feed.close()
    with pytest.raises(FeedClosedError):
        fast.next(None)  # closing wakes a waiting reader


def test_watchers_beyond_the_limit_get_resource_exhausted(serve: Any) -> None:
    alloc = serve(max_watchers=2)
    request = allocator_pb2.WatchPlanRequest(watcher_id="r")
    streams = [alloc.stub.WatchPlan(request, timeout=30) for _ in range(2)]
    try:
        for stream in streams:
            assert next(stream).version == 1
        with pytest.raises(grpc.RpcError) as err:
            next(alloc.stub.WatchPlan(request, timeout=TIMEOUT))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert alloc.beat("w0").plan_version == 2  # heartbeats still find a thread
        assert all(next(stream).version == 2 for stream in streams)
    finally:
        for stream in streams:
            stream.cancel()


def test_a_silent_worker_is_dropped_after_three_heartbeat_intervals(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=1.0))
    alloc.beat("w0")
    alloc.beat("w1")
    for _ in range(3):  # w0 keeps beating, w1 has gone quiet
        alloc.clock.advance(1.0)
        alloc.beat("w0")
        assert alloc.tick() is None
    assert set(levels_of(alloc.plan())) == {"w0", "w1"}  # exactly 3 intervals: not yet
    alloc.clock.advance(0.25)
    published = alloc.tick()
    assert published is not None
    assert published.reason is ReplanReason.WORKER_DEAD
    assert published.detail == "worker w1 missed 3 heartbeats"
    update = alloc.plan()
    assert update.reason == allocator_pb2.PLAN_REASON_WORKER_DEAD
    assert set(levels_of(update)) == {"w0"}
    assert alloc.beat("w0").assigned_level == update.workers[0].level
    assert alloc.metric("argus_allocator_dead_workers_total") == 1
    # it comes back: a join like any other
    assert alloc.beat("w1").assigned_level != ""
    assert alloc.plan().reason == allocator_pb2.PLAN_REASON_WORKER_JOINED


def test_a_leaving_worker_is_dropped_at_once(serve: Any) -> None:
    alloc = serve()
    alloc.beat("w0")
    alloc.beat("w1")
    reply = alloc.stub.Heartbeat(
        allocator_pb2.WorkerHeartbeat(worker_id="w1", leaving=True), timeout=TIMEOUT
    )
    assert reply.assigned_level == ""
    update = alloc.plan()
    assert update.reason == allocator_pb2.PLAN_REASON_WORKER_LEFT
    assert set(levels_of(update)) == {"w0"}


def test_the_period_and_a_backlog_re_plan(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=100.0, min_replan_interval_s=10.0))
    alloc.beat("w0")
    alloc.beat("w1")
    alloc.clock.advance(59.0)
    assert alloc.tick() is None
    alloc.clock.advance(1.0)
    assert alloc.tick().reason is ReplanReason.PERIODIC
    alloc.beat("w0", queue_length=3)
    alloc.beat("w1", queue_length=2)  # 5 queued > 2 per worker, but a plan was just made
    alloc.clock.advance(9.0)
    assert alloc.tick() is None
    alloc.clock.advance(1.0)
    assert alloc.tick().reason is ReplanReason.BACKLOG
    # a router may ask too, at most once per min_replan_interval_s
    report = allocator_pb2.RouterReport(router_id="r0", replan_wanted=True)
    version = alloc.stub.ReportRouter(report, timeout=TIMEOUT).plan_version
    alloc.clock.advance(10.0)
    assert alloc.stub.ReportRouter(report, timeout=TIMEOUT).plan_version == version + 1
    assert alloc.plan().reason_detail == "router r0 sees queues building up"


def test_a_failed_solve_keeps_the_plan_and_is_retried_at_the_next_tick(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc = serve()
    allocator = alloc.servicer.control._allocator
    real = allocator.plan_best
    calls = []

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("solver crashed")
        return real(*args, **kwargs)

    monkeypatch.setattr(allocator, "plan_best", fail_once)
    reply = alloc.beat("w0")  # the join's plan fails: the heartbeat is still answered
    assert (reply.plan_version, reply.assigned_level) == (1, "")
    published = alloc.tick()
    assert published is not None and published.reason is ReplanReason.WORKER_JOINED
    assert published.detail == "worker w0 joined at 127.0.0.1:5000 (retried)"
    assert alloc.beat("w0").assigned_level in AC_LEVELS
    assert alloc.tick() is None


# -- router statistics -----------------------------------------------------------------------


def report(router_id: str, arrivals: int, span_s: float, levels: list[str], seq: int = 0) -> Any:
    """``arrivals`` spread evenly over the last ``span_s`` seconds, classified as ``levels``."""
    return allocator_pb2.RouterReport(
        router_id=router_id,
        sequence=seq,
        arrivals=arrivals,
        arrival_ages_s=[span_s * (i + 0.5) / arrivals for i in range(arrivals)],
        classified=[allocator_pb2.ClassifiedLevels(strategy=AC, levels=levels)],
    )


def check_pasm(update: Any) -> None:
    """H @ PASM == F / sum(F): the PASM reshapes the affinity into the load shares."""
    shares = [lv.load_share_qpm for lv in update.levels]
    total = sum(shares)
    for j, share in enumerate(shares):
        mixed = sum(lv.affinity * lv.pasm_row[j] for lv in update.levels)
        assert math.isclose(mixed, share / total, abs_tol=1e-6)


def test_router_reports_shift_the_histogram_and_the_pasm(serve: Any) -> None:
    # the paper's planner: ODA moves the PASM with H even without per-class quality
    alloc = serve(
        ControlConfig(period_s=60.0, heartbeat_s=1000.0, planner=PlannerMode.PAPER, queueing=False)
    )
    for i in range(4):
        alloc.beat(f"w{i}")
    alloc.clock.advance(59.0)  # 90 prompts in the first minute, all best served at K=0
    alloc.stub.ReportRouter(report("r0", 90, 59.0, ["ac-k0"] * 200, seq=1), timeout=TIMEOUT)
    alloc.clock.advance(1.0)
    assert alloc.tick().reason is ReplanReason.PERIODIC
    first = alloc.plan()
    assert first.forecast.qpm == pytest.approx(90.0)
    assert [lv.affinity for lv in first.levels] == [1.0, 0, 0, 0, 0, 0]
    assert sum(lv.load_share_qpm for lv in first.levels) == pytest.approx(90.0)
    check_pasm(first)
    # the next minute's prompts are all best served at K=15: H moves, and the PASM with it
    alloc.clock.advance(59.0)
    reply = alloc.stub.ReportRouter(
        report("r0", 90, 59.0, ["ac-k15"] * 1000, seq=2), timeout=TIMEOUT
    )
    assert not reply.duplicate
    alloc.clock.advance(1.0)
    alloc.tick()
    second = alloc.plan()
    assert [lv.affinity for lv in second.levels] == [0, 0, 0, 1.0, 0, 0]
    check_pasm(second)
    assert [list(lv.pasm_row) for lv in second.levels] != [list(lv.pasm_row) for lv in first.levels]
    assert alloc.metric("argus_allocator_affinity", level="ac-k15") == 1.0


def test_a_router_on_another_classifier_is_logged_once_and_counted(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    alloc = serve(
        class_quality=read_planning_classes().class_quality, classifier_key="allocator-key"
    )
    assert alloc.metric("argus_allocator_classifier", key="allocator-key") == 1.0

    def send(router_id: str, key: str, seq: int) -> None:
        request = report(router_id, 1, 1.0, ["ac-k0"], seq=seq)
        request.classifier = key
        alloc.stub.ReportRouter(request, timeout=TIMEOUT)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    send("r0", "allocator-key", 1)
    send("r1", "", 1)  # a router that does not say: not checked
    assert warnings() == []
    assert alloc.metric("argus_allocator_routers_other_classifier") == 0.0
    send("r0", "other-key", 2)
    send("r0", "other-key", 3)
    (warning,) = warnings()
    assert "router r0 classifies with classifier other-key" in warning
    assert "plans with the Q(v | c) of classifier allocator-key" in warning
    assert alloc.metric("argus_allocator_routers_other_classifier") == 1.0
    send("r0", "allocator-key", 4)  # restarted with the allocator's classifier
    assert alloc.metric("argus_allocator_routers_other_classifier") == 0.0


def test_a_retried_router_report_is_not_counted_twice(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=1000.0, histogram_window=10))
    alloc.beat("w0")
    first = report("r0", 4, 1.0, ["ac-k5"] * 4, seq=7)
    assert not alloc.stub.ReportRouter(first, timeout=TIMEOUT).duplicate
    assert alloc.stub.ReportRouter(first, timeout=TIMEOUT).duplicate  # the retry
    other = report("r1", 0, 1.0, ["ac-k0"] * 4, seq=7)  # sequences are per router
    assert not alloc.stub.ReportRouter(other, timeout=TIMEOUT).duplicate
    alloc.clock.advance(60.0)
    alloc.tick()
    affinity = {lv.name: lv.affinity for lv in alloc.plan().levels}
    assert affinity["ac-k5"] == pytest.approx(0.5)  # 4 of 8, not 8 of 12


# -- AC ↔ SM -------------------------------------------------------------------------------


def test_slow_retrieval_switches_to_sm_and_healthy_probes_switch_back(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=1000.0))
    alloc.beat("w0")
    alloc.beat("w1")
    ok = allocator_pb2.RetrievalReport(samples_s=[0.01] * 25)
    assert alloc.beat("w0", retrieval=ok).strategy == AC
    slow = allocator_pb2.RetrievalReport(samples_s=[0.9] * 25)  # p99 above 0.5 s
    reply = alloc.beat("w0", retrieval=slow)
    assert reply.strategy == SM  # re-planned at once
    assert reply.assigned_level in SM_LEVELS
    assert reply.probe_retrieval and reply.probe_interval_s == 10.0
    update = alloc.plan()
    assert update.reason == allocator_pb2.PLAN_REASON_STRATEGY_SWITCH
    assert not update.retrieval_healthy
    assert update.allocation.load_margin == 1.5  # covers the reload (§4.6)
    assert [lv.name for lv in update.levels] == SM_LEVELS
    assert all(w.level in SM_LEVELS for w in update.workers)
    assert alloc.metric("argus_allocator_retrieval_healthy") == 0.0
    # a periodic plan while retrieval is down stays SM
    probe = allocator_pb2.RetrievalReport(samples_s=[0.02])
    for _ in range(2):
        alloc.clock.advance(10.0)
        assert alloc.beat("w1", retrieval=probe).strategy == SM  # a probe, too early
        assert alloc.tick() is None
    alloc.clock.advance(10.0)  # a whole window of healthy probes: AC again
    alloc.beat("w1", retrieval=probe)
    update = alloc.plan()
    assert update.strategy == AC
    assert update.reason == allocator_pb2.PLAN_REASON_STRATEGY_SWITCH
    assert update.retrieval_healthy
    assert not alloc.beat("w0").probe_retrieval
    assert alloc.metric("argus_allocator_strategy_switches_total") == 2
    assert alloc.metric("argus_allocator_strategy", strategy="AC") == 1.0


def test_a_retrieval_failure_leaves_ac_at_once_and_recovery_is_found_by_the_tick(
    serve: Any,
) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=1000.0))
    alloc.beat("w0")
    failed = allocator_pb2.RetrievalReport(failures=1)
    assert alloc.beat("w0", retrieval=failed).strategy == SM
    summary = allocator_pb2.RetrievalReport(count=3, p50_s=0.01, p99_s=0.02)
    for _ in range(3):
        alloc.clock.advance(10.0)
        alloc.beat("w0", retrieval=summary)  # probes summarised rather than sampled
    alloc.clock.advance(1.0)
    # the last heartbeat found the window done: tick has nothing more to do
    assert alloc.plan().strategy == AC
    assert alloc.tick() is None


# -- bad input -----------------------------------------------------------------------------


def heartbeat(**fields: Any) -> Any:
    base: dict[str, Any] = {"worker_id": "w9", "address": "127.0.0.1:5009"}
    return allocator_pb2.WorkerHeartbeat(**{**base, **fields})


def router(**fields: Any) -> Any:
    return allocator_pb2.RouterReport(**{"router_id": "r0", **fields})


def classified(strategy: int, *levels: str) -> list[Any]:
    return [allocator_pb2.ClassifiedLevels(strategy=strategy, levels=list(levels))]


BAD_INPUTS = [
    ("Heartbeat", heartbeat(worker_id=""), "worker_id: must not be empty"),
    ("Heartbeat", heartbeat(worker_id="   "), "worker_id: must not be empty"),
    ("Heartbeat", heartbeat(address=""), "address: must not be empty"),
    ("Heartbeat", heartbeat(address="localhost"), "address: expected HOST:PORT"),
    ("Heartbeat", heartbeat(address="h:0"), "address: expected HOST:PORT"),
    ("Heartbeat", heartbeat(queue_length=-1), "queue_length: must be >= 0, got -1"),
    ("Heartbeat", heartbeat(level="ac-k7"), "level: 'ac-k7' is not a level of the profile"),
    ("Heartbeat", heartbeat(worker_class="tpu"), "worker_class: 'tpu' is not a worker class"),
    ("Heartbeat", heartbeat(strategy=9), "strategy: expected AC or SM, got 9"),
    (
        "Heartbeat",
        heartbeat(retrieval=allocator_pb2.RetrievalReport(samples_s=[0.1, math.nan])),
        "retrieval.samples_s[1]: must be a finite number >= 0, got nan",
    ),
    (
        "Heartbeat",
        heartbeat(retrieval=allocator_pb2.RetrievalReport(p99_s=math.inf)),
        "retrieval.p99_s: must be a finite number >= 0, got inf",
    ),
    (
        "Heartbeat",
        heartbeat(retrieval=allocator_pb2.RetrievalReport(samples_s=[0.0] * 4097)),
        "retrieval.samples_s: at most 4096",
    ),
    (
        "Heartbeat",
        heartbeat(last_load_parts=[allocator_pb2.PartLoad(part="unet", seconds=-1.0)]),
        "last_load_parts[0].seconds: must be a finite number >= 0, got -1.0",
    ),
    (
        "Heartbeat",
        heartbeat(resident_parts=[allocator_pb2.ResidentPart(digest="", part="vae")]),
        "resident_parts[0].digest: must not be empty",
    ),
    ("ReportRouter", router(router_id=""), "router_id: must not be empty"),
    ("ReportRouter", router(arrivals=10**6), "arrivals: at most 100000"),
    (
        "ReportRouter",
        router(arrivals=2, arrival_ages_s=[0.1]),
        "arrival_ages_s: expected one age per arrival (2), got 1",
    ),
    (
        "ReportRouter",
        router(arrivals=2, arrival_ages_s=[0.1, -1.0]),
        "arrival_ages_s[1]: must be a finite number >= 0, got -1.0",
    ),
    (
        "ReportRouter",
        router(classified=classified(0, "ac-k0")),
        "classified[0].strategy: expected AC or SM, got 0",
    ),
    (
        "ReportRouter",
        router(classified=classified(AC, "ac-k0", "sm-tiny-sd")),
        "classified[0].levels[1]: 'sm-tiny-sd' is not a AC level of the profile",
    ),
    (
        "ReportRouter",
        router(classified=classified(SM, "nope")),
        "classified[0].levels[0]: 'nope' is not a SM level of the profile",
    ),
    ("ReportRouter", router(classifier="k" * 257), "classifier: at most 256 characters"),
]


def test_bad_input_is_invalid_argument_naming_the_field_and_the_service_keeps_serving(
    serve: Any,
) -> None:
    alloc = serve()
    alloc.beat("w0")
    version = alloc.plan().version
    for method, request, details in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as err:
            getattr(alloc.stub, method)(request, timeout=TIMEOUT)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, details
        assert err.value.details().startswith(details), err.value.details()
    # nothing was half-applied, and the allocator still answers
    assert alloc.plan().version == version
    assert set(levels_of(alloc.plan())) == {"w0"}
    assert alloc.beat("w0").plan_version == version
    health = health_pb2_grpc.HealthStub(alloc.channel)
    check = health_pb2.HealthCheckRequest(service="argus.v1.Allocator")
    assert health.Check(check, timeout=TIMEOUT).status == health_pb2.HealthCheckResponse.SERVING
    assert alloc.metric(
        "argus_allocator_rejected_requests_total", method="Heartbeat", code="INVALID_ARGUMENT"
    ) == sum(1 for m, _, _ in BAD_INPUTS if m == "Heartbeat")


def test_joins_beyond_max_workers_get_resource_exhausted(serve: Any) -> None:
    alloc = serve(ControlConfig(max_workers=2))
    alloc.beat("w0")
    alloc.beat("w1")
    with pytest.raises(grpc.RpcError) as err:
        alloc.beat("w2")
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("worker_id: 'w2' cannot join")
    assert alloc.beat("w1").assigned_level != ""  # members still beat


def test_reflection_lists_the_allocator_and_health(serve: Any) -> None:
    alloc = serve()
    stub = reflection_pb2_grpc.ServerReflectionStub(alloc.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT))
    names = {s.name for s in reply.list_services_response.service}
    assert {"argus.v1.Allocator", "grpc.health.v1.Health"} <= names


# -- clients -------------------------------------------------------------------------------


def test_clients_speak_typed_values(serve: Any) -> None:
    alloc = serve(ControlConfig(period_s=60.0, heartbeat_s=100.0))
    client = AllocatorClient(alloc.address)
    try:
        retrieval = RetrievalReport(samples_s=(0.01, 0.02))
        answer = client.heartbeat(
            WorkerReport("w0", "127.0.0.1:5000", "h100", level="ac-k5", retrieval=retrieval)
        )
        assert answer.plan_version == 2
        assert answer.strategy is Strategy.AC
        assert answer.assigned_level in AC_LEVELS
        member = alloc.servicer.control._members.get("w0")
        assert member is not None and member.report.level == "ac-k5"
        assert member.report.retrieval == retrieval
        ages = (0.5, 0.25)
        sent = RouterReport("r0", 1, len(ages), ages, classified=((Strategy.SM, ()),))
        got = client.report(sent, PROFILES)
        assert (got.plan_version, got.duplicate) == (2, False)
        assert client.get_plan() == alloc.servicer.control.current
    finally:
        client.close()


def test_the_plan_watcher_follows_plans_and_a_restarted_allocator() -> None:
    clock = FakeClock()
    server, port, servicer = create_server(PROFILES, "127.0.0.1:0", clock=clock, epoch="one")
    server.start()
    address = f"127.0.0.1:{port}"
    received: list[tuple[str, int]] = []
    watcher = PlanWatcher(
        address, lambda p: received.append((p.epoch, p.version)), min_backoff_s=0.05
    )
    watcher.start()
    client = AllocatorClient(address)
    try:
        assert watcher.wait_for(lambda p: p.version == 1, TIMEOUT) is not None
        client.heartbeat(WorkerReport("w0", "127.0.0.1:5000", "a100"))
        plan = watcher.wait_for(lambda p: p.version == 2, TIMEOUT)
        assert plan is not None and set(plan.worker_classes()) == {"w0"}
        servicer.close()  # the allocator restarts on the same address: a new epoch
        server.stop(grace=None).wait()
        server, _, servicer = create_server(PROFILES, address, clock=clock, epoch="two")
        server.start()
        plan = watcher.wait_for(lambda p: p.epoch == "two", TIMEOUT)
        assert plan is not None and plan.version == 1  # a lower version, but a newer epoch
        assert received == [("one", 1), ("one", 2), ("two", 1)]
    finally:
        watcher.stop()
        client.close()
        servicer.close()
        server.stop(grace=None)


# -- the process ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_argus_allocator_process_plans_drops_a_dead_worker_and_stops_on_sigterm(
    cluster_ca: TestCA,
) -> None:
    metrics_port = free_port()
    process = start_argus(
        *("allocator", "--port", "0", "--heartbeat-s", "0.1", "--period-s", "60"),
        *("--metrics-port", str(metrics_port)),
        *("--internal-tls-dir", str(cluster_ca.directory("allocator", "allocator"))),
    )
    try:
        address = read_address(process, "allocator")
        assert address.startswith("127.0.0.1:")  # internal endpoint: loopback by default
        with (
            cluster_ca.channel(address, "router") as channel,
            cluster_ca.channel(address, "worker", "w1") as worker,
        ):
            stub = allocator_pb2_grpc.AllocatorStub(channel)
            stream = stub.WatchPlan(allocator_pb2.WatchPlanRequest(watcher_id="t"), timeout=60)
            assert next(stream).reason == allocator_pb2.PLAN_REASON_STARTUP
            reply = allocator_pb2_grpc.AllocatorStub(worker).Heartbeat(
                heartbeat(worker_id="w1"), timeout=TIMEOUT
            )
            assert reply.assigned_level in AC_LEVELS
            # it never beats again: the loop drops it after 3 intervals (0.3 s)
            reasons = []
            for update in stream:
                reasons.append(update.reason)
                if update.reason == allocator_pb2.PLAN_REASON_WORKER_DEAD:
                    assert len(update.workers) == 0
                    break
            assert reasons[0] == allocator_pb2.PLAN_REASON_WORKER_JOINED
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as page:
                text = page.read().decode()
            assert 'argus_allocator_plans_total{reason="worker_dead"} 1.0' in text
            assert "argus_allocator_solve_seconds_count" in text
            assert 'argus_allocator_strategy{strategy="AC"} 1.0' in text
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            # the watch stream ended with the server instead of hanging
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- the classifier whose Q(v | c) prices the routers' classes -----------------------------

JOINERS = [
    WorkerReport(f"w{i}", f"127.0.0.1:{5000 + i}", "a100", queue_length=21) for i in range(4)
]
"""Four workers with 20 requests waiting on each: 80 QPM to drain, which the joint planner
spreads over two levels with the committed classifier's Q(v | c) and puts on one level with
the level averages."""


def reference_plan(class_quality: Any) -> Plan:
    """The plan an in-process control makes for :data:`JOINERS` with ``class_quality``."""
    control = AllocatorControl(
        PROFILES,
        ControlConfig(period_s=60.0, heartbeat_s=30.0),
        clock=FakeClock(),
        class_quality=class_quality,
    )
    for worker in JOINERS:
        control.heartbeat(worker)
    return control.current.plan


def start_allocator(*flags: str) -> tuple[subprocess.Popen[str], str | None, str]:
    """An ``argus allocator FLAGS`` process, the address it listens on (None: it exited
    first) and what it printed until then."""
    process = start_argus(
        "allocator", "--port", "0", "--heartbeat-s", "30", "--insecure-internal", *flags
    )
    assert process.stdout is not None
    printed: list[str] = []
    for line in process.stdout:
        printed.append(line)
        found = re.search(r"listening on (\S+)", line)
        if found:
            return process, found.group(1), "".join(printed)
    return process, None, "".join(printed)


def process_plan(*flags: str) -> tuple[Plan, str]:
    """The plan of an ``argus allocator FLAGS`` process once :data:`JOINERS` joined, and what
    it printed up to its ``listening on`` line."""
    process, address, printed = start_allocator(*flags)
    try:
        assert address is not None, printed
        client = AllocatorClient(address, timeout_s=TIMEOUT)
        try:
            for worker in JOINERS:
                client.heartbeat(worker)
            plan = client.get_plan().plan
        finally:
            client.close()
    finally:
        process.kill()
        process.wait()
    return plan, printed


def test_argus_allocator_plans_with_the_routers_classifier_or_level_averages() -> None:
    with_classes = reference_plan(read_planning_classes().class_quality)
    with_averages = reference_plan(None)
    assert with_classes.allocation.workers_per_level != with_averages.allocation.workers_per_level
    # the router's default: the committed classifier (AC priced as hits, as the reference's)
    plan, printed = process_plan("--no-cache-plan")
    assert plan.allocation.workers_per_level == with_classes.allocation.workers_per_level
    assert list(plan.shift_map.matrix) == [
        pytest.approx(row) for row in with_classes.shift_map.matrix
    ]
    assert f"classifier {classifier_key()} ({default_classifier_dir()}): AC, SM planned" in printed
    plan, printed = process_plan("--classifier", "none", "--no-cache-plan")
    assert plan.allocation.workers_per_level == with_averages.allocation.workers_per_level
    assert "--classifier none: every strategy planned with level averages" in printed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(quality=None), "ac/calibration.json: field 'quality'"),
        (lambda d: d.update(edges=[0.5]), "ac/calibration.json: field 'edges'"),
    ],
)
def test_argus_allocator_refuses_a_calibration_it_cannot_price(
    tmp_path: Path, change: Any, message: str
) -> None:
    directory = shutil.copytree(default_classifier_dir(), tmp_path / "classifier")
    path = directory / "ac" / "calibration.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    process, address, printed = start_allocator("--classifier", str(directory))
    process.kill()  # in case it took the file and serves
    assert address is None and process.wait() == 2
    assert message in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port: 70000 outside 0..65535"),
        (["--heartbeat-s", "0"], "--heartbeat-s: must be a finite number > 0, got 0.0"),
        (["--period-s", "nan"], "--period-s: must be a finite number > 0, got nan"),
        (["--retrieval-threshold-s", "-1"], "--retrieval-threshold-s: must be > 0, got -1.0"),
        (["--max-watchers", "0"], "--max-watchers: must be >= 1, got 0"),
        (["--metrics-port", "-1"], "--metrics-port: -1 outside 0..65535"),
        (["--profile", "/nonexistent.toml"], "/nonexistent.toml: cannot read profile file"),
    ],
)
def test_argus_allocator_rejects_bad_flags(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["allocator", *args, "--insecure-internal"]) == 2
    assert message in capsys.readouterr().err


def test_every_replan_reason_reaches_the_wire_and_back() -> None:
    """A reason without a wire value made the publisher fail on its plan (load surges did)."""
    from argus.contracts.plans import REASON_FROM_PB, REASON_TO_PB, ReplanReason

    for reason in ReplanReason:
        value = REASON_TO_PB[reason]
        assert allocator_pb2.PlanReason.Name(value) == f"PLAN_REASON_{reason.name}"
        assert REASON_FROM_PB[value] is reason


def test_a_router_reporting_a_retrained_q_is_planned_with_it(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    classes = read_planning_classes()
    alloc = serve(class_quality=classes.class_quality, classifier_key="allocator-key")
    control = alloc.servicer.control
    levels = tuple(lv.name for lv in PROFILES.levels_for(Strategy.AC))
    n = len(levels)
    retrained = ClassQuality(
        Strategy.AC, levels, tuple((1.0 - 0.01 * c,) * n for c in range(n)), (1 / n,) * n, "t"
    )
    request = report("r0", 1, 1.0, ["ac-k0"], seq=1)
    request.classifier = "allocator-key+retrained:ac1"
    request.class_quality.append(class_quality_to_pb(retrained))
    alloc.stub.ReportRouter(request, timeout=TIMEOUT)
    assert control.class_quality(Strategy.AC) == retrained
    assert control.class_quality(Strategy.SM) == classes.class_quality[Strategy.SM]
    assert control.classifier_key == "allocator-key+retrained:ac1"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    alloc.clock.advance(60.0)
    alloc.tick()
    assert alloc.metric("argus_allocator_classifier", key="allocator-key+retrained:ac1") == 1.0
    assert alloc.metric("argus_allocator_classifier", key="allocator-key") == 0.0

    bad = report("r0", 1, 1.0, ["ac-k0"], seq=2)
    bad.class_quality.append(class_quality_to_pb(retrained))
    bad.class_quality[0].levels[1] = "sm-sd-xl"
    with pytest.raises(grpc.RpcError) as caught:
        alloc.stub.ReportRouter(bad, timeout=TIMEOUT)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("class_quality[0].levels")
    assert control.class_quality(Strategy.AC) == retrained  # the bad report changed nothing


def test_a_served_allocator_prices_ac_by_the_routers_cache_reports(serve: Any) -> None:
    from argus.allocator.app import AllocatorSettings
    from argus.allocator.cache_plan import CachePlanner
    from argus.contracts.cache_outlook import CacheOutlook

    assert AllocatorSettings().cache_plan  # the default the command serves with
    blind = serve()
    planned = serve(cache=CachePlanner())
    level = next(lv for lv in PROFILES.levels_for(Strategy.AC) if lv.skip_steps > 0)
    bins = CachePlanner().bins(level)
    misses = CacheOutlook.of_lookups([(level.name, 0, math.nan)] * 50, {level.name: len(bins)})
    for each in (blind, planned):
        each.servicer.control.report_cache(misses)
    assert blind.servicer.control._allocator.cache is None
    assert planned.servicer.control._allocator.cache_outlook.levels[level.name].total == 50
