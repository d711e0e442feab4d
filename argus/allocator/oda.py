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

Why this is optimal (and why ``align`` takes no D)
--------------------------------------------------
For every boundary between levels ``t-1`` and ``t``, any plan must move at least
``max(0, sum(F[t:]) - sum(H[t:]))`` of mass from origins below ``t`` to levels ``t`` and above.
The greedy moves exactly that much and never moves mass across a boundary in both directions.
Its upward moves never nest (no ``i1 < i2 < j2 < j1`` with ``i1 -> j1`` and ``i2 -> j2``),
because a level that pulls past a pool empties it, and an emptied pool below the current level
is refilled by nobody before it is visited. For a non-decreasing convex D with ``D(0) = 0``
(hence superadditive, ``D(a + b) >= D(a) + D(b)``), replacing any nested pair by the crossed
pair never costs more, so the greedy attains the optimum of the transport problem
``min sum T[i][j] * D(j - i) over j > i`` for every such D at once. D is therefore not an
argument of ``align``. (For a D that is not
convex, e.g. ``D(2) < 2 * D(1)``, the greedy, like the paper's algorithm, may not be optimal.)

Ambiguities of the printed Algorithm 1 and how they are resolved
----------------------------------------------------------------
1. Indexing. The paper numbers levels v_1 (slowest) ... v_n (fastest) and walks "right to
   left"; here index 0 is the slowest, so the walk is index n-1 down to 1 (``argus.types``).
2. Different totals. H counts classified prompts, F is QPM, so their totals differ; the
   pseudo-code compares them bar by bar as if they had one scale. Both are normalised to sum 1.
3. Line 4 at the slowest level would write P(v_0 | v_1), a level that does not exist. Once the
   totals match, the slowest level can only be left with float dust; it keeps what remains.
4. The inner ``for all m in {1, 2, ...}`` has no stop, and the enclosing ``while`` re-tests its
   condition only after the ``for`` ends. We stop as soon as the gap is filled or level 0 has
   been drained (m = i); an empty pool on the way simply contributes nothing.
5. Mixed pools. After a push, a pool holds prompts of several origins. The paper records step
   probabilities (line 4: fraction of the *current* pool pushed) and composes them with its
   chain product, which treats the pool as well mixed: natives get pushed out in proportion.
   We track origins instead, push the fastest origins first and natives last, and read each
   PASM entry directly as a fraction of the origin's H, with no chain product. The Eq. 2 value
   is the same: moves to slower levels are free whoever makes them, and the upward moves are
   identical because a pool below the level being visited only ever holds its own natives.
   Origin tracking keeps more prompts on their optimal level.
6. Mixed units of P. Line 4 divides by the running H(v_i) (a step probability) whereas lines
   11 and 14 divide by H_old (a final probability); the two kinds are never reconciled. Every
   entry here is a fraction of the origin's original mass ``H[o]``.
7. The diagonal P(v_i | v_i) is set only by line 14, i.e. only for levels that were pulled
   from, and line 14's value goes stale if that level later pushes excess. Levels that pushed
   excess or were never touched have no diagonal at all. Here it is always ``T[o][o] / H[o]``
   (1 for an untouched level).
8. Zero affinity. Line 11 divides by H_old(v_{i-m}), which is 0 for a level nobody has been
   classified to yet; its row would also stay empty, yet the router still needs a distribution
   for a prompt classified there later. Such a row sends everything to its own level when that
   level gets load (``F[o] > 0``), otherwise to the nearest level with load, ties broken
   towards the slower level (free, no quality loss).
9. D. The text says D is an explicit input while the pseudo-code never reads it, and Eq. 2 and
   the text say "closest faster level". Nearest-first is optimal for every convex D (see above),
   so D is not an input of ``align``.
10. Float dust. Differences below ``_DUST`` (relative to the normalised total 1) are treated as
   equality, tiny negatives are clipped and each row is renormalised, so every row sums to 1
   within 1e-12 and ``H @ P`` reproduces F within 1e-9.
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
