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

The switching cost is Eq. 1's (:mod:`argus.allocator.ilp`): a worker that must load a model it
does not hold is charged the quality-weighted work it forgoes while loading.

Solved with HiGHS through ``highspy`` directly (no modelling layer: the model is a handful of
numpy arrays), on one HiGHS instance per thread, cleared for each solve, to a relative gap of
1e-2 by default:

1. the LP relaxation (presolve off: the program has a few hundred columns at most), from
   the last one's optimal basis when a :class:`JointSolver` solves again under other caps;
2. its worker counts rounded, then repaired until they serve W again (``rounded_counts``);
3. the loads for those counts: the same LP with n fixed, warm from step 1's basis;
4. while that is short of step 1's bound by more than a tenth of the gap, local search:
   add, remove or move one worker, as the reduced costs suggest, each valued as in step 3
   (on up to ``PAIR_MOVES_UP_TO`` workers, two at once when no single move gains), but for
   those that the duals of the LPs solved before show cannot gain (``_Ceiling``);
5. if it is still short of the bound by more than ``HighsOptions.shortcut_gap`` (5%),
   branch and bound from the best counts, within ``HighsOptions.time_limit_s``.

From a few dozen workers up step 5 is all but never needed (one worker barely moves the
value); on a handful of workers the bound is loose, and the shortcut gap keeps step 5 for
the plans that are clearly short (``tests/test_joint.py`` bounds what that costs: within
2% of the exact optimum on random small clusters).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import highspy
import numpy as np
import numpy.typing as npt

from argus import defaults
from argus.allocator.ilp import (
    Counts,
    InfeasiblePlanError,
    Problem,
    chosen_levels,
    moved_workers,
    rounded_switch_cost,
)
from argus.types import Allocation, ClassQuality, ClusterView, Level, ProfileSet, ShiftMap, Strategy

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class HighsOptions:
    """How HiGHS solves the joint program."""

    rel_gap: float = 1e-2
    """Relative optimality gap at which a rounding is accepted and branch and bound stops
    (tests pass 1e-9). Q(v | c) is measured on a few dozen calibration prompts per class,
    with a standard error of a few percent, so a 1% gap is below what Q can tell apart."""

    time_limit_s: float = 0.1
    """Branch and bound stops here and keeps its best solution, at worst the rounding;
    at 0 it runs only when there is no rounding to fall back on, and otherwise the
    rounding improved by local search is the plan."""

    shortcut_gap: float = 0.05
    """The rounding improved by local search is the plan when it is within this share of
    the LP relaxation's bound, without branch and bound (``rel_gap`` still sets where the
    search stops and branch and bound's gap). On a few workers the relaxation's bound is
    loose, so a plan within ``rel_gap`` of it rarely exists and branch and bound ran on
    a quarter of the solves, for tens of milliseconds. With its two-worker moves there the
    search is mostly the exact optimum: on 400 random clusters of 1 to 8 workers
    (``tests/test_joint.py``) 95% of the plans were optimal, two were more than 1% below
    the optimum and none more than 1.7%; without branch and bound one was 19% below (three
    workers all better off at one level, three moves away). Tests pass 0 for the 1%
    certificate of ``rel_gap`` alone."""


@dataclass(frozen=True)
class JointPlan:
    """The joint program's answer: the allocation and the PASM it implies."""

    allocation: Allocation
    shift_map: ShiftMap  # row c: P(level | class c)
    class_load_qpm: tuple[tuple[float, ...], ...]  # x[c][v]
    capacity_qpm: tuple[float, ...]  # per level: Σ_g u·P_th·n, what the level may take


NO_INCUMBENT_LIMIT_S = 10.0  # branch-and-bound time when the rounding is infeasible

Caps = Mapping[tuple[str, str], float]  # (worker class, level name) → utilisation cap in [0, 1]


class JointSolver:
    """The joint program of one planning step, solved for one set of utilisation caps after
    another.

    The planner solves up to four times per step (two starts, each solved again when the
    pools its caps assume change); only the capacity coefficients and W differ between the
    solves, so the later ones skip the checks and start HiGHS from the first relaxation's
    optimal basis: a few simplex iterations instead of dozens. It keeps that basis, so it
    belongs to one planning step.
    """

    def __init__(
        self,
        profiles: ProfileSet,
        strategy: Strategy,
        workers: ClusterView,
        load_qpm: float,
        class_quality: ClassQuality,
        histogram: Sequence[float],
        *,
        switch_cost_weight: float = 0.0,
        period_s: float = defaults.PLANNING_PERIOD_S,
        options: HighsOptions | None = None,
    ) -> None:
        started = time.perf_counter()
        levels = profiles.levels_for(strategy)
        if class_quality.levels != tuple(level.name for level in levels):
            raise ValueError(
                f"class_quality: levels {', '.join(class_quality.levels)} differ from the "
                f"{strategy.value} levels {', '.join(level.name for level in levels)}"
            )
        self._weights = _histogram(histogram, len(levels))
        live = workers.alive()
        _check_classes(profiles, live)
        if not (math.isfinite(load_qpm) and load_qpm >= 0.0):
            raise ValueError(f"load_qpm: must be a finite number >= 0, got {load_qpm}")
        self._levels = levels
        self._profiles = profiles
        self._class_quality = class_quality
        self._live_by_class = Counter(w.worker_class for w in live)
        self._worker_classes = sorted(self._live_by_class)
        self._options = options or HighsOptions()
        # served_qpm is W at utilisation 1; each solve has its own W from its caps
        self._problem = Problem(
            strategy,
            _with_mean_quality(levels, class_quality, self._weights),
            profiles,
            live,
            load_qpm,
            min(load_qpm, self._capacity(self._rates({}))),
            switch_cost_weight,
            period_s,
        )
        totals = [self._live_by_class[g] for g in self._worker_classes]
        self._model = _Model(
            self._problem, class_quality, self._weights, np.array(totals, dtype=np.float64)
        )
        self._basis: highspy.HighsBasis | None = None  # the last relaxation's optimal basis
        self._setup_s = time.perf_counter() - started  # counted in the first solve's solve_ms

    def solve(self, caps: Caps | None = None) -> JointPlan:
        """Plan under ``caps`` (1 where absent). Called by the planner every period and on
        events, a second time when the pools change."""
        plan = self._plan(caps or {}, None)
        assert plan is not None  # nothing to beat: always a plan
        return plan

    def solve_to_beat(self, caps: Caps, served_qpm: float, objective: float) -> JointPlan | None:
        """Plan under ``caps`` only when the plan could beat one that serves ``served_qpm``
        at ``objective`` (more served, or as much at a higher objective); None when it
        cannot. The LP relaxation bounds every plan under ``caps`` from above, so when it
        serves no more and its objective is no higher (within 1e-9), neither rounding nor
        local search runs: the planner's second start costs one LP instead of a solve."""
        return self._plan(caps, (served_qpm, objective))

    def _plan(self, caps: Caps, beat: tuple[float, float] | None) -> JointPlan | None:
        started = time.perf_counter()
        problem = self._problem
        rate = self._rates(caps)
        served = min(problem.load_qpm, self._capacity(rate))
        bound = None  # the objective to beat, when this plan can serve no more than beat's
        if beat is not None:
            beat_served, beat_objective = beat
            tolerance = 1e-9 * max(1.0, beat_served)
            if served < beat_served - tolerance:
                return None
            if served <= beat_served + tolerance:
                bound = beat_objective
        solved = self._solve(rate, served, bound)
        if solved is None:
            return None
        counts, x = solved
        names = tuple(level.name for level in self._levels)
        chosen = chosen_levels(problem, counts)
        assignment = dict(
            zip(problem.worker_table.ids, [names[v] for v in chosen.tolist()], strict=True)
        )
        shift = _shift_map(self._class_quality, self._levels, x, self._weights, served, counts)
        per_level = np.bincount(chosen, minlength=len(names)).tolist()
        load = tuple(x.sum(axis=0).tolist())
        level_capacity = tuple(
            sum(rate[g][v] * counts.workers[g, v] for g in self._live_by_class)
            for v in range(len(names))
        )
        quality = np.asarray(self._class_quality.quality, dtype=np.float64)
        value = float((quality * x).sum())
        allocation = Allocation(
            strategy=problem.strategy,
            levels=names,
            workers_per_level=tuple(per_level),
            load_share_qpm=load,
            assignment=assignment,
            objective=value - counts.switch_cost,
            switch_cost=counts.switch_cost,
            served_qpm=served,
            shortfall_qpm=max(0.0, problem.load_qpm - served),
            moved_workers=moved_workers(problem, chosen),
            solve_ms=(time.perf_counter() - started + self._setup_s) * 1000.0,
        )
        self._setup_s = 0.0
        return JointPlan(allocation, shift, tuple(tuple(row) for row in x.tolist()), level_capacity)

    def _rates(self, caps: Caps) -> dict[str, list[float]]:
        return _effective_rates(self._profiles, self._levels, self._worker_classes, caps)

    def _capacity(self, rate: Mapping[str, Sequence[float]]) -> float:
        """What the live workers can serve at ``rate``: each at its fastest level."""
        return sum(count * max(rate[g]) for g, count in self._live_by_class.items())

    def _program(self, rate: Mapping[str, Sequence[float]], served: float) -> _Program:
        """The program for ``rate`` (per worker class, per level) and W = ``served``."""
        rates = np.array([rate[g] for g in self._worker_classes], dtype=np.float64)
        shape = (len(self._worker_classes), len(self._levels))
        return self._model.program(rates.reshape(shape), served)

    def _solve(
        self, rate: Mapping[str, Sequence[float]], served: float, bound: float | None
    ) -> tuple[Counts, FloatArray] | None:
        """Solve the program for ``rate`` and W = ``served``; return integer worker counts
        and x[c, v], or None when the relaxation's objective is at most ``bound``."""
        program = self._program(rate, served)
        size, shape = program.rate.size, program.rate.shape
        highs = HighsSession(program, self._basis)
        values = _round_then_certify(highs, program, self._options, bound)
        self._basis = highs.relaxed_basis
        if values is None:
            return None
        workers = np.rint(values[:size]).astype(np.int64).reshape(shape)
        counts = Counts.empty()
        for i, g in enumerate(self._worker_classes):
            for v, count in enumerate(workers[i].tolist()):
                counts.workers[g, v] = count
        counts.switch_cost = rounded_switch_cost(self._problem, counts.workers)
        n_levels = len(self._levels)
        loads = np.zeros((n_levels, n_levels))
        x = values[size : size + program.classes.size * n_levels]
        loads[program.classes] = np.maximum(0.0, x.reshape(program.classes.size, n_levels))
        return counts, loads


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
    profiles: ProfileSet, levels: Sequence[Level], worker_classes: Sequence[str], caps: Caps
) -> dict[str, list[float]]:
    """Per worker class, the QPM one worker may be planned for at each level: u · P_th."""
    rates: dict[str, list[float]] = {}
    for g in worker_classes:
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


@dataclass(frozen=True)
class _Block:
    """Columns and rows of one part of the model, in the arrays HiGHS takes; the matrix as
    (row, column, value) triplets."""

    cost: FloatArray
    col_lower: FloatArray
    col_upper: FloatArray
    row_lower: FloatArray
    row_upper: FloatArray
    row: IntArray
    column: IntArray
    value: FloatArray

    def then(self, other: _Block) -> _Block:
        """This block with ``other``'s columns and rows after its own (``other`` indexes them
        already)."""
        return _Block(
            *(
                np.concatenate([getattr(self, part.name), getattr(other, part.name)])
                for part in fields(self)
            )
        )


@dataclass(frozen=True)
class _Program:
    """The joint program for HiGHS, and what rounding needs to know about it.

    Columns: n[g, v] first, worker class major (so ``values[:rate.size]`` reshapes to
    ``rate``'s shape), then x[c, v] for each class with load, then the switching cost's.
    """

    lp: highspy.HighsLp
    classes: IntArray  # the prompt classes with load, in the order of x's rows
    totals: FloatArray  # [g]: live workers of worker class g
    rate: FloatArray  # [g, v]: u · P_th, the QPM one worker of g may take at v
    served: float  # W, the load the program serves


class _Model:
    """The program of the module docstring as HiGHS takes it, the matrix row by row. One
    JointSolver's solves share all of it but the capacity coefficients −u·P_th of n in the
    level rows and W in the class rows, which :meth:`program` fills in.

    Rows: one per worker class, one per level, one per class with load, then the switching
    cost's.
    """

    def __init__(
        self,
        problem: Problem,
        class_quality: ClassQuality,
        weights: FloatArray,
        totals: FloatArray,
    ) -> None:
        groups, n_levels = totals.size, len(problem.levels)
        self.classes = np.flatnonzero(weights > 0.0)
        self.totals = totals
        self._share = weights[self.classes]
        n_size, x_size = groups * n_levels, self.classes.size * n_levels
        g, v_of_n = np.divmod(np.arange(n_size), n_levels)
        c, v_of_x = np.divmod(np.arange(x_size), n_levels)
        n_col, x_col = np.arange(n_size), n_size + np.arange(x_size)
        inf = highspy.kHighsInf
        rows = groups + n_levels + self.classes.size
        self._class_rows = np.arange(groups + n_levels, rows)
        core = _Block(
            cost=np.concatenate(
                [np.zeros(n_size), np.asarray(class_quality.quality)[self.classes].ravel()]
            ),
            col_lower=np.zeros(n_size + x_size),
            col_upper=np.concatenate([np.repeat(totals, n_levels), np.full(x_size, inf)]),
            row_lower=np.concatenate(
                [np.full(groups + n_levels, -inf), np.zeros(rows - groups - n_levels)]
            ),
            row_upper=np.concatenate(
                [totals, np.zeros(n_levels), np.zeros(rows - groups - n_levels)]
            ),
            row=np.concatenate([g, groups + v_of_n, groups + v_of_x, groups + n_levels + c]),
            column=np.concatenate([n_col, n_col, x_col, x_col]),
            value=np.concatenate([np.ones(n_size), np.zeros(n_size), np.ones(2 * x_size)]),
        )
        self._block = core.then(_switch_cost(problem, n_size + x_size, rows))
        order = np.argsort(self._block.row, kind="stable")
        self._start = np.concatenate(
            [[0], np.cumsum(np.bincount(self._block.row, minlength=len(self._block.row_lower)))]
        ).astype(np.int32)
        self._index = self._block.column[order].astype(np.int32)
        self._value = self._block.value[order]
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        self._rate_slots = position[n_size : 2 * n_size]  # where −rate[g, v] goes
        block = self._block
        self._lp = lp = highspy.HighsLp()
        lp.num_col_ = len(block.cost)
        lp.num_row_ = len(block.row_lower)
        lp.sense_ = highspy.ObjSense.kMaximize
        lp.col_cost_ = block.cost
        lp.col_lower_ = block.col_lower
        lp.col_upper_ = block.col_upper
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = self._start
        lp.a_matrix_.index_ = self._index

    def program(self, rate: FloatArray, served: float) -> _Program:
        """The program with ``rate`` [g, v] = u · P_th and W = ``served``. It is the model's
        one HighsLp with those filled in: the next program fills it again (HiGHS copies
        the LP it is passed, and a solver solves one program at a time)."""
        block, lp = self._block, self._lp
        value = self._value.copy()
        value[self._rate_slots] = -rate.ravel()
        row_lower, row_upper = block.row_lower.copy(), block.row_upper.copy()
        row_lower[self._class_rows] = row_upper[self._class_rows] = self._share * served
        lp.row_lower_ = row_lower
        lp.row_upper_ = row_upper
        lp.a_matrix_.value_ = value
        return _Program(lp, self.classes, self.totals, rate, served)


def _switch_cost(problem: Problem, first_column: int, first_row: int) -> _Block:
    """Model loads: u[g, m] + p[g, m] ≥ Σ_{v on m} n[g, v] − holding, where p are loads from
    another model of m's family at the family's price (:meth:`Problem.family_load_cost`) and u
    whole loads, of which a family's members need at least its growth (Σ on − Σ holding);
    up to the idle workers' number of whole loads per class go free (placing a worker that
    holds nothing is not moving it)."""
    block = _Builder(first_column, first_row)
    if problem.switch_cost_weight == 0.0:
        return block.done()
    holding = problem.holding
    n_levels = len(problem.levels)
    models = sorted({level.model for level in problem.levels})
    for i, g in enumerate(sorted({w.worker_class for w in problem.live})):
        frees = []
        whole_of: dict[str, int] = {}
        for model in models:
            cost = problem.load_cost(g, model)
            u = block.column(-cost)
            free = block.column(cost)
            on_model = [
                i * n_levels + v for v, lv in enumerate(problem.levels) if lv.model == model
            ]
            moved = [(u, -1.0)]
            part_cost = problem.family_load_cost(g, model)
            if part_cost < cost:
                moved.append((block.column(-part_cost), -1.0))
            block.row([*((n, 1.0) for n in on_model), *moved], holding[g, model])
            block.row([(free, 1.0), (u, -1.0)], 0.0)
            frees.append(free)
            whole_of[model] = u
        for family in sorted(
            {problem.families[m] for m in models if len(problem.families[m]) > 1}, key=sorted
        ):
            members = sorted(family)
            on_family = [
                i * n_levels + v for v, lv in enumerate(problem.levels) if lv.model in family
            ]
            block.row(
                [*((n, 1.0) for n in on_family), *((whole_of[m], -1.0) for m in members)],
                float(sum(holding[g, m] for m in members)),
            )
        block.row([(free, 1.0) for free in frees], float(holding[g, None]))
    return block.done()


class _Builder:
    """A block built a column and a row at a time: columns ≥ 0, rows bounded above."""

    def __init__(self, first_column: int, first_row: int) -> None:
        self._next_column = first_column
        self._next_row = first_row
        self._cost: list[float] = []
        self._row_upper: list[float] = []
        self._entries: list[tuple[int, int, float]] = []  # (row, column, value)

    def column(self, cost: float) -> int:
        self._cost.append(cost)
        self._next_column += 1
        return self._next_column - 1

    def row(self, terms: Sequence[tuple[int, float]], upper: float) -> None:
        self._entries.extend((self._next_row, column, value) for column, value in terms)
        self._row_upper.append(upper)
        self._next_row += 1

    def done(self) -> _Block:
        entries = np.array(self._entries, dtype=np.float64).reshape(-1, 3)
        return _Block(
            cost=np.array(self._cost, dtype=np.float64),
            col_lower=np.zeros(len(self._cost)),
            col_upper=np.full(len(self._cost), highspy.kHighsInf),
            row_lower=np.full(len(self._row_upper), -highspy.kHighsInf),
            row_upper=np.array(self._row_upper, dtype=np.float64),
            row=entries[:, 0].astype(np.int64),
            column=entries[:, 1].astype(np.int64),
            value=entries[:, 2],
        )


def _round_then_certify(
    highs: HighsSession, program: _Program, options: HighsOptions, bound: float | None = None
) -> FloatArray | None:
    """Solve the LP relaxation, round its worker counts, improve them by local search, and
    keep the result when it is within ``rel_gap`` or ``shortcut_gap`` of the relaxation's
    bound; otherwise branch and bound from the best found. None, after the relaxation
    alone, when its objective is at most ``bound`` (no plan of this program can beat one
    worth ``bound``).

    Every set of counts is valued by the LP with those counts fixed, solved warm on the
    relaxation's HiGHS instance. Branch and bound is all but never needed on large clusters
    (one worker more or less barely moves the value) and bounded by the time limit on small
    ones.
    """
    relaxed = highs.relaxation()
    if relaxed is None:
        raise InfeasiblePlanError("joint program: the LP relaxation has no solution")
    scale = max(1.0, abs(relaxed.objective))
    if bound is not None and relaxed.objective <= bound + 1e-9 * scale:
        return None
    gap = options.rel_gap * scale
    target = relaxed.objective - max(gap, options.shortcut_gap * scale)
    start = highs.with_counts(
        rounded_counts(relaxed.counts, program.totals, program.rate, program.served)
    )
    aim = relaxed.objective - SEARCH_AIM * gap
    best = _improved(highs, start, program, aim, target) if start is not None else None
    if best is not None and (best.objective >= target or options.time_limit_s == 0.0):
        return best.values
    exact = highs.branch_and_bound(options, best)
    if exact is not None:
        return exact
    if best is not None:
        return best.values
    raise InfeasiblePlanError("joint program: branch and bound found no solution")


@dataclass(frozen=True)
class _Solution:
    """A solution of the program, relaxed or with the worker counts fixed."""

    objective: float
    values: FloatArray  # every column
    counts: FloatArray  # [g, v]: n
    reduced: FloatArray  # [g, v]: ∂ objective / ∂ n, from the LP's duals


FEASIBLE = 2  # HiGHS's primal_solution_status of a feasible solution
PRIMAL_SIMPLEX = 4  # HiGHS's simplex_strategy values
DUAL_SIMPLEX = 1


class HighsSession:
    """One HiGHS instance through a solve: the relaxation, then fixed counts warm from its
    basis, then (when those fall short) branch and bound. Public because the search's
    correctness rests on what it returns (each LP's duals give a plane over the value of
    counts, which tests/test_joint.py checks) and ``benchmarks/bench_joint.py`` counts its
    solves.

    Presolve is off but for branch and bound: on a program this small it costs more than it
    saves. The relaxation runs primal simplex, which takes a quarter to a third fewer
    iterations than dual from the slack basis here (``benchmarks/bench_joint.py``'s
    instances); fixing counts changes only bounds, so the optimal basis stays dual feasible
    and dual simplex goes on from it."""

    def __init__(self, program: _Program, basis: highspy.HighsBasis | None) -> None:
        """``basis``: where the relaxation starts, an optimal basis of the same program
        under other caps (the slack basis when None)."""
        self._program = program
        self._highs = _cleared_highs()
        self._highs.setOptionValue("output_flag", False)
        self._highs.setOptionValue("presolve", "off")
        self._highs.setOptionValue("simplex_strategy", PRIMAL_SIMPLEX)
        self._highs.setOptionValue("mip_heuristic_run_feasibility_jump", False)
        self._highs.passModel(program.lp)
        if basis is not None:
            self._highs.setBasis(basis)
        self._columns = np.arange(program.rate.size, dtype=np.int32)
        self.relaxed_basis: highspy.HighsBasis | None = None  # once the relaxation is solved
        self.ceiling = _Ceiling()  # over the value of any counts, from the LPs solved

    def relaxation(self) -> _Solution | None:
        solution = self._run()
        self.relaxed_basis = self._highs.getBasis()
        if solution is not None:
            self.ceiling.add(solution)
        return solution

    def with_counts(self, counts: FloatArray) -> _Solution | None:
        """The best loads for ``counts`` workers [g, v]; None when they cannot serve W."""
        fixed = counts.ravel()
        self._highs.setOptionValue("simplex_strategy", DUAL_SIMPLEX)
        self._highs.changeColsBounds(fixed.size, self._columns, fixed, fixed)
        solution = self._run()
        if solution is not None:
            self.ceiling.add(solution)
        return solution

    def branch_and_bound(self, options: HighsOptions, start: _Solution | None) -> FloatArray | None:
        """The program with integer counts, from ``start`` when there is one (without one
        it searches at least ``NO_INCUMBENT_LIMIT_S``, having no fallback)."""
        lp, size = self._program.lp, self._columns.size
        self._highs.changeColsBounds(
            size, self._columns, lp.col_lower_[:size], lp.col_upper_[:size]
        )
        self._highs.changeColsIntegrality(
            size, self._columns, np.full(size, highspy.HighsVarType.kInteger)
        )
        limit = options.time_limit_s
        if start is None:
            limit = max(limit, NO_INCUMBENT_LIMIT_S)
        else:
            incumbent = highspy.HighsSolution()
            incumbent.col_value = list(start.values)
            self._highs.setSolution(incumbent)
        self._highs.setOptionValue("presolve", "on")
        self._highs.setOptionValue("mip_rel_gap", options.rel_gap)
        # HiGHS's clock runs on from the LPs before
        self._highs.setOptionValue("time_limit", self._highs.getRunTime() + limit)
        found = self._run()
        return found.values if found is not None else None

    def _run(self) -> _Solution | None:
        """Run; None when HiGHS found no feasible solution."""
        highs = self._highs
        highs.run()
        status = highs.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal and not (
            status == highspy.HighsModelStatus.kTimeLimit
            and highs.getInfoValue("primal_solution_status")[1] == FEASIBLE
        ):
            return None
        solution = highs.getSolution()
        values = np.asarray(solution.col_value, dtype=np.float64)
        size, shape = self._columns.size, self._program.rate.shape
        return _Solution(
            highs.getObjectiveValue(),
            values,
            values[:size].reshape(shape),
            np.asarray(solution.col_dual, dtype=np.float64)[:size].reshape(shape),
        )


class _Ceiling:
    """An upper bound on what any worker counts are worth, from the LPs solved so far.

    The value V(n) of counts n is an LP in which n only sets bounds, so V is concave in n,
    and the duals of an LP solved at n give a plane over it: V(n') ≤ V(n) + d·(n' − n),
    where d is n's reduced costs (weak duality: the dual solution at n stays feasible at
    n', and its objective there is that plane). The relaxation's duals give one too, as
    its n only moves within the bounds the fixed programs narrow. The lowest plane over
    counts bounds their value without solving for it; local search skips a candidate whose
    bound cannot beat the plan it has, which in the last round of a search (the candidates
    it tries before giving up) is most of them.
    """

    def __init__(self) -> None:
        self._slopes: list[FloatArray] = []
        self._offsets: list[float] = []
        self._stacked: tuple[FloatArray, FloatArray] | None = None

    def add(self, solution: _Solution) -> None:
        slope = solution.reduced.ravel()
        self._slopes.append(slope)
        self._offsets.append(solution.objective - float(slope @ solution.counts.ravel()))
        self._stacked = None

    def over(self, counts: FloatArray) -> float:
        """The lowest plane at ``counts`` [g, v] (inf before any LP was solved)."""
        if not self._slopes:
            return math.inf
        if self._stacked is None:
            self._stacked = (np.array(self._slopes), np.array(self._offsets))
        slopes, offsets = self._stacked
        return float((offsets + slopes @ counts.ravel()).min())


_THREAD = threading.local()  # .highs: the HiGHS instance this thread's solves reuse


def _cleared_highs() -> highspy.Highs:
    """This thread's HiGHS instance, cleared: its options, model and solver state reset, as
    good as a new one. Building a new one costs about half a millisecond (its option records),
    more than most of the LPs a plan solves on it; clearing costs a microsecond. One per
    thread, as a solve runs from start to end on the thread that began it."""
    highs: highspy.Highs | None = getattr(_THREAD, "highs", None)
    if highs is None:
        highs = _THREAD.highs = highspy.Highs()  # type: ignore[no-untyped-call]
    else:
        highs.clear()
    return highs


SEARCH_STEPS = 20  # local search: improving moves at most
SEARCH_TRIES = 5  # candidates valued per step before the search gives up
PAIR_MOVES_UP_TO = 16  # clusters this small also try moving two workers at once
PAIR_TRIES = 8  # two-worker candidates valued per step
SEARCH_AIM = 0.1  # the search goes on until this share of the gap from the bound
# (stopping at the gap itself left plans 0.036% below the optimum on average, p95 0.28%, on
# 360 random instances like test_joint's; aiming at a tenth, 0.014%, p95 0.08%, as good as
# branch and bound did before, for about half a warm LP more per solve at 64 workers)


def _improved(
    highs: HighsSession, start: _Solution, program: _Program, aim: float, short_of: float
) -> _Solution:
    """Local search from ``start`` until it reaches ``aim``: add, remove or move one
    worker, the candidates the reduced costs rate best valued first, the first that gains
    kept. Closes most of the rounding's shortfall where a few workers carry the load or
    model loads are costly, for a few warm LPs instead of branch and bound. On small
    clusters, while the plan is below ``short_of`` (where branch and bound would take
    over), it also tries moving two workers at once."""
    best = start
    for _ in range(SEARCH_STEPS):
        if best.objective >= aim:
            break
        found = _first_gain(highs, best, _neighbours(best, program, SEARCH_TRIES))
        if found is None and best.objective < short_of and program.totals.sum() <= PAIR_MOVES_UP_TO:
            found = _first_gain(highs, best, _pair_neighbours(best, program, PAIR_TRIES))
        if found is None:
            break
        best = found
    return best


CEILING_SLACK = 1e-6  # a candidate is skipped when its ceiling is this share below the best
# (HiGHS's duals are feasible to 1e-7, so a plane may sit that far below the value; on the
# benchmark's instances and test_joint's none was more than 1e-7 of the objective below it)


def _first_gain(
    highs: HighsSession, best: _Solution, candidates: Sequence[FloatArray]
) -> _Solution | None:
    """The first of ``candidates`` (worker counts) whose loads value above ``best``; those
    the LPs solved so far show cannot are not solved."""
    scale = max(1.0, abs(best.objective))
    for counts in candidates:
        if highs.ceiling.over(counts) < best.objective - CEILING_SLACK * scale:
            continue
        trial = highs.with_counts(counts)
        if trial is not None and trial.objective > best.objective + 1e-9 * scale:
            return trial
    return None


def _neighbours(best: _Solution, program: _Program, count: int) -> list[FloatArray]:
    """Up to ``count`` counts one worker away from ``best``'s that still serve W, best
    first by the first-order gain the reduced costs promise, only those that promise one.
    The spare workers are a level of their own at index L, worth nothing and serving
    nothing. (The reduced costs cannot see W: alone they would rate first the moves that
    drop the capacity below it.)"""
    n_levels = best.counts.shape[1]
    gain, delta, movable = _moves(best, program)
    capacity = float((program.rate * best.counts).sum()) + delta
    possible = (
        movable & (capacity >= program.served - 1e-9 * max(1.0, program.served)) & (gain > 1e-9)
    )
    ranked = np.argsort(-np.where(possible, gain, -np.inf), axis=None)[:count]
    result = []
    for g, v, w in zip(*np.unravel_index(ranked, gain.shape), strict=True):
        if not possible[g, v, w]:
            break
        counts = best.counts.copy()
        if v < n_levels:
            counts[g, v] -= 1.0
        if w < n_levels:
            counts[g, w] += 1.0
        result.append(counts)
    return result


def _moves(
    best: _Solution, program: _Program
) -> tuple[FloatArray, FloatArray, npt.NDArray[np.bool_]]:
    """Every one-worker move from ``best``'s counts, as [g, v, w] arrays (v, w up to L: the
    spare workers at index L): the reduced-cost gain, the capacity change, and whether a
    worker is there to move."""
    groups, n_levels = best.counts.shape
    spare = np.zeros((groups, 1))
    worth = np.concatenate([best.reduced, spare], axis=1)
    rate = np.concatenate([program.rate, spare], axis=1)
    has = np.concatenate(
        [best.counts >= 1.0, (program.totals - best.counts.sum(axis=1) >= 1.0)[:, None]], axis=1
    )
    gain = worth[:, None, :] - worth[:, :, None]  # [g, v, w]: one worker of g from v to w
    delta = rate[:, None, :] - rate[:, :, None]
    movable = has[:, :, None] & ~np.eye(n_levels + 1, dtype=bool)[None]
    return gain, delta, movable


def _pair_neighbours(best: _Solution, program: _Program, count: int) -> list[FloatArray]:
    """Up to ``count`` counts two workers away from ``best``'s that serve W, best first by
    the gain the reduced costs promise. Near capacity a worker can only move to a slower
    level if another moves to a faster one, which no single move reaches; on a few workers
    those pairs are where the rounding's local optimum falls short of the program's."""
    gain, delta, movable = _moves(best, program)
    slack = float((program.rate * best.counts).sum()) - program.served
    tolerance = 1e-9 * max(1.0, program.served)
    first = np.flatnonzero(movable.ravel())
    if first.size < 2:
        return []
    g_of, v_of, w_of = np.unravel_index(first, gain.shape)
    a, b = np.triu_indices(first.size, k=1)
    same_from = (g_of[a] == g_of[b]) & (v_of[a] == v_of[b])
    n_levels = best.counts.shape[1]
    available = np.concatenate(
        [best.counts, (program.totals - best.counts.sum(axis=1))[:, None]], axis=1
    )
    ok = (
        (slack + delta.ravel()[first[a]] + delta.ravel()[first[b]] >= -tolerance)
        & (~same_from | (available[g_of[a], v_of[a]] >= 2.0))
        & ~((g_of[a] == g_of[b]) & (v_of[a] == w_of[b]) & (w_of[a] == v_of[b]))
    )
    promise = np.where(ok, gain.ravel()[first[a]] + gain.ravel()[first[b]], -np.inf)
    result = []
    for k in np.argsort(-promise, kind="stable")[:count].tolist():
        if not np.isfinite(promise[k]):
            break
        counts = best.counts.copy()
        for g, v, w in ((g_of[a[k]], v_of[a[k]], w_of[a[k]]), (g_of[b[k]], v_of[b[k]], w_of[b[k]])):
            if v < n_levels:
                counts[g, v] -= 1.0
            if w < n_levels:
                counts[g, w] += 1.0
        result.append(counts)
    return result


def rounded_counts(
    relaxed: FloatArray, totals: FloatArray, rate: FloatArray, served: float
) -> FloatArray:
    """Integer worker counts [g, v] near the relaxed ones that still serve the load (public:
    the guarantee below is what the search's start rests on, and tests check it on any
    relaxed counts).

    Per worker class, every level keeps the floor of its relaxed count and the workers left
    over go to the levels with the largest fractional parts. That can lose capacity the
    relaxation relied on, and then no loads fit; so while the capacity is short, a leftover
    worker moves from the slowest level it went to to the fastest level with a fractional
    part it did not get, the largest such gain first. This ends serving the load: once no
    move gains, each worker class's k leftovers sit at the k fastest of its fractional
    levels, and those carry at least Σ_v frac_v · rate_v, since the fractions are below 1 and
    sum to at most k. With the floors, that is the relaxation's capacity, ≥ W.
    """
    relaxed = np.maximum(relaxed, 0.0)
    floors = np.floor(relaxed + 1e-9)
    fraction = np.where(relaxed - floors > 1e-9, relaxed - floors, 0.0)
    room = np.maximum(0.0, totals - floors.sum(axis=1))
    leftover = np.minimum(np.ceil(fraction.sum(axis=1) - 1e-9), room).astype(np.int64)
    up = np.zeros(relaxed.shape, dtype=bool)
    for g, count in enumerate(leftover.tolist()):
        up[g, np.argsort(-fraction[g], kind="stable")[:count]] = True
    short = served - float((rate * floors).sum())
    tolerance = 1e-9 * max(1.0, served)
    while float((rate * up).sum()) < short - tolerance:
        slowest = np.where(up, rate, np.inf)
        fastest = np.where((fraction > 0.0) & ~up, rate, -np.inf)
        gain = fastest.max(axis=1) - slowest.min(axis=1)
        g = int(np.argmax(gain))
        if not gain[g] > 0.0:
            break
        up[g, np.argmin(slowest[g])] = False
        up[g, np.argmax(fastest[g])] = True
    result: FloatArray = floors + up
    return result


def _shift_map(
    class_quality: ClassQuality,
    levels: Sequence[Level],
    loads: FloatArray,
    weights: FloatArray,
    served: float,
    counts: Counts,
) -> ShiftMap:
    """Row c of the PASM: x[c, v] / (H_c · W). A class with no planned load (not seen lately,
    or no load at all) goes to its best level among those with planned load, else among those
    with workers."""
    names = tuple(level.name for level in levels)
    n_levels = len(levels)
    open_levels = np.flatnonzero(loads.sum(axis=0) > 0.0).tolist()
    if not open_levels:
        open_levels = [v for v in range(n_levels) if any(k == v for (_, k) in +counts.workers)]
    totals = loads.sum(axis=1)
    shares = (loads / np.where(totals > 0.0, totals, 1.0)[:, None]).tolist()
    rows = []
    for c in range(n_levels):
        if weights[c] * served > 0.0 and totals[c] > 0.0:
            rows.append(tuple(shares[c]))
            continue
        candidates = open_levels or [0]
        best = max(candidates, key=lambda v: (class_quality.quality[c][v], -v))
        rows.append(tuple(1.0 if v == best else 0.0 for v in range(n_levels)))
    return ShiftMap(names, tuple(rows))
