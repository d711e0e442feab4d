"""The prompt scheduler (Argus §4.4): PASM sampling, then worker selection (Eq. 3).

For each prompt the router knows the classifier's optimal level i. The scheduler samples the
target level j from PASM row i with its own seeded generator, then picks, among the live
workers the plan put at level j, the one with the smallest expected completion time
``(queue + 1) · t_proc``. The paper writes ``R_queue · t_proc``; with every queue empty that
product is zero for all workers and cannot tell a fast GPU from a slow one, so the request the
router is about to add is counted too. Ties go to the lowest worker id (deterministic).

If no live worker serves level j (it died since the plan was made, or the plan left the level
empty but the PASM row still names it through float dust), the prompt goes to the nearest
level that has one, the slower level first on equal distance (better quality), and the
decision is flagged and counted as a fallback.

The scheduler decides; it does not own queues. The router passes the queue lengths and the set
of workers it has seen fail on every call.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import repeat

from argus.types import Plan, ProfileSet, RouteDecision, ShiftMap


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler was built."""

    decisions: int
    fallbacks: int
    by_target_level: tuple[int, ...]  # decisions per sampled target level, slowest first


TimeOf = Callable[[str, int], float]
"""A request's service time on a worker at a level index, seconds (the router's measurement)."""


class NoLiveWorkerError(RuntimeError):
    """Every worker of the plan is down: the prompt cannot be placed."""


class PromptScheduler:
    """Routes prompts for one plan; rebuilt whenever a new plan arrives."""

    def __init__(
        self,
        shift_map: ShiftMap,
        workers_by_level: Mapping[str, list[tuple[str, float]]],
        rng: random.Random,
    ) -> None:
        """``workers_by_level[level]`` lists (worker_id, t_proc seconds) of that level."""
        self._levels = shift_map.levels
        self._cumulative = tuple(_cumulative(row) for row in shift_map.matrix)
        self._groups = tuple(
            _group_by_speed(workers_by_level.get(level, [])) for level in self._levels
        )
        self._search_order = tuple(
            nearest_first(j, len(self._levels)) for j in range(len(self._levels))
        )
        self._rng = rng
        self._decisions = 0
        self._fallbacks = 0
        self._by_target: Counter[int] = Counter()

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        profiles: ProfileSet,
        worker_classes: Mapping[str, str],
        rng: random.Random,
    ) -> PromptScheduler:
        """Build from a plan; ``worker_classes`` maps worker id → GPU class for t_proc."""
        by_level: dict[str, list[tuple[str, float]]] = {}
        for worker_id, level in plan.allocation.assignment.items():
            latency = profiles.profile(worker_classes[worker_id], level).latency_s
            by_level.setdefault(level, []).append((worker_id, latency))
        return cls(plan.shift_map, by_level, rng)

    @property
    def levels(self) -> tuple[str, ...]:
        return self._levels

    def route(
        self,
        optimal_level: int,
        queue_lengths: Mapping[str, int],
        down: AbstractSet[str] = frozenset(),
        max_level: int | None = None,
        t_proc: TimeOf | None = None,
    ) -> RouteDecision:
        """Choose level and worker for a prompt whose classifier level is ``optimal_level``.

        ``queue_lengths`` (missing ids count as 0) and ``down`` are the router's current view.
        ``max_level`` is the request's minimum quality: no level above it (faster, more
        approximate) is sampled or served; a prompt classified above it is routed as if its
        optimal level were ``max_level``. ``t_proc(worker_id, level_index)``, when given, is
        this request's service time there as the router measured it, in place of the profile's
        latency (a worker slower than its peers then gets less of the level's traffic).
        Raises ``ValueError`` for an out-of-range level, :class:`NoLiveWorkerError` when no live
        worker serves an allowed level.
        """
        last = len(self._levels) - 1
        if not 0 <= optimal_level <= last:
            raise ValueError(f"optimal_level: must be in [0, {last}], got {optimal_level}")
        limit = last if max_level is None else min(max(max_level, 0), last)
        row = min(optimal_level, limit)
        target = bisect.bisect_right(self._cumulative[row], self._rng.random())
        target = min(target, limit)
        self._decisions += 1
        self._by_target[target] += 1
        decision = self._place(optimal_level, target, queue_lengths, down, limit, t_proc)
        if decision is None:
            raise NoLiveWorkerError(
                "no live worker in the plan serves an allowed level"
                if limit < last
                else "no live worker in the plan: every worker is down"
            )
        return decision

    def _place(
        self,
        optimal_level: int,
        target: int,
        queue_lengths: Mapping[str, int],
        down: AbstractSet[str],
        limit: int,
        t_proc: TimeOf | None = None,
    ) -> RouteDecision | None:
        """The target level's best worker; when none of it is live, the nearest level's
        (slower first on equal distance), never one above ``limit``. A request the chosen
        worker cannot finish in time is moved later, by the router's admission
        (:meth:`~argus.router.policy.RouterPolicy.route`, ``spill_on_refusal``)."""
        for served in self._search_order[target]:
            if served > limit:
                continue
            if t_proc is None:
                best = _best_worker(self._groups[served], queue_lengths, down)
            else:
                best = _best_measured(self._groups[served], queue_lengths, down, t_proc, served)
            if best is None:
                continue
            score, worker_id = best
            fallback = served != target
            self._fallbacks += fallback
            return RouteDecision(optimal_level, target, served, worker_id, fallback, score)
        return None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            self._decisions,
            self._fallbacks,
            tuple(self._by_target[j] for j in range(len(self._levels))),
        )


def _group_by_speed(workers: list[tuple[str, float]]) -> tuple[tuple[float, tuple[str, ...]], ...]:
    """Workers of one level grouped by t_proc (one group per GPU class), ids sorted."""
    groups: dict[float, list[str]] = {}
    for worker_id, t_proc in workers:
        groups.setdefault(t_proc, []).append(worker_id)
    return tuple((t_proc, tuple(sorted(ids))) for t_proc, ids in sorted(groups.items()))


def _best_worker(
    groups: tuple[tuple[float, tuple[str, ...]], ...],
    queue_lengths: Mapping[str, int],
    down: AbstractSet[str],
) -> tuple[float, str] | None:
    """(score, worker_id) of the worker with the least (queue + 1) * t_proc, or None.

    Within a group t_proc is equal, so the least queue (then the lowest id) wins; the scan runs
    in C (map/zip/min), which keeps large levels cheap.
    """
    best: tuple[float, str] | None = None
    for t_proc, ids in groups:
        if down:
            ids = tuple(worker_id for worker_id in ids if worker_id not in down)
            if not ids:
                continue
        queue, worker_id = min(zip(map(queue_lengths.get, ids, repeat(0)), ids, strict=True))
        candidate = ((queue + 1) * t_proc, worker_id)
        if best is None or candidate < best:
            best = candidate
    return best


def _best_measured(
    groups: tuple[tuple[float, tuple[str, ...]], ...],
    queue_lengths: Mapping[str, int],
    down: AbstractSet[str],
    t_proc: TimeOf,
    level: int,
) -> tuple[float, str] | None:
    """As :func:`_best_worker`, with each worker's measured ``t_proc`` at ``level``."""
    best: tuple[float, str] | None = None
    for _, ids in groups:
        for worker_id in ids:
            if worker_id in down:
                continue
            candidate = (
                (queue_lengths.get(worker_id, 0) + 1) * t_proc(worker_id, level),
                worker_id,
            )
            if best is None or candidate < best:
                best = candidate
    return best


def _cumulative(row: tuple[float, ...]) -> tuple[float, ...]:
    total = 0.0
    out = []
    for p in row:
        total += p
        out.append(total)
    # the last non-zero entry must catch u up to 1.0 whatever the float dust
    last = max((j for j, p in enumerate(row) if p > 0.0), default=len(row) - 1)
    return tuple(1.0 if j >= last else c for j, c in enumerate(out))


def nearest_first(target: int, count: int) -> tuple[int, ...]:
    """Levels by distance from ``target``; on equal distance the slower (lower index) first.
    The order of the scheduler's fallback and spill, and of the router's spill on refusal."""
    return tuple(sorted(range(count), key=lambda j: (abs(j - target), j)))
