from dataclasses import replace

import pytest

from argus.allocator.allocator import Allocator
from argus.allocator.config import ControlConfig
from argus.profiles import default_profiles
from argus.types import ClassQuality, ClusterView, Strategy, WorkerState

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


def test_at_overload_the_better_strategy_wins_without_hysteresis():
    """When the strategy in force cannot serve the forecast, every period on the worse plan
    refuses requests: the better objective wins however small its lead."""
    allocator = Allocator(default_profiles())
    now = feed(allocator, 400.0, 2)  # far above 8 A100s' capacity at any level
    view = ClusterView.uniform(8)
    both = (Strategy.AC, Strategy.SM)
    ac, sm = (allocator.plan(now, view, s) for s in both)
    assert ac.allocation.saturated and sm.allocation.saturated
    assert ac.allocation.objective != sm.allocation.objective
    better = max((ac, sm), key=lambda plan: plan.allocation.objective).strategy
    worse = Strategy.SM if better is Strategy.AC else Strategy.AC
    assert allocator.plan_best(now, view, both, prefer=worse, hysteresis=1.0).strategy is better
    # below capacity the hysteresis holds the strategy in force
    light = Allocator(default_profiles())
    now = feed(light, 60.0, 2)
    assert not light.plan(now, view, worse).allocation.saturated
    assert light.plan_best(now, view, both, prefer=worse, hysteresis=1.0).strategy is worse


def test_the_first_plans_see_the_calibration_shares_until_enough_prompts_are_classified():
    """A strategy planned with Q(v | c) is planned, and compared, from its first plan with a
    histogram of histogram_prior_prompts prompts: the classes observed, and the calibration's
    class shares (ClassQuality.prior) for the rest."""
    profiles = default_profiles()
    levels = profiles.levels_for(Strategy.AC)
    averages = ClassQuality.from_levels(levels)
    prior = (0.0,) * (len(levels) - 1) + (1.0,)  # every calibration prompt tolerates the most
    quality = {Strategy.AC: replace(averages, prior=prior)}
    config = ControlConfig(histogram_prior_prompts=50)
    allocator = Allocator(profiles, config, class_quality=quality)
    assert allocator.histogram(Strategy.AC) == pytest.approx(prior)
    sm = len(profiles.levels_for(Strategy.SM))
    assert allocator.histogram(Strategy.SM) == pytest.approx((1 / sm,) * sm)  # no Q: observed
    for _ in range(25):
        allocator.observe_classification(Strategy.AC, 0)
    half = allocator.histogram(Strategy.AC)
    assert half[0] == pytest.approx(0.5) and half[-1] == pytest.approx(0.5)
    now = feed(allocator, 150.0, 2)
    plan = allocator.plan(now, ClusterView.uniform(8), Strategy.AC)
    assert plan.histogram == pytest.approx(half)  # the plan is made from it
    for _ in range(25):
        allocator.observe_classification(Strategy.AC, 0)
    assert allocator.histogram(Strategy.AC)[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="histogram_prior_prompts"):
        ControlConfig(histogram_prior_prompts=-1)


def test_plan_best_compares_the_strategies_from_the_first_plan():
    """With the prior filling the histograms, ``best`` needs no classified prompt to compare:
    the better strategy is chosen at the first plan, not after a hundred prompts."""
    profiles = default_profiles()
    quality = {
        s: ClassQuality.from_levels(profiles.levels_for(s)) for s in (Strategy.AC, Strategy.SM)
    }
    allocator = Allocator(profiles, ControlConfig(), class_quality=quality)
    now = feed(allocator, 150.0, 2)
    view = ClusterView.uniform(8)
    both = (Strategy.AC, Strategy.SM)
    ac, sm = (allocator.plan(now, view, s) for s in both)
    better = max((ac, sm), key=lambda plan: plan.allocation.objective).strategy
    worse = Strategy.SM if better is Strategy.AC else Strategy.AC
    assert allocator.plan_best(now, view, both, prefer=worse, hysteresis=0.0).strategy is better


def test_a_model_load_is_charged_only_where_the_workers_stop_to_load():
    """Workers that keep serving while they load forgo no work: the planner's switching cost
    is zero for them, and switch_cost_weight for workers that stop."""
    profiles = default_profiles()
    assert ControlConfig().planner_config(profiles).switch_cost_weight == 0.0
    stopping = ControlConfig(background_loads=False, switch_cost_weight=2.5)
    assert stopping.planner_config(profiles).switch_cost_weight == 2.5
    # the same plan from workers holding SDXL: moving them to the small models costs the
    # stopping planner objective, and the background planner nothing
    sdxl = profiles.levels_for(Strategy.SM)[0].name
    view = ClusterView(tuple(WorkerState(f"w{i}", "a100", level=sdxl) for i in range(8)))
    objectives = []
    for config in (ControlConfig(), ControlConfig(background_loads=False)):
        allocator = Allocator(profiles, config)
        now = feed(allocator, 150.0, 2)
        plan = allocator.plan(now, view, Strategy.SM)
        assert any(level != sdxl for level in plan.allocation.assignment.values())
        objectives.append(plan.allocation.objective)
    assert objectives[1] < objectives[0]
