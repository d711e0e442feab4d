"""The router's service times learned from its workers' replies (argus.router.service_times),
alone and as the core's admission, worker selection and abandoned-work accounting use them."""

from __future__ import annotations

from collections import Counter

import pytest

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.generate import GenerateCall, GenerateResult, Timing
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.router.config import RouterServiceConfig
from argus.router.core import RouterCore, WorkerError
from argus.router.service_times import ServiceTimeConfig, ServiceTimes
from argus.router.values import Refusal, RouterError
from tests.router_cluster import PROFILES, FakeClock, StubClassifier
from tests.test_router_core import PNG, FakeWorkers

pytestmark = pytest.mark.unit


CLASS = PROFILES.worker_classes[0]
EXACT = ServiceTimeConfig(headroom=0.0)  # figures as learned, without the admission's headroom
LEVEL = PROFILES.levels[0].name
PROFILED_S = PROFILES.profile(CLASS, LEVEL).latency_s


def learn(times: ServiceTimes, worker: str, service_s: float, denoise_s: float, n: int = 5,
          cost: float = 1.0, level: str = LEVEL, now: float = 0.0) -> None:  # fmt: skip
    for _ in range(n):
        times.observe(worker, CLASS, level, cost, service_s, denoise_s, now)


# -- the estimator --------------------------------------------------------------------------


def test_a_worker_is_priced_from_the_profile_until_it_has_answered() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    assert times.predict_s("w1", CLASS, LEVEL, 2.0, now=0.0) == pytest.approx(2 * PROFILED_S)


def test_a_learned_worker_costs_its_fixed_part_plus_its_denoising_per_reference_request() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=0.5, denoise_s=0.4, cost=0.5)  # 0.1 fixed, 0.8 s per unit
    assert times.predict_s("w1", CLASS, LEVEL, 0.5, now=1.0) == pytest.approx(0.5)
    assert times.predict_s("w1", CLASS, LEVEL, 2.0, now=1.0) == pytest.approx(0.1 + 1.6)


def test_one_very_slow_reply_counts_as_four_times_the_median_only() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=1.0, denoise_s=1.0, n=20)
    times.observe("w1", CLASS, LEVEL, 1.0, 60.0, 60.0, 0.0)  # a preempted vCPU, a LoRA load
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(24 / 21)


def test_a_long_tail_stays_in_the_figure() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    for _ in range(4):  # one in five runs 3x longer
        learn(times, "w1", service_s=1.0, denoise_s=1.0, n=4)
        learn(times, "w1", service_s=3.0, denoise_s=3.0, n=1)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(1.4)


def test_a_worker_that_slowed_is_priced_from_its_newest_replies() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=1.0, denoise_s=0.8, n=56)
    learn(times, "w1", service_s=1.4, denoise_s=1.2, n=8)  # a neighbour arrived on its host
    # the window's mean would still say 1.05 s; the newest eight say 1.4
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(1.4)
    assert times.predict_s("w1", CLASS, LEVEL, 2.0, now=0.0) == pytest.approx(0.2 + 2.4)
    (measured,) = times.measured(now=0.0)
    assert measured.latency_s == pytest.approx(1.4)


def test_a_slowdown_needs_most_of_the_newest_replies_and_more_than_the_margin() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=1.0, denoise_s=1.0, n=60)
    learn(times, "w1", service_s=4.0, denoise_s=4.0, n=3)  # three LoRA loads in a row
    learn(times, "w1", service_s=1.0, denoise_s=1.0, n=1)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(73 / 64)
    gently = ServiceTimes(PROFILES, EXACT)
    learn(gently, "w1", service_s=1.0, denoise_s=1.0, n=56)
    learn(gently, "w1", service_s=1.1, denoise_s=1.1, n=8)  # 10%: within the margin
    assert gently.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(64.8 / 64)


def test_a_noisy_worker_is_not_taken_for_a_slowed_one() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    for _ in range(28):  # mean 1.0 s, but one reply in two takes 1.3 s
        learn(times, "w1", service_s=0.7, denoise_s=0.7, n=1)
        learn(times, "w1", service_s=1.3, denoise_s=1.3, n=1)
    learn(times, "w1", service_s=1.2, denoise_s=1.2, n=8)  # 20% over the mean, within the spread
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(65.6 / 64)


def test_a_worker_that_sped_up_is_learned_at_the_windows_pace() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=2.0, denoise_s=2.0, n=56)
    learn(times, "w1", service_s=1.0, denoise_s=1.0, n=8)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(120 / 64)


def test_the_figure_follows_a_worker_that_changed_speed_within_its_window() -> None:
    times = ServiceTimes(PROFILES, ServiceTimeConfig(window=8, headroom=0.0))
    learn(times, "w1", service_s=1.0, denoise_s=1.0, n=8)
    learn(times, "w1", service_s=3.0, denoise_s=3.0, n=8)  # its cache went cold
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(3.0)


def test_an_old_figure_is_forgotten_and_the_worker_is_seeded_again() -> None:
    times = ServiceTimes(PROFILES, ServiceTimeConfig(max_age_s=60.0, headroom=0.0))
    learn(times, "w1", service_s=0.2, denoise_s=0.2, now=0.0)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=59.0) == pytest.approx(0.2)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=61.0) == pytest.approx(PROFILED_S)


def test_a_new_worker_is_seeded_from_its_learned_peers_of_the_same_class_and_level() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=0.3, denoise_s=0.2)
    learn(times, "w2", service_s=0.5, denoise_s=0.4)
    learn(times, "w3", service_s=0.7, denoise_s=0.6)
    assert times.predict_s("w9", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(0.5)


def test_a_level_nobody_served_yet_is_the_profile_scaled_as_the_learned_workers_compare() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=0.1 + PROFILED_S / 20, denoise_s=PROFILED_S / 20)
    other = PROFILES.levels[1].name
    expected = 0.1 + PROFILES.profile(CLASS, other).latency_s / 20
    assert times.predict_s("w1", CLASS, other, 1.0, now=0.0) == pytest.approx(expected)


def test_the_allocator_gets_each_class_and_levels_median_service_time_per_request() -> None:
    times = ServiceTimes(PROFILES, EXACT)
    learn(times, "w1", service_s=0.3, denoise_s=0.2, cost=0.01)
    learn(times, "w2", service_s=0.5, denoise_s=0.4, cost=0.01)
    learn(times, "w3", service_s=0.9, denoise_s=0.8, cost=0.01)
    (measured,) = times.measured(now=0.0)
    assert (measured.worker_class, measured.level) == (CLASS, LEVEL)
    assert measured.latency_s == pytest.approx(0.5) and measured.samples == 15


def test_a_learned_figure_is_raised_by_the_headroom_and_the_profile_is_not() -> None:
    times = ServiceTimes(PROFILES, ServiceTimeConfig(headroom=0.25))
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(PROFILED_S)
    learn(times, "w1", service_s=1.0, denoise_s=1.0)
    assert times.predict_s("w1", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(1.25)
    assert times.predict_s("w2", CLASS, LEVEL, 1.0, now=0.0) == pytest.approx(1.25)  # a seed
    (measured,) = times.measured(now=0.0)
    assert measured.latency_s == pytest.approx(1.0)  # the allocator gets it as learned


def test_nonsense_timings_are_not_learned() -> None:
    times = ServiceTimes(PROFILES, ServiceTimeConfig(min_samples=1))
    for service_s, denoise_s in ((0.0, 0.0), (float("nan"), 0.1), (-1.0, 0.0)):
        times.observe("w1", CLASS, LEVEL, 1.0, service_s, denoise_s, 0.0)
    times.observe("w1", CLASS, LEVEL, 0.0, 1.0, 1.0, 0.0)  # no cost
    assert times.measured(now=0.0) == ()


# -- in the router's core -------------------------------------------------------------------


def timed(service_s: float, denoise_s: float | None = None):  # type: ignore[no-untyped-def]
    """A worker answer whose timings say it took ``service_s`` on the GPU slot."""
    denoise = service_s if denoise_s is None else denoise_s

    def answer(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        timing = Timing(queue_ms=5.0, denoise_ms=denoise * 1e3, total_ms=service_s * 1e3 + 5)
        return GenerateResult(request_id=call.request_id, png=PNG, level=call.level, timing=timing)

    return answer


def core_on(workers: FakeWorkers, ids: tuple[str, ...], clock: FakeClock) -> RouterCore:
    """A core on a plan putting every worker at the same (slowest) level: an SM plan on a
    tiny load, so the PASM sends every prompt to one level and Eq. 3 picks among them."""
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    for worker_id in ids:
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", CLASS))
    core = RouterCore(
        PROFILES, StubClassifier(), RouterServiceConfig(), workers=workers, clock=clock
    )
    assert core.install(control.current)
    return core


def test_a_request_the_workers_measured_speed_cannot_serve_in_time_is_refused_at_arrival() -> None:
    clock = FakeClock()
    workers = FakeWorkers()
    core = core_on(workers, ("w1",), clock)
    level_s = PROFILES.profile(CLASS, core._router.level_name(0)).latency_s
    # the profile says a 64 × 64 request takes a sliver of the reference's latency ...
    small = RouterRequest(prompt="a fox", width=64, height=64, deadline_ms=1000)
    assert core.generate(small).png == PNG
    # ... but the worker answers in 3 s whatever the size: after a few replies, the router
    # knows a 1 s deadline cannot be met even on the idle worker
    workers.answers["w1:1"] = timed(3.0, denoise_s=0.5)
    for _ in range(3):
        core.generate(RouterRequest(prompt="a fox", width=64, height=64, deadline_ms=60_000))
    calls = len(workers.calls)
    with pytest.raises(RouterError) as refused:
        core.generate(small)
    assert refused.value.kind is Refusal.DEADLINE
    assert len(workers.calls) == calls  # refused before any worker was called
    assert level_s * (64 * 64) / (1024 * 1024) < 1.0  # the profile alone would admit it


def test_a_worker_slower_than_its_peers_gets_less_of_the_levels_traffic() -> None:
    clock = FakeClock()
    workers = FakeWorkers()
    core = core_on(workers, ("w1", "w2"), clock)
    workers.answers["w1:1"] = timed(0.2)
    workers.answers["w2:1"] = timed(2.0)  # a cold cache, a slower card
    request = RouterRequest(prompt="a fox", width=64, height=64)
    for busy in (100, 0):  # each learned in turn: ties go to w1 unless it looks busy
        core._beliefs["w1"].queue = busy
        for _ in range(3):
            core.generate(request)
    assert Counter(address for address, _ in workers.calls) == {"w1:1": 3, "w2:1": 3}
    core._beliefs["w1"].queue = 3  # w1 holds 3 requests, w2 none: (3 + 1) × 0.2 s < 1 × 2.0 s
    for _ in range(20):
        core.generate(request)
    assert Counter(address for address, _ in workers.calls[-20:]) == {"w1:1": 20}


def test_a_worker_still_finishing_abandoned_work_is_counted_busy_for_a_step() -> None:
    clock = FakeClock()
    workers = FakeWorkers()
    core = core_on(workers, ("w1", "w2"), clock)
    request = RouterRequest(prompt="a fox", width=64, height=64, steps=10)

    def expires(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        raise WorkerError(Refusal.DEADLINE, "deadline passed: 3 steps run")

    workers.answers["w1:1"] = expires  # both idle: ties go to w1
    with pytest.raises(RouterError):
        core.generate(request)
    assert workers.calls[-1][0] == "w1:1"
    core.generate(request)  # w1 is still stopping at its next step: w2 is chosen
    assert workers.calls[-1][0] == "w2:1"
    clock.now += 60.0  # long past one step: w1 is idle again and wins the tie
    workers.answers["w1:1"] = timed(0.5)
    core.generate(request)
    assert workers.calls[-1][0] == "w1:1"
