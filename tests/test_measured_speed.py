"""Plans at the workers' measured speed: routers report the latencies they learned from their
workers' replies, and the allocator plans each class at the speed they show
(argus.allocator.measured, argus.contracts.routers)."""

from __future__ import annotations

import pytest

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.allocator.measured import MeasuredSpeeds
from argus.contracts.router_api import RouterRequest
from argus.contracts.routers import RouterReport, router_report_from_pb, router_report_to_pb
from argus.contracts.wire import FieldError
from argus.contracts.workers import WorkerReport
from argus.profiles import default_profiles
from argus.router.app import StatsReporter
from argus.types import MeasuredLatency, ProfileSet, Strategy
from tests.router_cluster import FakeClock
from tests.test_router_core import FakeWorkers
from tests.test_service_times import core_on, timed

pytestmark = pytest.mark.unit


PROFILES = default_profiles()
CLASS = PROFILES.worker_classes[0]
AC = [level.name for level in PROFILES.levels_for(Strategy.AC)]


def at_speed(factor: float, *levels: str) -> tuple[MeasuredLatency, ...]:
    """Measurements of ``levels`` on CLASS, ``factor`` times the profile's latency."""
    return tuple(
        MeasuredLatency(CLASS, level, PROFILES.profile(CLASS, level).latency_s * factor, 10)
        for level in levels
    )


def test_a_class_runs_at_the_median_of_its_levels_measured_over_profiled_latency() -> None:
    speeds = MeasuredSpeeds()
    speeds.observe("r1", at_speed(0.05, AC[0], AC[1]), now=0.0)
    speeds.observe("r2", at_speed(0.5, AC[2]), now=0.0)  # a cold cache: slow at an AC level
    assert speeds.factors(PROFILES, now=1.0) == {CLASS: pytest.approx(0.05)}
    scaled = speeds.profiles(PROFILES, now=1.0)
    for level in AC:  # every level at the class's speed, the ladder's shape kept
        before, after = PROFILES.profile(CLASS, level), scaled.profile(CLASS, level)
        assert after.latency_s == pytest.approx(before.latency_s * 0.05)
        assert after.throughput_qpm == pytest.approx(before.throughput_qpm / 0.05)
        assert after.load_time_s == before.load_time_s


def test_old_reports_are_forgotten_and_an_empty_one_keeps_the_last() -> None:
    speeds = MeasuredSpeeds(max_age_s=60.0)
    speeds.observe("r1", at_speed(0.1, AC[0]), now=0.0)
    speeds.observe("r1", (), now=30.0)
    assert speeds.factors(PROFILES, now=59.0) == {CLASS: pytest.approx(0.1)}
    assert speeds.factors(PROFILES, now=61.0) == {}
    assert speeds.profiles(PROFILES, now=61.0) is PROFILES


def test_measured_latencies_cross_the_wire_and_bad_ones_are_named() -> None:
    message = router_report_to_pb(RouterReport("r1", sequence=1), PROFILES)
    message.measured.add(worker_class=CLASS, level=AC[0], latency_s=0.2, samples=7)
    report = router_report_from_pb(message, PROFILES)
    assert report.measured == (MeasuredLatency(CLASS, AC[0], 0.2, 7),)
    for field, value, named in (
        ("worker_class", "tpu-v9", "measured[1].worker_class"),
        ("level", "ac-k99", "measured[1].level"),
        ("latency_s", float("nan"), "measured[1].latency_s"),
        ("latency_s", 0.0, "measured[1].latency_s"),
    ):
        bad = router_report_to_pb(RouterReport("r1", sequence=1), PROFILES)
        bad.measured.add(worker_class=CLASS, level=AC[0], latency_s=0.2)
        entry = bad.measured.add(worker_class=CLASS, level=AC[0], latency_s=0.2)
        setattr(entry, field, value)
        with pytest.raises(FieldError, match=named.replace("[", r"\[").replace("]", r"\]")):
            router_report_from_pb(bad, PROFILES)


def test_the_allocator_plans_the_capacity_of_the_measured_workers() -> None:
    clock = FakeClock()
    control = AllocatorControl(PROFILES, ControlConfig(period_s=60.0), clock=clock)
    ages = tuple(i / 10 for i in range(600))  # 10 requests a second over the last minute

    def next_period(sequence: int, measured: tuple[MeasuredLatency, ...] = ()) -> None:
        clock.now += 61.0
        for worker_id in ("w0", "w1"):
            control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", CLASS))
        report = RouterReport("r1", sequence, len(ages), ages, measured=measured)
        control.report_router(report)
        control.tick()

    next_period(1)
    next_period(2)
    at_profile = control.current.plan.allocation
    assert at_profile.shortfall_qpm > 0.0  # two profiled GPUs cannot serve 10 requests/s
    next_period(3, at_speed(0.01, *AC[:3]))
    measured = control.current.plan.allocation
    assert measured.shortfall_qpm == 0.0  # the workers are 100 × faster than the profile
    assert measured.served_qpm > at_profile.served_qpm


class RecordingClient:
    def __init__(self) -> None:
        self.reports: list[RouterReport] = []

    def report(self, report: RouterReport, profiles: ProfileSet) -> None:
        self.reports.append(report)


def test_the_router_reports_what_it_learned_of_its_workers() -> None:
    clock = FakeClock()
    workers = FakeWorkers()
    core = core_on(workers, ("w1",), clock)
    workers.answers["w1:1"] = timed(0.4)
    for _ in range(3):
        core.generate(RouterRequest(prompt="a fox", width=64, height=64, steps=30))
    client = RecordingClient()
    StatsReporter(core, client, clock).report_once()  # type: ignore[arg-type]
    (measured,) = client.reports[0].measured
    assert measured.worker_class == CLASS and measured.samples == 3
    assert measured.latency_s == pytest.approx(0.4)  # a request as served, not a 1024² one
