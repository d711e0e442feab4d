"""HiGHS through one solve of the joint program: the relaxation, the LPs with the worker
counts fixed, and branch and bound, on one instance.

HiGHS runs through ``highspy`` directly (no modelling layer), on one HiGHS instance per thread,
cleared for each solve (``_cleared_highs``), to the relative gap of :class:`HighsOptions`.
:class:`HighsSession` solves what it is asked; which counts to value, and when branch and bound
must take over, is the rounding search's (:mod:`argus.allocator.rounding_search`). Each LP
the session solves also adds a plane to its :class:`ValueCeiling`, which bounds what any
other counts can be worth, so the search skips those that cannot gain.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import highspy
import numpy as np

from argus.allocator.joint_program import FloatArray, JointProgram


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


NO_INCUMBENT_LIMIT_S = 10.0  # branch-and-bound time when the rounding is infeasible


@dataclass(frozen=True)
class LpSolution:
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

    def __init__(self, program: JointProgram, basis: highspy.HighsBasis | None) -> None:
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
        self.ceiling = ValueCeiling()  # over the value of any counts, from the LPs solved

    def relaxation(self) -> LpSolution | None:
        solution = self._run()
        self.relaxed_basis = self._highs.getBasis()
        if solution is not None:
            self.ceiling.add(solution)
        return solution

    def with_counts(self, counts: FloatArray) -> LpSolution | None:
        """The best loads for ``counts`` workers [g, v]; None when they cannot serve W."""
        fixed = counts.ravel()
        self._highs.setOptionValue("simplex_strategy", DUAL_SIMPLEX)
        self._highs.changeColsBounds(fixed.size, self._columns, fixed, fixed)
        solution = self._run()
        if solution is not None:
            self.ceiling.add(solution)
        return solution

    def branch_and_bound(
        self, options: HighsOptions, start: LpSolution | None
    ) -> FloatArray | None:
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

    def _run(self) -> LpSolution | None:
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
        return LpSolution(
            highs.getObjectiveValue(),
            values,
            values[:size].reshape(shape),
            np.asarray(solution.col_dual, dtype=np.float64)[:size].reshape(shape),
        )


class ValueCeiling:
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

    def add(self, solution: LpSolution) -> None:
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
