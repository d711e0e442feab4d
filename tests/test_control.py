"""The allocator's control on its own (no gRPC): what a heartbeat is answered."""

from __future__ import annotations

import pytest

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.workers import HeartbeatAnswer, RetrievalReport, WorkerReport
from argus.profiles import default_profiles
from argus.types import Strategy

pytestmark = pytest.mark.unit


PROFILES = default_profiles()
SM_LEVELS = {lv.name for lv in PROFILES.levels_for(Strategy.SM)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(
    control: AllocatorControl, worker_id: str, retrieval: RetrievalReport | None = None
) -> HeartbeatAnswer:
    return control.heartbeat(
        WorkerReport(
            worker_id=worker_id,
            address=f"{worker_id}:1",
            worker_class=PROFILES.worker_classes[0],
            queue_length=0,
            level="",
            retrieval=retrieval or RetrievalReport(),
        )
    )


def test_heartbeat_answers_follow_the_plan_and_the_retrieval_health() -> None:
    clock = FakeClock()
    control = AllocatorControl(PROFILES, ControlConfig(period_s=60.0), clock=clock)
    beat(control, "w0")
    first = beat(control, "w0")
    assert beat(control, "w0") == first  # nothing changed, the same answer
    beat(control, "w1")  # joins: a new plan
    moved = beat(control, "w0")
    assert moved.plan_version == control.current.plan.version > first.plan_version
    assert beat(control, "w1").assigned_level == control.current.plan.allocation.assignment["w1"]
    slow = RetrievalReport(samples_s=(0.9,) * 25)  # p99 above the threshold: SM at once
    switched = beat(control, "w0", slow)
    assert switched.strategy is Strategy.SM and switched.probe_retrieval
    assert switched.assigned_level in SM_LEVELS
    other = beat(control, "w1")
    assert other.probe_retrieval and other.strategy is Strategy.SM
    assert other.assigned_level == control.current.plan.allocation.assignment["w1"]


def test_a_failed_switch_plan_still_asks_for_probes() -> None:
    # the monitor wants SM but the re-plan fails: the plan stays, the answer must not
    clock = FakeClock()
    control = AllocatorControl(PROFILES, ControlConfig(period_s=60.0), clock=clock)
    beat(control, "w0")
    assert not beat(control, "w0").probe_retrieval

    def fail(*args: object, **kwargs: object) -> object:
        raise RuntimeError("solver down")

    control._allocator.plan_best = fail  # type: ignore[method-assign,assignment]
    version = control.current.version
    answer = beat(control, "w0", RetrievalReport(failures=1))
    assert control.current.version == version
    assert answer.probe_retrieval
