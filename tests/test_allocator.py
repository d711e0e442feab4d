import pytest

from argus.allocator.allocator import Allocator
from argus.allocator.config import ControlConfig
from argus.profiles import default_profiles
from argus.types import ClusterView, Strategy, WorkerState

pytestmark = pytest.mark.unit


def feed(allocator: Allocator, qpm: float, minutes: int, start: float = 0.0) -> float:
    gap = 60.0 / qpm
    t = start
    while t < start + 60.0 * minutes:
        allocator.observe_arrival(t)
        t += gap
    return start + 60.0 * minutes


def test_plans_follow_the_observed_load_and_affinity():
    allocator = Allocator(default_profiles())
    now = feed(allocator, 60.0, 3)
    for level in [0] * 800 + [3] * 200:
        allocator.observe_classification(Strategy.AC, level)
    light = allocator.plan(now, ClusterView.uniform(8), Strategy.AC)
    assert light.forecast.qpm == pytest.approx(60.0, rel=0.02)
    assert light.histogram == pytest.approx((0.8, 0, 0, 0.2, 0, 0))
    assert light.allocation.workers_per_level[0] == 8
    # the allocator's forecast is an EWMA (weight 0.5 on the newest period), so it is within
    # 2% of a new steady rate after six periods
    now = feed(allocator, 200.0, 6, start=now)
    heavy = allocator.plan(now, ClusterView.uniform(8), Strategy.AC)
    assert heavy.version == light.version + 1
    assert heavy.forecast.qpm == pytest.approx(200.0, rel=0.02)
    assert heavy.allocation.workers_per_level[0] < 8
    # level-0 prompts are the ones that must move when level 0 shrinks
    assert heavy.shift_map.matrix[0][0] < 1.0


def test_replans_around_dead_workers():
    allocator = Allocator(default_profiles())
    now = feed(allocator, 100.0, 2)
    workers = ClusterView(tuple(WorkerState(f"w{i}", "a100", alive=i < 4) for i in range(8)))
    plan = allocator.plan(now, workers, Strategy.AC)
    assert set(plan.allocation.assignment) == {"w0", "w1", "w2", "w3"}


def test_load_margin_overprovisions():
    allocator = Allocator(default_profiles())
    now = feed(allocator, 100.0, 2)
    plan = allocator.plan(now, ClusterView.uniform(8), Strategy.SM, load_margin=1.5)
    assert plan.allocation.served_qpm == pytest.approx(1.5 * plan.forecast.qpm)


def test_queued_backlog_is_planned_to_drain():
    allocator = Allocator(default_profiles(), ControlConfig(backlog_drain_s=30.0))
    now = feed(allocator, 60.0, 2)
    idle = allocator.plan(now, ClusterView.uniform(8), Strategy.AC)
    queued = ClusterView(tuple(WorkerState(f"w{i}", "a100", queue_length=5) for i in range(8)))
    busy = allocator.plan(now, queued, Strategy.AC)
    # 5 queued per worker is 1 in service and 4 waiting: 32 waiting requests drained in
    # 30 s add 64 QPM to the load planned for
    assert busy.forecast.qpm == pytest.approx(idle.forecast.qpm + 64.0)
    assert (
        busy.allocation.objective / busy.forecast.qpm
        < idle.allocation.objective / idle.forecast.qpm
    )


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="backlog_drain_s"):
        ControlConfig(backlog_drain_s=-1.0)
    with pytest.raises(ValueError, match="histogram_window"):
        ControlConfig(histogram_window=0)


def test_the_forecast_counts_in_the_allocators_period():
    allocator = Allocator(default_profiles(), ControlConfig(period_s=30.0))
    for i in range(30):  # 30 arrivals in the first 15 s
        allocator.observe_arrival(i / 2)
    # periods of 30 s: the first, closed, counted 60 QPM; one open 60 s period would read 40
    assert allocator.forecast(45.0).qpm == pytest.approx(60.0)


def test_plan_best_picks_the_better_strategy_with_hysteresis():
    allocator = Allocator(default_profiles())
    now = feed(allocator, 150.0, 2)
    view = ClusterView.uniform(8)
    ac = allocator.plan(now, view, Strategy.AC)
    sm = allocator.plan(now, view, Strategy.SM)
    better = max((ac, sm), key=lambda plan: plan.allocation.objective).strategy
    worse = Strategy.SM if better is Strategy.AC else Strategy.AC
    chosen = allocator.plan_best(
        now, view, (Strategy.AC, Strategy.SM), prefer=worse, hysteresis=0.0
    )
    assert chosen.strategy is better
    # the chosen plan is the one the next follows (its previous: version, switching cost)
    assert allocator.plan(now, view, better).version == chosen.version + 1
    sticky = allocator.plan_best(
        now, view, (Strategy.AC, Strategy.SM), prefer=worse, hysteresis=1.0
    )
    assert sticky.strategy is worse
    assert (
        allocator.plan_best(now, view, (Strategy.SM,), prefer=Strategy.AC).strategy is Strategy.SM
    )
    with pytest.raises(ValueError, match="strategies"):
        allocator.plan_best(now, view, (), prefer=Strategy.AC)
