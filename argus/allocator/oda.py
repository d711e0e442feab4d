"""Optimized Distribution Aligner (ODA): builds the shift map (PASM) of Argus §4.3.

The classifier says how prompts spread over their optimal levels (the affinity histogram H);
the solver says how much load each level may take (F, in QPM). Whenever H and F differ, some
prompts must run on a level other than their optimal one. ODA decides which, as a matrix
``P[i][j]`` = probability that a prompt whose optimal level is ``i`` is sent to level ``j``,
such that ``H @ P == F`` and the expected quality loss of Argus Eq. 2 is as small as possible.
Running on a slower level (smaller index) costs no quality; running ``g`` levels faster than
the optimal one costs ``D(g)``.

How the algorithm works here
----------------------------
Prompt mass is kept in one *pool* per level, each pool a vector of mass by origin (optimal)
level; initially pool ``l`` holds ``H[l]`` of origin ``l``. Levels are visited from the fastest
(index n-1) down to index 1:

* pool holds more than ``F[l]``: the excess moves one level slower, into pool ``l-1`` (free).
  Mass of the fastest origins goes first and the level's own natives last, so as many prompts
  as possible stay on their optimal level.
* pool holds less than ``F[l]``: the gap is filled from pool ``l-1``, then ``l-2``, ... (the
  nearest level first, the smallest speed gap), taking the fastest origins of a pool first.

Level 0 keeps whatever remains. The final pools are the transport matrix ``T[origin][dest]``
and the PASM row of origin ``o`` is ``T[o] / H[o]``.

The greedy attains the optimum of Eq. 2 for every non-decreasing convex D with ``D(0) = 0``
at once, so D is not an argument of ``align``; for a D that is not convex the greedy, like
the paper's algorithm, may not be optimal. Why, and how each ambiguity of the printed
Algorithm 1 is resolved here (indexing, totals of different scales, the slowest level,
mixed pools, zero affinity, float dust), is in ``docs/control-plane-internals.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from argus.types import ShiftMap

__all__ = ["align"]

_DUST = 1e-12  # mass (out of a normalised total of 1) treated as zero

Pools = list[list[float]]  # pools[level][origin]: prompt mass of ``origin`` now at ``level``


def align(
    histogram: Sequence[float], load_share: Sequence[float], levels: tuple[str, ...]
) -> ShiftMap:
    """Compute the PASM that moves affinity ``histogram`` (H) onto ``load_share`` (F).

    Called by the allocator after each solve. ``levels`` are the level names, slowest first;
    H and F may have any non-negative scale (they are normalised). Returns a ``ShiftMap`` whose
    rows are distributions and with ``H @ P == F``, minimising Eq. 2 for every convex D.
    Raises ``ValueError`` naming the argument for a wrong length, a negative or non-finite
    value, or a zero total.
    """
    h = _normalised("histogram", histogram, len(levels))
    f = _normalised("load_share", load_share, len(levels))
    pools = _transport(h, f)
    n = len(levels)
    matrix = tuple(_row(origin, [pools[d][origin] for d in range(n)], f) for origin in range(n))
    return ShiftMap(levels, matrix)


def _normalised(name: str, values: Sequence[float], expected_len: int) -> list[float]:
    """Validate ``values`` (argument ``name``) and return them scaled to sum 1.

    Called on every input vector. Raises ``ValueError`` naming ``name`` on a length other than
    ``expected_len``, a negative, NaN or infinite entry, or a total of zero.
    """
    if len(values) != expected_len:
        raise ValueError(
            f"{name} has {len(values)} entries but levels has {expected_len}; "
            "give one value per level"
        )
    floats = [float(v) for v in values]
    for index, value in enumerate(floats):
        if not math.isfinite(value) or value < 0.0:
            raise ValueError(f"{name}[{index}] = {value!r}: must be finite and non-negative")
    peak = max(floats, default=0.0)
    if not peak > 0.0:
        raise ValueError(f"{name} sums to zero: at least one level needs a positive value")
    scaled = [v / peak for v in floats]  # dividing by the peak first avoids overflow in the sum
    total = math.fsum(scaled)
    return [v / total for v in scaled]


def _transport(h: list[float], f: list[float]) -> Pools:
    """Run the greedy from the fastest level to level 1 and return the final pools.

    Called by ``align`` with normalised H and F. ``pools[d][o]`` is then the mass of origin
    ``o`` served at level ``d``, i.e. the transport matrix transposed.
    """
    n = len(h)
    pools: Pools = [[h[o] if o == level else 0.0 for o in range(n)] for level in range(n)]
    for level in range(n - 1, 0, -1):
        surplus = math.fsum(pools[level]) - f[level]
        if surplus > _DUST:
            _push_excess(pools, level, surplus)
        elif surplus < -_DUST:
            _pull_deficit(pools, level, -surplus)
    return pools


def _push_excess(pools: Pools, level: int, excess: float) -> None:
    """Move ``excess`` mass from pool ``level`` to the next slower pool, in place.

    Called when a pool holds more than its load share. The fastest origins leave first and
    the level's own natives last; returns nothing.
    """
    _move(pools[level], pools[level - 1], excess)


def _pull_deficit(pools: Pools, level: int, gap: float) -> None:
    """Fill ``gap`` in pool ``level`` from the slower pools, nearest first, in place.

    Called when a pool holds less than its load share. Within one pool the fastest origins
    are taken first; stops when the gap is filled or level 0 is drained. Returns nothing.
    """
    for donor in range(level - 1, -1, -1):
        gap = _move(pools[donor], pools[level], gap)
        if gap <= 0.0:
            return


def _move(source: list[float], target: list[float], amount: float) -> float:
    """Move up to ``amount`` mass from ``source`` to ``target``, fastest origins first.

    Both are pools indexed by origin; returns the amount that ``source`` could not supply.
    """
    for origin in range(len(source) - 1, -1, -1):
        if amount <= 0.0:
            break
        moved = min(source[origin], amount)
        source[origin] -= moved
        target[origin] += moved
        amount -= moved
    return amount


def _row(origin: int, served: list[float], f: list[float]) -> tuple[float, ...]:
    """Turn the mass of ``origin`` served at each level into its PASM row.

    Called once per level by ``align``. Drops float dust and renormalises so the row sums to 1;
    a row without mass gets the fallback of ``_fallback_target``. Returns the row as a tuple.
    """
    # dust, and any mass on a level that takes no load, is dropped: no prompt may go there
    cleaned = [m if m > _DUST and f[d] > 0.0 else 0.0 for d, m in enumerate(served)]
    total = math.fsum(cleaned)
    if not total > 0.0:
        target = _fallback_target(origin, f)
        return tuple(1.0 if d == target else 0.0 for d in range(len(f)))
    return tuple(m / total for m in cleaned)


def _fallback_target(origin: int, f: list[float]) -> int:
    """Level that prompts of a zero-affinity ``origin`` should go to.

    Called for rows with no mass. Returns ``origin`` itself when it gets load, otherwise the
    nearest level with load, the slower one on a tie. F has a positive entry (validated).
    """
    for distance in range(len(f)):
        for candidate in (origin - distance, origin + distance):
            if 0 <= candidate < len(f) and f[candidate] > 0.0:
                return candidate
    raise AssertionError("load_share has no positive entry")  # unreachable after validation
