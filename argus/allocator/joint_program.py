"""The joint program as HiGHS takes it: its columns, rows and matrix, as numpy arrays.

:mod:`argus.allocator.joint` states the program (what it maximises, under which rows) and
builds one :class:`JointModel` per planning step from the step's :class:`Problem`. The model
holds everything its solves share; :meth:`JointModel.program` fills in what differs between
them (the capacity coefficients −u·P_th and the load W) and returns the
:class:`JointProgram` that :mod:`argus.allocator.highs_session` hands to HiGHS.

The switching cost's columns and rows (``_switch_cost``) price model loads as Eq. 1 does
(:mod:`argus.allocator.allocation_problem`): a worker that must load a model it does not hold
is charged the quality-weighted work it forgoes while loading.

No modelling layer: the model is a handful of numpy arrays, built into ``highspy``'s own
``HighsLp`` row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import highspy
import numpy as np
import numpy.typing as npt

from argus.allocator.allocation_problem import Problem
from argus.types import ClassQuality

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


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
class JointProgram:
    """The joint program for HiGHS, and what rounding needs to know about it.

    Columns: n[g, v] first, worker class major (so ``values[:rate.size]`` reshapes to
    ``rate``'s shape), then x[c, v] for each class with load, then the switching cost's.
    """

    lp: highspy.HighsLp
    classes: IntArray  # the prompt classes with load, in the order of x's rows
    totals: FloatArray  # [g]: live workers of worker class g
    rate: FloatArray  # [g, v]: u · P_th, the QPM one worker of g may take at v
    served: float  # W, the load the program serves


class JointModel:
    """The program of :mod:`argus.allocator.joint` as HiGHS takes it, the matrix row by row. One
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

    def program(self, rate: FloatArray, served: float) -> JointProgram:
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
        return JointProgram(lp, self.classes, self.totals, rate, served)


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
