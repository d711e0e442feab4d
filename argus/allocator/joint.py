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

The switching cost is Eq. 1's (:mod:`argus.allocator.allocation_problem`): a worker that must
load a model it does not hold is charged the quality-weighted work it forgoes while loading.

:class:`JointSolver` checks the inputs, solves and reads the answer into a :class:`JointPlan`.
The rest lives beside it: the program's arrays in :mod:`argus.allocator.joint_program`, HiGHS
in :mod:`argus.allocator.highs_session`, and how integer worker counts are found (rounding,
local search, branch and bound) in :mod:`argus.allocator.rounding_search`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from argus import defaults
from argus.allocator.allocation_problem import (
    Counts,
    Problem,
    chosen_levels,
    moved_workers,
    rounded_switch_cost,
)
from argus.allocator.highs_session import HighsOptions, HighsSession
from argus.allocator.joint_program import FloatArray, JointModel, JointProgram
from argus.allocator.rounding_search import round_then_certify
from argus.types import Allocation, ClassQuality, ClusterView, Level, ProfileSet, ShiftMap, Strategy


@dataclass(frozen=True)
class JointPlan:
    """The joint program's answer: the allocation and the PASM it implies."""

    allocation: Allocation
    shift_map: ShiftMap  # row c: P(level | class c)
    class_load_qpm: tuple[tuple[float, ...], ...]  # x[c][v]
    capacity_qpm: tuple[float, ...]  # per level: Σ_g u·P_th·n, what the level may take


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
        self._model = JointModel(
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

    def _program(self, rate: Mapping[str, Sequence[float]], served: float) -> JointProgram:
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
        values = round_then_certify(highs, program, self._options, bound)
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
