"""The paper's Eq. 1: how many workers run each level, and the load each level gets.

Implements Argus Eq. 1 (§4.2): maximise the quality-weighted load Σ_v Q_v·F(v) subject to the
load W_t being served, each worker's load bounded by the peak throughput P_th of the level it
runs, and at most one level per worker. Eq. 1's product x·y is linearised the usual way: a
load variable per (level, worker) bounded by P_th·x.

Two formulations reach the same optimum:

* :func:`solve` (the one Argus runs) counts workers: workers of one class are interchangeable,
  so it decides integers n[c, v] (workers of class c at level v) and loads f[c, v] ≤ P_th·n.
  Its size is classes × levels whatever the cluster size.
* :func:`solve_per_worker` is the paper's literal per-worker binary program, kept as the
  reference the tests compare against.

Both decide worker counts per (class, level); the problem they read, the counts and the
naming of workers from counts are shared with the joint program
(:mod:`argus.allocator.allocation_problem`).

Beyond the paper:

* **Overload is not an error.** The solver serves min(W_t, capacity), where capacity is every
  live worker at its fastest level, and reports the rest as ``shortfall_qpm``, the cue to scale
  out (§5.3). A load of zero gives every worker the best level.
* **Switching cost** (the paper's future work, §6), off unless ``switch_cost_weight > 0``:
  each worker that must load a model it does not hold is charged the quality-weighted work it
  forgoes while loading, ``weight · load_time/period · max_v∈model(Q_v·P_th)``, in the
  objective's own unit (quality × QPM). A K change on the same model costs nothing.
* **Spare workers.** Workers the optimum leaves without load take the best level of the model
  they hold (a K change, no reload), else the strategy's best level, so they add headroom where
  quality is highest.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import pulp

from argus import defaults
from argus.allocator.allocation_problem import (
    Counts,
    InfeasiblePlanError,
    Problem,
    assign_workers,
    rounded_switch_cost,
)
from argus.types import Allocation, ClusterView, ProfileSet, Strategy, WorkerState

SolverFactory = Callable[[], pulp.LpSolver]


def highs_solver(time_limit_s: float = 30.0, rel_gap: float = 1e-3) -> SolverFactory:
    """The default backend: HiGHS through its Python API (``highspy``).

    ``rel_gap`` is the relative optimality gap at which branch-and-bound stops: 1e-3 means
    within 0.1% of the best quality-weighted throughput, far below the uncertainty of profiled
    quality values, and it cuts the solve-time tail several-fold (``benchmarks/bench_solver.py``).
    Tests pass 1e-9 to compare formulations exactly. Feasibility jump is off: the program
    is always feasible, so that heuristic only costs time (about 4 ms a solve here).
    """
    return lambda: pulp.HiGHS(
        msg=False,
        timeLimit=time_limit_s,
        gapRel=rel_gap,
        mip_heuristic_run_feasibility_jump=False,
    )


def solve(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    load_qpm: float,
    *,
    switch_cost_weight: float = 0.0,
    period_s: float = defaults.PLANNING_PERIOD_S,
    backend: SolverFactory | None = None,
    caps: Mapping[tuple[str, str], float] | None = None,
) -> Allocation:
    """Plan the live workers of ``workers`` for ``load_qpm`` (Eq. 1, aggregated by class).

    Called by the allocator every period and on events. Returns an :class:`Allocation` naming a
    level for every live worker; dead workers are left out. ``caps`` bounds the utilisation of
    each (worker class, level) (:mod:`argus.allocator.queueing`); 1 where absent.
    """
    problem = _prepare(
        profiles, strategy, workers, load_qpm, switch_cost_weight, period_s, caps or {}
    )
    return _solve_with(_solve_counts, problem, backend)


def solve_per_worker(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    load_qpm: float,
    *,
    switch_cost_weight: float = 0.0,
    period_s: float = defaults.PLANNING_PERIOD_S,
    backend: SolverFactory | None = None,
) -> Allocation:
    """The paper's per-worker binary formulation of Eq. 1; the reference for :func:`solve`."""
    problem = _prepare(profiles, strategy, workers, load_qpm, switch_cost_weight, period_s, {})
    return _solve_with(_solve_counts_per_worker, problem, backend)


def _solve_with(
    formulation: Callable[[Problem, SolverFactory], Counts],
    problem: Problem,
    backend: SolverFactory | None,
) -> Allocation:
    started = time.perf_counter()
    counts = formulation(problem, backend or highs_solver())
    assignment = assign_workers(problem, counts)
    return _allocation(problem, counts, assignment, started)


def _solve_counts_per_worker(problem: Problem, backend: SolverFactory) -> Counts:
    """The literal program: binaries x[w, v], loads y[w, v] <= P_th * x[w, v]."""
    prob = pulp.LpProblem("argus_eq1_per_worker", pulp.LpMaximize)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    y: dict[tuple[int, int], pulp.LpVariable] = {}
    for w, worker in enumerate(problem.live):
        for v, level in enumerate(problem.levels):
            x[w, v] = prob.add_variable(f"x_{v}_{w}", cat=pulp.LpBinary)
            y[w, v] = prob.add_variable(f"y_{v}_{w}", lowBound=0.0)
            prob += y[w, v] <= problem.throughput(worker.worker_class, level) * x[w, v]
        prob += pulp.lpSum(x[w, v] for v in range(len(problem.levels))) <= 1
    prob += pulp.lpSum(y.values()) == problem.served_qpm
    prob += pulp.lpSum(
        problem.levels[v].quality * y[w, v] - _worker_load_cost(problem, worker, v) * x[w, v]
        for w, worker in enumerate(problem.live)
        for v in range(len(problem.levels))
    )
    _run(prob, backend)
    counts = Counts.empty()
    for (w, v), var in x.items():
        if (var.value() or 0.0) > 0.5:
            worker = problem.live[w]
            counts.workers[worker.worker_class, v] += 1
            counts.load[worker.worker_class, v] += max(0.0, y[w, v].value() or 0.0)
            counts.switch_cost += _worker_load_cost(problem, worker, v)
    return counts


def _worker_load_cost(problem: Problem, worker: WorkerState, v: int) -> float:
    """What moving ``worker`` to level ``v`` costs given the model it holds."""
    model = problem.levels[v].model
    return problem.move_cost(worker.worker_class, model, problem.current_model(worker))


def _prepare(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    load_qpm: float,
    switch_cost_weight: float,
    period_s: float,
    caps: Mapping[tuple[str, str], float],
) -> Problem:
    if not load_qpm >= 0.0 or load_qpm == float("inf"):
        raise ValueError(f"load_qpm: must be a finite number >= 0, got {load_qpm}")
    if not switch_cost_weight >= 0.0:
        raise ValueError(f"switch_cost_weight: must be >= 0, got {switch_cost_weight}")
    if not period_s > 0.0:
        raise ValueError(f"period_s: must be > 0, got {period_s}")
    levels = profiles.levels_for(strategy)
    if not levels:
        raise ValueError(f"strategy: the profile set has no {strategy.value} levels")
    live = workers.alive()
    for worker in live:
        if worker.worker_class not in profiles.worker_classes:
            raise ValueError(
                f"worker {worker.worker_id!r}: unknown worker class {worker.worker_class!r}; "
                f"the profiles know {', '.join(profiles.worker_classes)}"
            )
    problem = Problem(
        strategy, levels, profiles, live, load_qpm, 0.0, switch_cost_weight, period_s, caps
    )
    capacity = sum(max(problem.throughput(w.worker_class, lv) for lv in levels) for w in live)
    return replace(problem, served_qpm=min(load_qpm, capacity))


def _solve_counts(problem: Problem, backend: SolverFactory) -> Counts:
    """The aggregated ILP: integers n[c, v], loads f[c, v], model loads u[c, model].

    First the LP relaxation, then its rounding: when the rounded plan is within the backend's
    relative gap of the LP bound it is returned as is (the bound certifies it), which skips
    HiGHS's root cut rounds, the slow part on multi-class instances. Otherwise the ILP runs.
    """
    live_by_class = Counter(w.worker_class for w in problem.live)
    classes = sorted(live_by_class)
    level_ids = range(len(problem.levels))
    prob = pulp.LpProblem("argus_eq1", pulp.LpMaximize)
    n = {
        (c, v): prob.add_variable(f"n_{c}_{v}", 0, live_by_class[c], cat=pulp.LpInteger)
        for c in classes
        for v in level_ids
    }
    f = {(c, v): prob.add_variable(f"f_{c}_{v}", lowBound=0.0) for c in classes for v in level_ids}
    for (c, v), load in f.items():
        prob += load <= problem.throughput(c, problem.levels[v]) * n[c, v]
    for c in classes:
        prob += pulp.lpSum(n[c, v] for v in level_ids) <= live_by_class[c]
    prob += pulp.lpSum(f.values()) == problem.served_qpm
    cost_terms = _switch_cost_terms(problem, prob, n, classes)
    prob += pulp.lpSum(problem.levels[v].quality * f[c, v] for c, v in f) - cost_terms
    relaxed = backend()
    rounded = _certified_rounding(problem, prob, n, relaxed, live_by_class)
    if rounded is not None:
        return rounded
    _run(prob, backend)
    counts = Counts.empty()
    for key in n:
        counts.workers[key] = round(n[key].value() or 0.0)
        counts.load[key] = max(0.0, f[key].value() or 0.0)
    counts.switch_cost = float(pulp.value(cost_terms)) if problem.switch_cost_weight else 0.0
    return counts


def _certified_rounding(
    problem: Problem,
    prob: pulp.LpProblem,
    n: Mapping[tuple[str, int], pulp.LpVariable],
    solver: pulp.LpSolver,
    live_by_class: Mapping[str, int],
) -> Counts | None:
    """Round the LP relaxation; return it if within the solver's gap of the bound, else None.

    Only for backends that declare their gap as ``gapRel`` (PuLP's HiGHS does); any other
    backend always gets the full ILP.
    """
    rel_gap = getattr(solver, "gapRel", None)
    if not isinstance(rel_gap, float) or rel_gap <= 0.0 or not hasattr(solver, "mip"):
        return None
    solver.mip = False
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    bound = float(pulp.value(prob.objective))
    floors = Counter({key: math.floor((var.value() or 0.0) + 1e-9) for key, var in n.items()})
    rounded = _place_leftovers(problem, floors, live_by_class)
    if rounded is None:
        return None
    objective = sum(problem.levels[v].quality * qpm for (_, v), qpm in rounded.load.items())
    if objective - rounded.switch_cost < bound - rel_gap * max(1.0, abs(bound)):
        return None
    return rounded


def _place_leftovers(
    problem: Problem, workers: Counter[tuple[str, int]], live_by_class: Mapping[str, int]
) -> Counts | None:
    """Add the workers the floored relaxation left out, one at a time, where they gain most."""
    best = _evaluate(problem, workers)
    while True:
        used = Counter[str]()
        for (c, _), count in workers.items():
            used[c] += count
        candidates = [
            (c, v)
            for c in live_by_class
            if used[c] < live_by_class[c]
            for v in range(len(problem.levels))
        ]
        scored = []
        for key in candidates:
            trial = Counter(workers)
            trial[key] += 1
            scored.append((_evaluate(problem, trial), key))
        if not scored:
            break
        (score, key) = max(scored, key=lambda item: item[0][:2])
        if best[0] == 0 and score[:2] <= best[:2]:
            break  # feasible and no candidate improves
        workers[key] += 1
        best = score
    if best[0] < 0:
        return None
    counts = Counts.empty()
    counts.workers.update(workers)
    counts.load.update(best[2])
    counts.switch_cost = best[3]
    return counts


def _evaluate(
    problem: Problem, workers: Counter[tuple[str, int]]
) -> tuple[int, float, dict[tuple[str, int], float], float]:
    """Score integer counts: (-1 if short of capacity else 0, objective, loads, switch cost).

    Loads fill the levels best first, which is optimal for fixed counts.
    """
    remaining = problem.served_qpm
    loads: dict[tuple[str, int], float] = {}
    value = 0.0
    for (c, v), count in sorted(workers.items(), key=lambda item: (item[0][1], item[0][0])):
        if count <= 0:
            continue
        level = problem.levels[v]
        take = min(remaining, count * problem.throughput(c, level))
        loads[c, v] = take
        value += level.quality * take
        remaining -= take
    cost = rounded_switch_cost(problem, workers)
    feasible = remaining <= 1e-9 * max(1.0, problem.served_qpm)
    return (0 if feasible else -1, value - cost, loads, cost)


def _switch_cost_terms(
    problem: Problem,
    prob: pulp.LpProblem,
    n: Mapping[tuple[str, int], pulp.LpVariable],
    classes: Sequence[str],
) -> pulp.LpAffineExpression:
    """Add the model-load variables and return the switching cost to subtract.

    ``u[c, m]`` counts workers of class c that load model m whole, ``p[c, m]`` those that come
    from another model of m's family and load only what it does not share (its UNet within
    the SD-1.x family, :meth:`Problem.family_load_cost`): together at least those on m minus
    those already holding it, and a family's growth (Σ on − Σ holding over its members) must
    be whole loads. Workers holding nothing yet are being placed, not moved: up to their
    number of whole loads per class go uncharged (``free``), the costliest first by
    optimality.
    """
    if problem.switch_cost_weight == 0.0:
        return pulp.LpAffineExpression()
    holding = problem.holding
    models = sorted({level.model for level in problem.levels})
    families = sorted(
        {problem.families[m] for m in models if len(problem.families[m]) > 1}, key=sorted
    )
    terms = []
    for c in classes:
        free_loads = []
        whole = {}
        for model in models:
            u = prob.add_variable(f"u_{c}_{model}", lowBound=0.0)
            free = prob.add_variable(f"free_{c}_{model}", lowBound=0.0)
            on_model = [v for v, level in enumerate(problem.levels) if level.model == model]
            moved = u
            part_cost = problem.family_load_cost(c, model)
            if part_cost < problem.load_cost(c, model):
                p = prob.add_variable(f"p_{c}_{model}", lowBound=0.0)
                moved = u + p
                terms.append(part_cost * p)
            prob += moved >= pulp.lpSum(n[c, v] for v in on_model) - holding[c, model]
            prob += free <= u
            free_loads.append(free)
            whole[model] = u
            terms.append(problem.load_cost(c, model) * (u - free))
        for family in families:
            on_family = [v for v, level in enumerate(problem.levels) if level.model in family]
            prob += pulp.lpSum(whole[m] for m in family) >= pulp.lpSum(
                n[c, v] for v in on_family
            ) - sum(holding[c, m] for m in family)
        prob += pulp.lpSum(free_loads) <= holding[c, None]
    return pulp.lpSum(terms)


def _run(prob: pulp.LpProblem, backend: SolverFactory) -> None:
    prob.solve(backend())
    if pulp.LpStatus[prob.status] != "Optimal":
        raise InfeasiblePlanError(f"ILP {prob.name}: backend ended {pulp.LpStatus[prob.status]}")


def _allocation(
    problem: Problem, counts: Counts, assignment: Mapping[str, str], started: float
) -> Allocation:
    names = tuple(level.name for level in problem.levels)
    per_level = Counter(assignment.values())
    load = [0.0] * len(names)
    for (_, v), qpm in counts.load.items():
        load[v] += qpm
    quality = sum(level.quality * qpm for level, qpm in zip(problem.levels, load, strict=True))
    moved = sum(
        1 for w in problem.live if w.level is not None and assignment[w.worker_id] != w.level
    )
    return Allocation(
        strategy=problem.strategy,
        levels=names,
        workers_per_level=tuple(per_level[name] for name in names),
        load_share_qpm=tuple(load),
        assignment=dict(assignment),
        objective=quality - counts.switch_cost,
        switch_cost=counts.switch_cost,
        served_qpm=problem.served_qpm,
        shortfall_qpm=max(0.0, problem.load_qpm - problem.served_qpm),
        moved_workers=moved,
        solve_ms=(time.perf_counter() - started) * 1000.0,
    )
