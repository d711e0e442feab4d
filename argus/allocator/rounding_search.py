"""The joint program's integer worker counts: the LP relaxation rounded, repaired, improved
by local search, and certified against the relaxation's bound.

:func:`round_then_certify` drives one :class:`~argus.allocator.highs_session.HighsSession`:

1. the LP relaxation (presolve off: the program has a few hundred columns at most), from
   the last one's optimal basis when a :class:`~argus.allocator.joint.JointSolver` solves
   again under other caps;
2. its worker counts rounded, then repaired until they serve W again (:func:`rounded_counts`);
3. the loads for those counts: the same LP with n fixed, warm from step 1's basis;
4. while that is short of step 1's bound by more than a tenth of the gap, local search:
   add, remove or move one worker, as the reduced costs suggest, each valued as in step 3
   (on up to ``PAIR_MOVES_UP_TO`` workers, two at once when no single move gains), but for
   those that the duals of the LPs solved before show cannot gain (the session's
   ``ValueCeiling``);
5. if it is still short of the bound by more than ``HighsOptions.shortcut_gap`` (5%),
   branch and bound from the best counts, within ``HighsOptions.time_limit_s``.

From a few dozen workers up step 5 is all but never needed (one worker barely moves the
value); on a handful of workers the bound is loose, and the shortcut gap keeps step 5 for
the plans that are clearly short (``tests/test_joint.py`` bounds what that costs: within
2% of the exact optimum on random small clusters).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from argus.allocator.allocation_problem import InfeasiblePlanError
from argus.allocator.highs_session import HighsOptions, HighsSession, LpSolution
from argus.allocator.joint_program import FloatArray, JointProgram


def round_then_certify(
    highs: HighsSession, program: JointProgram, options: HighsOptions, bound: float | None = None
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


SEARCH_STEPS = 20  # local search: improving moves at most
SEARCH_TRIES = 5  # candidates valued per step before the search gives up
PAIR_MOVES_UP_TO = 16  # clusters this small also try moving two workers at once
PAIR_TRIES = 8  # two-worker candidates valued per step
SEARCH_AIM = 0.1  # the search goes on until this share of the gap from the bound
# (stopping at the gap itself left plans 0.036% below the optimum on average, p95 0.28%, on
# 360 random instances like test_joint's; aiming at a tenth, 0.014%, p95 0.08%, as good as
# branch and bound did before, for about half a warm LP more per solve at 64 workers)


def _improved(
    highs: HighsSession, start: LpSolution, program: JointProgram, aim: float, short_of: float
) -> LpSolution:
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
    highs: HighsSession, best: LpSolution, candidates: Sequence[FloatArray]
) -> LpSolution | None:
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


def _neighbours(best: LpSolution, program: JointProgram, count: int) -> list[FloatArray]:
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
    best: LpSolution, program: JointProgram
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


def _pair_neighbours(best: LpSolution, program: JointProgram, count: int) -> list[FloatArray]:
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
