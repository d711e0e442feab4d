"""Worker choice that looks at the approximate caches: :class:`CacheRouting`.

A request routed to an AC level of ceiling K resumes at the largest cached step its
neighbour's similarity allows on the worker that serves it, and misses (a full generation)
below the rule's floor (:class:`~argus.profiles.cache_evidence.KRule`). Two workers at the
same level are therefore not interchangeable: the one holding a close neighbour serves the
request sooner, and at the planned K. The AC levels of one model are that model with other
ceilings, so every worker planned at any of them can serve the request at its routed ceiling:
the PASM still decides how far a prompt may be approximated, the caches decide where. Eq. 3
picks the worker with the least
``(queue + 1) · t_proc``; cache-aware, ``t_proc`` is the worker's service time at the step
*its* neighbour allows (the K = 0 level's time on a miss), so a worker's close neighbour wins
unless its queue costs more than the neighbour saves. Ties go to the larger step, then the
closer neighbour, then the lowest worker id.

The same similarity prices the request for admission: the router predicts the completion on
the chosen worker at the step the request will resume at, not at the routed K.

What a worker holds comes from a ``Neighbours`` function: live, the router's mirror of the
workers' caches (:class:`~argus.router.cache_view.CacheView`, fed from the events on their
replies); in the simulator, the simulated caches themselves. This module takes no lock and
reads no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from argus.profiles.cache_evidence import DEFAULT_RULE, KRule, SimilarityBins
from argus.types import ProfileSet, Strategy

Neighbours = Callable[[str, str], "float | None"]
"""``(worker, model)`` → the cosine similarity of the request's nearest neighbour in that
worker's cache under the request's key on ``model``; None when it holds none (or the router
cannot tell)."""


@dataclass(frozen=True)
class CacheChoice:
    """The worker chosen for an AC request and where it is expected to resume."""

    worker_id: str
    step: int  # the step its neighbour allows, at most the level's K; 0: a miss
    index: int  # the AC level index whose service time that step takes (its K = 0 on a miss)
    similarity: float | None  # the neighbour's; None: the worker holds none
    score: float  # (queue + 1) · t_proc at ``index``, seconds
    moved: bool = False  # another worker than Eq. 3's on the routed K (set by the policy)


@dataclass(frozen=True)
class _AcLevel:
    model: str
    ceiling: int  # K
    rule: KRule
    steps: tuple[int, ...]  # the K the model's AC levels resume at (> 0)
    index_of_step: Mapping[int, int]  # step → AC level index


class CacheRouting:
    """The AC levels' rules, and the cache-aware choice among one level's workers."""

    def __init__(self, profiles: ProfileSet, rules: Mapping[str, KRule]) -> None:
        ac = profiles.levels_for(Strategy.AC)
        index = {level.name: i for i, level in enumerate(ac)}
        by_model = profiles.ac_levels_by_model()
        self._models = {index[level.name]: level.model for level in ac}
        self._levels: dict[int, _AcLevel] = {}  # the levels that look up (K > 0)
        for level in ac:
            steps = by_model[level.model]
            if level.skip_steps == 0 or 0 not in steps:
                continue  # a full generation, or a model with no full level to miss to
            self._levels[index[level.name]] = _AcLevel(
                level.model,
                level.skip_steps,
                rules.get(level.model, DEFAULT_RULE),
                tuple(sorted(k for k in steps if k > 0)),
                {k: index[lv.name] for k, lv in steps.items()},
            )
        # model → (name, bins) of its levels that look up: where a probe counts
        self._probed: dict[str, list[tuple[str, SimilarityBins]]] = {}
        for i, found in self._levels.items():
            self._probed.setdefault(found.model, []).append((ac[i].name, found.rule.bins()))

    @property
    def models(self) -> tuple[str, ...]:
        """The AC models whose levels look the cache up."""
        return tuple(self._probed)

    @property
    def bin_counts(self) -> dict[str, int]:
        """Each level that looks up → its number of similarity bins (for
        :meth:`~argus.contracts.cache_outlook.CacheOutlook.of_lookups`)."""
        return {name: len(bins) for found in self._probed.values() for name, bins in found}

    def probes(self, neighbours: Neighbours, live: Iterable[str]) -> list[tuple[str, int, float]]:
        """A request's probe, the plan's evidence whatever level it is served at:
        ``(level, bin, similarity)`` for every AC level that looks up, the similarity the
        closest neighbour any of the ``live`` workers holds on the level's model (NaN, bin 0,
        when none holds one). The step a level allows follows from the similarity alone, so
        one probe counts at every level of the model."""
        workers = list(live)
        out: list[tuple[str, int, float]] = []
        for model, levels in self._probed.items():
            near = [s for w in workers if (s := neighbours(w, model)) is not None]
            best = max(near) if near else math.nan
            out.extend((name, bins.index(best), best) for name, bins in levels)
        return out

    def model_of(self, index: int) -> str | None:
        """The model of AC level ``index`` (None past the AC levels)."""
        return self._models.get(index)

    def looks_up(self, strategy: Strategy, index: int) -> bool:
        """Whether a request served at level ``index`` of ``strategy`` looks the cache up."""
        return strategy is Strategy.AC and index in self._levels

    def allowed(self, index: int, similarity: float | None) -> tuple[int, int]:
        """(step, level index of that step) for a neighbour of ``similarity`` at AC level
        ``index``: the K = 0 level's index on a miss."""
        level = self._levels[index]
        step = (
            0
            if similarity is None
            else level.rule.allowed_step(similarity, level.ceiling, level.steps)
        )
        return step, level.index_of_step[step]

    def choose(
        self,
        index: int,
        workers: Iterable[str],
        queues: Mapping[str, int],
        neighbours: Neighbours,
        service_s: Callable[[str, int], float],
    ) -> CacheChoice | None:
        """The worker of ``workers`` (all running AC level ``index``'s model, at whatever
        level of it) with the least ``(queue + 1)`` times its service time at the step its
        neighbour allows under ``index``'s ceiling; None when ``workers`` is empty."""
        model = self._levels[index].model
        best: tuple[tuple[float, int, float, str], CacheChoice] | None = None
        for worker in workers:
            similarity = neighbours(worker, model)
            step, served = self.allowed(index, similarity)
            score = (queues.get(worker, 0) + 1) * service_s(worker, served)
            rank = (score, -step, -(similarity if similarity is not None else -2.0), worker)
            if best is None or rank < best[0]:
                best = rank, CacheChoice(worker, step, served, similarity, score)
        return None if best is None else best[1]
