import random
from typing import Any

import pulp
import pytest

from argus.allocator.paper_eq1 import highs_solver, solve, solve_per_worker
from argus.profiles import default_profiles
from argus.types import ClusterView, Strategy, WorkerState
from tests.factories import make_profiles, random_instance

pytestmark = pytest.mark.unit


def check_feasible(allocation, profiles, workers):
    capacity = allocation.capacity_qpm(profiles, workers)
    for load, cap in zip(allocation.load_share_qpm, capacity, strict=True):
        assert load <= cap + 1e-6
    assert sum(allocation.load_share_qpm) == pytest.approx(allocation.served_qpm, abs=1e-6)
    assert set(allocation.assignment) == {w.worker_id for w in workers.alive()}
    assert sum(allocation.workers_per_level) == len(workers.alive())


@pytest.mark.parametrize("switching", [False, True])
def test_fast_formulation_matches_per_worker_reference(switching):
    rng = random.Random(20261121 + switching)
    for _ in range(40):
        profiles, workers, load = random_instance(rng, switching=switching)
        weight = rng.uniform(0.5, 5.0) if switching else 0.0
        exact = highs_solver(rel_gap=1e-9)
        fast = solve(profiles, Strategy.SM, workers, load, switch_cost_weight=weight, backend=exact)
        reference = solve_per_worker(
            profiles, Strategy.SM, workers, load, switch_cost_weight=weight, backend=exact
        )
        assert fast.objective == pytest.approx(reference.objective, rel=1e-6, abs=1e-6)
        assert fast.shortfall_qpm == pytest.approx(reference.shortfall_qpm)
        check_feasible(fast, profiles, workers)
        check_feasible(reference, profiles, workers)


def test_overload_serves_capacity_at_fastest_level_and_reports_shortfall():
    profiles = default_profiles()
    workers = ClusterView.uniform(8)
    capacity = 8 * profiles.profile("a100", "ac-k25").throughput_qpm
    allocation = solve(profiles, Strategy.AC, workers, 3 * capacity)
    assert allocation.workers_per_level == (0, 0, 0, 0, 0, 8)
    assert allocation.served_qpm == pytest.approx(capacity)
    assert allocation.shortfall_qpm == pytest.approx(2 * capacity)
    assert allocation.saturated


def test_light_and_zero_load_use_the_best_level_everywhere():
    profiles = default_profiles()
    for load in (0.0, 40.0):
        allocation = solve(profiles, Strategy.AC, ClusterView.uniform(8), load)
        assert allocation.workers_per_level == (8, 0, 0, 0, 0, 0)
        assert allocation.load_share_qpm[0] == pytest.approx(load)
        assert not allocation.saturated


def test_quality_falls_as_load_rises():
    profiles = default_profiles()
    objectives = [
        solve(profiles, Strategy.AC, ClusterView.uniform(8), load).objective / load
        for load in (50.0, 120.0, 160.0, 200.0)
    ]
    assert objectives == sorted(objectives, reverse=True)
    assert objectives[0] > objectives[-1]


def test_dead_workers_are_planned_around():
    profiles = default_profiles()
    workers = ClusterView.uniform(8)
    half_dead = ClusterView(
        tuple(
            WorkerState(w.worker_id, w.worker_class, alive=i % 2 == 0)
            for i, w in enumerate(workers.workers)
        )
    )
    full = solve(profiles, Strategy.AC, workers, 150.0)
    degraded = solve(profiles, Strategy.AC, half_dead, 150.0)
    assert set(degraded.assignment) == {"w0", "w2", "w4", "w6"}
    assert degraded.objective < full.objective
    # four A100s at K=25 serve about 112 QPM: the rest is shortfall
    assert degraded.shortfall_qpm == pytest.approx(150.0 - 4 * 60 / 2.15)


def test_worker_classes_get_their_own_throughput():
    profiles = make_profiles({"slow": [10.0, 20.0], "fast": [30.0, 60.0]}, [1.0, 0.8])
    workers = ClusterView.by_class({"slow": 1, "fast": 1})
    allocation = solve(profiles, Strategy.AC, workers, 45.0)
    # best: fast GPU at the best level (30 QPM, Q=1), slow one at its fast level (15 of 20 QPM);
    # the other way round gives 35 * 0.8 + 10 = 38
    assert allocation.assignment == {"fast-0": "ac-0", "slow-0": "ac-1"}
    assert allocation.objective == pytest.approx(30.0 + 0.8 * 15.0)


def test_switching_cost_keeps_a_plan_unless_the_gain_pays():
    profiles = default_profiles()
    first = solve(profiles, Strategy.SM, ClusterView.uniform(8), 150.0)
    running = ClusterView(
        tuple(WorkerState(w, "a100", level=level) for w, level in sorted(first.assignment.items()))
    )
    lighter = 120.0
    free = solve(profiles, Strategy.SM, running, lighter, switch_cost_weight=0.0)
    costly = solve(profiles, Strategy.SM, running, lighter, switch_cost_weight=1000.0)
    assert free.moved_workers > 0
    assert costly.moved_workers == 0
    assert costly.switch_cost == 0.0
    # the same plan under a small cost moves only if the quality gained exceeds the charge
    cheap = solve(profiles, Strategy.SM, running, lighter, switch_cost_weight=0.01)
    assert cheap.objective >= costly.objective - 1e-9


def test_k_changes_on_the_same_model_are_free():
    profiles = default_profiles()
    running = ClusterView(tuple(WorkerState(f"w{i}", "a100", level="ac-k25") for i in range(8)))
    allocation = solve(profiles, Strategy.AC, running, 60.0, switch_cost_weight=1000.0)
    assert allocation.workers_per_level[0] == 8
    assert allocation.switch_cost == 0.0
    assert allocation.moved_workers == 8


def test_unplaced_workers_are_not_charged():
    profiles = default_profiles()
    fresh = solve(profiles, Strategy.SM, ClusterView.uniform(8), 100.0, switch_cost_weight=5.0)
    assert fresh.switch_cost == 0.0
    assert fresh.moved_workers == 0


def test_spare_workers_take_the_best_level_of_their_model():
    profiles = default_profiles()
    running = ClusterView(
        (
            WorkerState("w0", "a100", level="ac-k20"),
            WorkerState("w1", "a100", level="ac-k10"),
        )
    )
    allocation = solve(profiles, Strategy.AC, running, 5.0, switch_cost_weight=1.0)
    assert allocation.assignment == {"w0": "ac-k0", "w1": "ac-k0"}
    # an SM spare holding a small model keeps it rather than loading SDXL for no load
    running = ClusterView(
        (
            WorkerState("w0", "a100", level="sm-sd-xl"),
            WorkerState("w1", "a100", level="sm-small-sd"),
        )
    )
    allocation = solve(profiles, Strategy.SM, running, 5.0, switch_cost_weight=1.0)
    assert allocation.assignment == {"w0": "sm-sd-xl", "w1": "sm-small-sd"}
    assert allocation.moved_workers == 0


def test_backend_is_a_parameter():
    profiles = default_profiles()
    made = []

    def backend():
        made.append(1)
        return pulp.HiGHS(msg=False, threads=1)

    chosen = solve(profiles, Strategy.AC, ClusterView.uniform(8), 150.0, backend=backend)
    default = solve(profiles, Strategy.AC, ClusterView.uniform(8), 150.0)
    assert made  # the factory is what the solve used (relaxation and ILP)
    assert chosen.objective == pytest.approx(default.objective, rel=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load_qpm": -1.0}, "load_qpm"),
        ({"load_qpm": float("nan")}, "load_qpm"),
        ({"load_qpm": 10.0, "switch_cost_weight": -1.0}, "switch_cost_weight"),
        ({"load_qpm": 10.0, "period_s": 0.0}, "period_s"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        solve(default_profiles(), Strategy.AC, ClusterView.uniform(2), **kwargs)


def test_unknown_worker_class_is_named():
    with pytest.raises(ValueError, match=r"'x0'.*'tpu'"):
        solve(default_profiles(), Strategy.AC, ClusterView((WorkerState("x0", "tpu"),)), 10.0)


def test_no_live_worker_means_everything_is_shortfall():
    workers = ClusterView((WorkerState("w0", "a100", alive=False),))
    allocation = solve(default_profiles(), Strategy.AC, workers, 30.0)
    assert allocation.assignment == {}
    assert allocation.shortfall_qpm == 30.0


@pytest.mark.parametrize("switching", [False, True])
def test_default_gap_stays_within_tolerance_of_the_exact_optimum(switching):
    """The default backend may return a certified rounding of the LP relaxation: it must be
    feasible, never claim more than the exact optimum, and lose at most the 1e-3 gap."""
    rng = random.Random(77 + switching)

    def exact():  # no gapRel attribute, so the ILP always runs: an independent reference
        return pulp.HiGHS(msg=False, mip_rel_gap=1e-9)

    for _ in range(30):
        profiles, workers, load = random_instance(rng, max_workers=40, switching=switching)
        weight = rng.uniform(0.5, 5.0) if switching else 0.0
        quick = solve(profiles, Strategy.SM, workers, load, switch_cost_weight=weight)
        best = solve(profiles, Strategy.SM, workers, load, switch_cost_weight=weight, backend=exact)
        check_feasible(quick, profiles, workers)
        assert quick.objective <= best.objective + 1e-6
        assert quick.objective >= best.objective - 1e-3 * max(1.0, abs(best.objective)) - 1e-6


def _named_one_at_a_time(problem: Any, counts: Any) -> dict[str, str]:
    """The naming :func:`argus.allocator.allocation_problem.assign_workers` must match: each
    worker in id order takes the first level it fits with a slot of its class left (its own
    level, then its model's levels, then any level), spares the best level of the model they
    hold."""
    slots = dict(counts.workers)
    levels = problem.levels
    assignment: dict[str, str] = {}
    pending = sorted(problem.live, key=lambda w: w.worker_id)
    passes = (
        lambda w: [v for v, lv in enumerate(levels) if lv.name == w.level],
        lambda w: [v for v, lv in enumerate(levels) if lv.model == problem.current_model(w)],
        lambda w: list(range(len(levels))),
    )
    for fitting in passes:
        left = []
        for worker in pending:
            free = [v for v in fitting(worker) if slots.get((worker.worker_class, v), 0) > 0]
            if free:
                slots[worker.worker_class, free[0]] -= 1
                assignment[worker.worker_id] = levels[free[0]].name
            else:
                left.append(worker)
        pending = left
    for worker in pending:
        held = [lv.name for lv in levels if lv.model == problem.current_model(worker)]
        assignment[worker.worker_id] = held[0] if held else levels[0].name
    return assignment


@pytest.mark.parametrize("in_turn_up_to", [0, 64], ids=["ranked", "in-turn"])
@pytest.mark.parametrize("seed", range(40))
def test_workers_are_named_as_one_at_a_time_would(
    seed: int, in_turn_up_to: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both namings (numpy's rankings, and one worker at a time below ``IN_TURN_UP_TO``)
    give every worker the level the sequential rule gives it, on random clusters (several
    classes and models, workers at a level or at none, more or fewer slots than workers)."""
    from collections import Counter

    from argus.allocator import allocation_problem
    from argus.allocator.allocation_problem import Counts, Problem, assign_workers

    monkeypatch.setattr(allocation_problem, "IN_TURN_UP_TO", in_turn_up_to)
    rng = random.Random(seed)
    profiles, view, _ = random_instance(rng, max_workers=40, switching=True)
    live = view.alive()
    if not live:
        return
    levels = profiles.levels_for(Strategy.SM)
    problem = Problem(Strategy.SM, levels, profiles, live, 0.0, 0.0, 1.0, 60.0)
    classes = sorted({w.worker_class for w in live})
    counts = Counts.empty()
    counts.workers = Counter(
        {(c, v): rng.randint(0, 4) for c in classes for v in range(len(levels))}
    )
    assert assign_workers(problem, counts) == _named_one_at_a_time(problem, counts)
