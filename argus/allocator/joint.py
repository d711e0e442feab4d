"""The joint program: how many workers run each level, and which prompts each level serves.

The paper plans in two steps: Eq. 1 picks workers per level with each level's *average*
quality, then ODA (Algorithm 1) shifts prompts between the levels Eq. 1 chose. Averages fall
off a cliff after the first approximate level, so Eq. 1 picks the same two-ended mix a
prompt-agnostic planner picks, and ODA can only shuffle prompts inside it. This module solves
both steps as one mixed-integer program over (prompt class × level)::

    maximise   Σ_c Σ_v Q(v | c) · x[c, v]  −  switching cost
    subject to Σ_v x[c, v]            = H_c · W          every class c (its share of the load)
               Σ_c x[c, v]            ≤ Σ_g u[g, v] · P_th[g, v] · n[g, v]     every level v
               Σ_v n[g, v]            ≤ N_g              every worker class (GPU type) g
               n[g, v] integer ≥ 0,   x[c, v] ≥ 0

where x[c, v] is the load (QPM) of prompt class c served at level v, W the load served
(min of the forecast and what the cluster can take), H the class histogram, Q(v | c) the
quality measured per class on a calibration split (``ClassQuality``), u the utilisation cap
from queueing (:mod:`argus.allocator.queueing`) and P_th the peak throughput. The PASM is x
row by row: ``P(v | c) = x[c, v] / (H_c · W)``. With one row of Q for every class the program
is Eq. 1 itself.

The switching cost is :mod:`argus.allocator.solver`'s: a worker that must load a model it
does not hold is charged the quality-weighted work it forgoes while loading.

Solved with HiGHS through ``highspy`` directly (no modelling layer: the model is a handful of
numpy arrays), to a relative gap of 1e-3 by default.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import highspy
import numpy as np
import numpy.typing as npt

from argus.allocator.solver import (
    InfeasiblePlanError,
    _assign_workers,
    _Counts,
    _Problem,
    _rounded_switch_cost,
)
from argus.types import Allocation, ClassQuality, ClusterView, Level, ProfileSet, ShiftMap, Strategy

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HighsOptions:
    """How HiGHS solves the joint program."""

    rel_gap: float = 1e-2
    """Relative optimality gap at which a rounding is accepted and branch and bound stops
    (tests pass 1e-9). Q(v | c) is measured on a few dozen calibration prompts per class,
    with a standard error of a few percent, so a 1% gap is below what Q can tell apart."""

    time_limit_s: float = 0.1
    """Branch and bound stops here and keeps its best solution, at worst the rounding."""


@dataclass(frozen=True)
class JointPlan:
    """The joint program's answer: the allocation and the PASM it implies."""

    allocation: Allocation
    shift_map: ShiftMap  # row c: P(level | class c)
    class_load_qpm: tuple[tuple[float, ...], ...]  # x[c][v]
    capacity_qpm: tuple[float, ...]  # per level: Σ_g u·P_th·n, what the level may take


NO_INCUMBENT_LIMIT_S = 10.0  # branch-and-bound time when the rounding is infeasible

Caps = Mapping[tuple[str, str], float]  # (worker class, level name) → utilisation cap in [0, 1]


def solve_joint(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    load_qpm: float,
    class_quality: ClassQuality,
    histogram: Sequence[float],
    *,
    caps: Caps | None = None,
    switch_cost_weight: float = 0.0,
    period_s: float = 60.0,
    options: HighsOptions | None = None,
) -> JointPlan:
    """Plan the live ``workers`` for ``load_qpm`` spread over prompt classes as ``histogram``.

    Called by the planner every period and on events. ``caps`` bounds each level's
    utilisation per worker class (1 when absent). Returns every live worker's level, the load
    per level, and the PASM.
    """
    started = time.perf_counter()
    levels = profiles.levels_for(strategy)
    if class_quality.levels != tuple(level.name for level in levels):
        raise ValueError(
            f"class_quality: levels {', '.join(class_quality.levels)} differ from the "
            f"{strategy.value} levels {', '.join(level.name for level in levels)}"
        )
    weights = _histogram(histogram, len(levels))
    live = workers.alive()
    _check_classes(profiles, live)
    rate = _effective_rates(profiles, levels, live, caps or {})
    live_by_class = Counter(w.worker_class for w in live)
    capacity = sum(count * max(rate[g]) for g, count in live_by_class.items())
    if not (math.isfinite(load_qpm) and load_qpm >= 0.0):
        raise ValueError(f"load_qpm: must be a finite number >= 0, got {load_qpm}")
    served = min(load_qpm, capacity)
    problem = _Problem(
        strategy,
        _with_mean_quality(levels, class_quality, weights),
        profiles,
        live,
        load_qpm,
        served,
        switch_cost_weight,
        period_s,
    )
    counts, x = _solve(problem, class_quality, weights, rate, live_by_class, options)
    assignment = _assign_workers(problem, counts)
    shift = _shift_map(class_quality, levels, x, weights, served, counts)
    per_level = Counter(assignment.values())
    names = tuple(level.name for level in levels)
    load = tuple(float(x[:, v].sum()) for v in range(len(levels)))
    level_capacity = tuple(
        sum(rate[g][v] * counts.workers[g, v] for g in live_by_class) for v in range(len(levels))
    )
    quality = np.asarray(class_quality.quality, dtype=np.float64)
    value = float((quality * x).sum())
    allocation = Allocation(
        strategy=strategy,
        levels=names,
        workers_per_level=tuple(per_level[name] for name in names),
        load_share_qpm=load,
        assignment=assignment,
        objective=value - counts.switch_cost,
        switch_cost=counts.switch_cost,
        served_qpm=served,
        shortfall_qpm=max(0.0, load_qpm - served),
        moved_workers=sum(
            1 for w in live if w.level is not None and assignment[w.worker_id] != w.level
        ),
        solve_ms=(time.perf_counter() - started) * 1000.0,
    )
    return JointPlan(allocation, shift, tuple(tuple(row) for row in x.tolist()), level_capacity)


def _histogram(histogram: Sequence[float], count: int) -> FloatArray:
    values = np.asarray(histogram, dtype=np.float64)
    if values.shape != (count,):
        raise ValueError(f"histogram: expected {count} values (one per class), got {len(values)}")
    if not np.all(np.isfinite(values)) or np.any(values < 0.0):
        raise ValueError(f"histogram: values must be finite and >= 0, got {list(histogram)}")
    total = values.sum()
    result: FloatArray = values / total if total > 0 else np.full(count, 1.0 / count)
    return result


def _check_classes(profiles: ProfileSet, live: Sequence[object]) -> None:
    for worker in live:
        worker_class = getattr(worker, "worker_class", "")
        if worker_class not in profiles.worker_classes:
            raise ValueError(
                f"worker {getattr(worker, 'worker_id', '?')!r}: unknown worker class "
                f"{worker_class!r}; the profiles know {', '.join(profiles.worker_classes)}"
            )


def _effective_rates(
    profiles: ProfileSet, levels: Sequence[Level], live: Sequence[object], caps: Caps
) -> dict[str, list[float]]:
    """Per worker class, the QPM one worker may be planned for at each level: u · P_th."""
    rates: dict[str, list[float]] = {}
    for g in sorted({getattr(w, "worker_class", "") for w in live}):
        rates[g] = [
            caps.get((g, level.name), 1.0) * profiles.profile(g, level.name).throughput_qpm
            for level in levels
        ]
    return rates


def _with_mean_quality(
    levels: Sequence[Level], class_quality: ClassQuality, weights: FloatArray
) -> tuple[Level, ...]:
    """The levels with Q = the histogram-weighted mean of Q(v | c): what one worker at the
    level is worth, for the switching cost and for spare workers."""
    quality = np.asarray(class_quality.quality, dtype=np.float64)
    mean = weights @ quality
    return tuple(
        Level(lv.name, lv.strategy, lv.model, lv.skip_steps, float(q))
        for lv, q in zip(levels, mean, strict=True)
    )


class _Columns:
    """Column bookkeeping of the HiGHS model."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []

    def add(self, cost: float, lower: float, upper: float, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1


class _Rows:
    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.entries: list[tuple[int, int, float]] = []  # (row, column, value)

    def add(self, terms: Sequence[tuple[int, float]], lower: float, upper: float) -> None:
        row = len(self.lower)
        self.lower.append(lower)
        self.upper.append(upper)
        self.entries.extend((row, column, value) for column, value in terms)


def _solve(
    problem: _Problem,
    class_quality: ClassQuality,
    weights: FloatArray,
    rate: Mapping[str, Sequence[float]],
    live_by_class: Mapping[str, int],
    options: HighsOptions | None,
) -> tuple[_Counts, FloatArray]:
    """Build and solve the program; return integer worker counts and x[c, v]."""
    options = options or HighsOptions()
    n_levels = len(problem.levels)
    classes = [c for c in range(n_levels) if weights[c] > 0.0]
    quality = class_quality.quality
    cols, rows = _Columns(), _Rows()
    inf = highspy.kHighsInf
    n = {
        (g, v): cols.add(0.0, 0.0, float(live_by_class[g]), integer=True)
        for g in sorted(live_by_class)
        for v in range(n_levels)
    }
    x = {(c, v): cols.add(quality[c][v], 0.0, inf) for c in classes for v in range(n_levels)}
    for g in sorted(live_by_class):
        rows.add([(n[g, v], 1.0) for v in range(n_levels)], -inf, float(live_by_class[g]))
    for v in range(n_levels):
        terms = [(x[c, v], 1.0) for c in classes]
        terms += [(n[g, v], -rate[g][v]) for g in sorted(live_by_class)]
        rows.add(terms, -inf, 0.0)
    for c in classes:
        mass = float(weights[c]) * problem.served_qpm
        rows.add([(x[c, v], 1.0) for v in range(n_levels)], mass, mass)
    _switch_cost(problem, cols, rows, n, live_by_class)
    values = _round_then_certify(cols, rows, n, live_by_class, options)
    counts = _Counts.empty()
    for key, column in n.items():
        counts.workers[key] = round(values[column])
    counts.switch_cost = _rounded_switch_cost(problem, counts.workers)
    loads = np.zeros((n_levels, n_levels))
    for (c, v), column in x.items():
        loads[c, v] = max(0.0, values[column])
    _split_by_class(counts, loads, rate, live_by_class)
    return counts, loads


def _switch_cost(
    problem: _Problem,
    cols: _Columns,
    rows: _Rows,
    n: Mapping[tuple[str, int], int],
    live_by_class: Mapping[str, int],
) -> None:
    """Model loads: u[g, m] ≥ Σ_{v on m} n[g, v] − holding; up to the idle workers' number of
    loads per class go free (placing a worker that holds nothing is not moving it)."""
    if problem.switch_cost_weight == 0.0:
        return
    inf = highspy.kHighsInf
    holding = problem.holding
    models = sorted({level.model for level in problem.levels})
    for g in sorted(live_by_class):
        frees = []
        for model in models:
            cost = problem.load_cost(g, model)
            u = cols.add(-cost, 0.0, inf)
            free = cols.add(cost, 0.0, inf)
            on_model = [v for v, level in enumerate(problem.levels) if level.model == model]
            rows.add([(n[g, v], 1.0) for v in on_model] + [(u, -1.0)], -inf, holding[g, model])
            rows.add([(free, 1.0), (u, -1.0)], -inf, 0.0)
            frees.append(free)
        rows.add([(f, 1.0) for f in frees], -inf, float(holding[g, None]))


def _round_then_certify(
    cols: _Columns,
    rows: _Rows,
    n: Mapping[tuple[str, int], int],
    live_by_class: Mapping[str, int],
    options: HighsOptions,
) -> FloatArray:
    """Solve the LP relaxation, round its worker counts, and keep the rounding when it is
    within ``rel_gap`` of the relaxation's bound (the bound certifies it); otherwise branch
    and bound from the rounding as the first incumbent.

    Rounding: per worker class, every level keeps the floor of its relaxed count and the
    workers left over go to the levels with the largest fractional parts; the loads are then
    the LP with those counts fixed. Branch and bound is rarely needed on large clusters (one
    worker more or less barely moves the value) and bounded by the time limit on small ones.
    """
    relaxed = _run(cols, rows, options, integer=False)
    if relaxed is None:
        raise InfeasiblePlanError("joint program: the LP relaxation has no solution")
    bound, values = relaxed
    fixed = _rounded_counts(values, n, live_by_class)
    rounded = _run(cols, rows, options, integer=False, fixed=fixed)
    if rounded is not None and rounded[0] >= bound - options.rel_gap * max(1.0, abs(bound)):
        return rounded[1]
    hint = rounded[1] if rounded is not None else None
    if hint is None:  # the rounding lost too much capacity: search longer, there is no fallback
        options = replace(options, time_limit_s=max(options.time_limit_s, NO_INCUMBENT_LIMIT_S))
    exact = _run(cols, rows, options, integer=True, hint=hint)
    if exact is not None:
        return exact[1]
    if hint is not None:
        return hint
    raise InfeasiblePlanError("joint program: branch and bound found no solution")


def _rounded_counts(
    values: FloatArray, n: Mapping[tuple[str, int], int], live_by_class: Mapping[str, int]
) -> dict[int, float]:
    """Column → integer count: floors, then the leftover workers by largest fraction."""
    fixed: dict[int, float] = {}
    for g, total in live_by_class.items():
        columns = [column for (wc, _), column in n.items() if wc == g]
        relaxed = {column: max(0.0, float(values[column])) for column in columns}
        floors = {column: math.floor(value + 1e-9) for column, value in relaxed.items()}
        left = total - sum(floors.values())
        by_fraction = sorted(columns, key=lambda column: relaxed[column] - floors[column])
        while left > 0 and by_fraction:
            column = by_fraction.pop()
            if relaxed[column] - floors[column] <= 1e-9:
                break
            floors[column] += 1
            left -= 1
        fixed.update({column: float(count) for column, count in floors.items()})
    return fixed


def _run(
    cols: _Columns,
    rows: _Rows,
    options: HighsOptions,
    *,
    integer: bool,
    fixed: Mapping[int, float] | None = None,
    hint: FloatArray | None = None,
) -> tuple[float, FloatArray] | None:
    """(objective, column values), or None when HiGHS found no feasible solution."""
    lower = np.asarray(cols.lower, dtype=np.float64)
    upper = np.asarray(cols.upper, dtype=np.float64)
    for column, value in (fixed or {}).items():
        lower[column] = upper[column] = value
    lp = highspy.HighsLp()
    lp.num_col_ = len(cols.cost)
    lp.num_row_ = len(rows.lower)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = np.asarray(cols.cost, dtype=np.float64)
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.asarray(rows.lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(rows.upper, dtype=np.float64)
    entries = sorted(rows.entries, key=lambda e: (e[1], e[0]))  # column-wise
    starts = np.zeros(lp.num_col_ + 1, dtype=np.int32)
    for _, column, _ in entries:
        starts[column + 1] += 1
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.cumsum(starts).astype(np.int32)
    lp.a_matrix_.index_ = np.asarray([e[0] for e in entries], dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray([e[2] for e in entries], dtype=np.float64)
    if integer:
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous
            for flag in cols.integer
        ]
    solver = highspy.Highs()  # type: ignore[no-untyped-call]
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("mip_rel_gap", options.rel_gap)
    solver.setOptionValue("time_limit", options.time_limit_s)
    solver.passModel(lp)
    if hint is not None:
        start = highspy.HighsSolution()
        start.col_value = list(hint)
        solver.setSolution(start)
    solver.run()
    status = solver.getModelStatus()
    solved = status == highspy.HighsModelStatus.kOptimal
    timed_out = (
        status == highspy.HighsModelStatus.kTimeLimit
        and solver.getInfo().primal_solution_status == 2
    )
    if not (solved or timed_out):
        return None
    values = np.asarray(solver.getSolution().col_value, dtype=np.float64)
    return float(solver.getInfo().objective_function_value), values


def _split_by_class(
    counts: _Counts,
    loads: FloatArray,
    rate: Mapping[str, Sequence[float]],
    live_by_class: Mapping[str, int],
) -> None:
    """Each level's load spread over the worker classes in proportion to their capacity."""
    for v in range(loads.shape[1]):
        total = float(loads[:, v].sum())
        capacity = {g: rate[g][v] * counts.workers[g, v] for g in live_by_class}
        room = sum(capacity.values())
        for g, cap in capacity.items():
            if cap > 0.0:
                counts.load[g, v] = total * cap / room


def _shift_map(
    class_quality: ClassQuality,
    levels: Sequence[Level],
    loads: FloatArray,
    weights: FloatArray,
    served: float,
    counts: _Counts,
) -> ShiftMap:
    """Row c of the PASM: x[c, v] / (H_c · W). A class with no planned load (not seen lately,
    or no load at all) goes to its best level among those with planned load, else among those
    with workers."""
    names = tuple(level.name for level in levels)
    n_levels = len(levels)
    open_levels = [v for v in range(n_levels) if loads[:, v].sum() > 0.0]
    if not open_levels:
        open_levels = [v for v in range(n_levels) if any(k == v for (_, k) in +counts.workers)]
    rows = []
    for c in range(n_levels):
        mass = weights[c] * served
        total = float(loads[c].sum())
        if mass > 0.0 and total > 0.0:
            rows.append(tuple(float(value) / total for value in loads[c]))
            continue
        candidates = open_levels or [0]
        best = max(candidates, key=lambda v: (class_quality.quality[c][v], -v))
        rows.append(tuple(1.0 if v == best else 0.0 for v in range(n_levels)))
    return ShiftMap(names, tuple(rows))
