"""The simulated cluster's approximate caches: what a request routed to an AC level finds.

``SimConfig.cache`` (:class:`CacheMode`) chooses between two worlds:

* ``perfect``: every AC request at K > 0 is a hit at its routed K whose image scores the
  per-(prompt, level) quality table: no cache contents, no misses, no cold start, similarity
  taken as 1. The simulator's behaviour before caches were modelled, kept to compare against.
* ``realistic``: each worker holds a bounded cache of prompt embeddings
  (:class:`~argus.sim.worker_cache.WorkerCache`), cold at the start unless warmed with a prompt
  list. A request routed to an AC level with ceiling K looks its prompt up in its worker's cache
  under its key; the nearest entry's cosine similarity s gives ``k = rule.allowed_step(s, K)``
  (:class:`~argus.profiles.cache_evidence.KRule`, the model's rule). k = 0 is a miss, served
  as a full generation (the model's K = 0 level) that then feeds the cache; k > 0 resumes at
  level k, its score from :class:`~argus.profiles.cache_evidence.ReuseQuality` at (s, k).

Keys and feeding follow the live worker (:mod:`argus.worker.approx_cache.use`): an entry is
made by a full run on an AC level's model (K = 0 routed, a miss, or an SM level on the same
model, as SM's best level runs the AC base), once the run has finished, under the model it ran
on; an entry of another model never matches. With adapters drawn
(:mod:`argus.sim.adapters`) a request's LoRA set is part of its key. One difference: the live
worker keys a ControlNet request on its control image and may resume it from an entry made
with the same image, but the simulator draws no control images, so a request with a
ControlNet here neither looks up nor feeds (as if every control image were new).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from argus.profiles.cache_evidence import KRule
from argus.sim.adapters import AdapterDraws
from argus.sim.worker_cache import Eviction, Neighbour, WorkerCache

FloatArray = npt.NDArray[np.float32]
Embed = Callable[[Sequence[str]], FloatArray]
"""Prompt texts to their vectors, one row each (:func:`argus.sim.prompt_vectors.embed_prompts`)."""


class CacheMode(StrEnum):
    REALISTIC = "realistic"
    PERFECT = "perfect"


CACHE_MODES = tuple(mode.value for mode in CacheMode)

UNCACHEABLE = None
"""The adapter key of a request with a ControlNet: it never looks up nor feeds the cache."""


def adapter_keys(draws: AdapterDraws | None, count: int) -> list[Hashable | None]:
    """Each request's adapter key: ``()`` without adapters, its LoRA ranks (sorted) with LoRAs
    only, :data:`UNCACHEABLE` with a ControlNet."""
    if draws is None:
        return [()] * count
    keys: list[Hashable | None] = []
    for controlnets, loras in zip(draws.controlnets.tolist(), draws.loras.tolist(), strict=True):
        if any(rank >= 0 for rank in controlnets):
            keys.append(UNCACHEABLE)
        else:
            keys.append(tuple(sorted(rank for rank in loras if rank >= 0)))
    return keys


@dataclass(frozen=True)
class CacheSetup:
    """What every run of one simulation's realistic caches starts from."""

    vectors: FloatArray  # unit prompt vectors: the quality table's rows, then the warm prompts
    warm: tuple[int, ...]  # rows of ``vectors`` held at the start
    warm_models: tuple[str, ...]  # the models the warm prompts are cached under
    rules: Mapping[str, KRule]  # model -> its similarity → K rule
    cached_steps: Mapping[str, tuple[int, ...]]  # model -> the K its AC levels resume at
    adapter_keys: Sequence[Hashable | None]  # request -> its adapter key (adapter_keys)
    capacity: int  # entries per worker
    eviction: Eviction
    warm_dealt: bool = False  # True: worker i holds warm[i::workers]; False: each holds all


@dataclass(frozen=True)
class Resume:
    """Where a looked-up request starts: ``step`` 0 is a miss (a full generation);
    ``similarity`` is its nearest entry's, NaN when the key had none (a cold cache)."""

    step: int
    similarity: float


MISS_COLD = Resume(0, math.nan)


class ClusterCache:
    """Every worker's cache during one run, with the inserts still running (an entry exists
    once the full generation that makes it has finished)."""

    def __init__(self, setup: CacheSetup, workers: int) -> None:
        self.setup = setup
        dim = int(setup.vectors.shape[1])
        self.caches = [WorkerCache(setup.capacity, dim, setup.eviction) for _ in range(workers)]
        # per worker, (finish time, key, prompt row) of the full runs that will feed it, FIFO
        self._pending: list[deque[tuple[float, Hashable, int]]] = [deque() for _ in self.caches]
        for i, cache in enumerate(self.caches):
            warm = setup.warm[i :: len(self.caches)] if setup.warm_dealt else setup.warm
            for model in setup.warm_models:
                for row in warm:
                    cache.insert((model, ()), row, setup.vectors[row])

    def look_up(
        self, worker: int, request: int, row: int, model: str, ceiling: int, now: float
    ) -> Resume:
        """Request ``request`` (prompt ``row``) routed to ``worker`` at an AC level of ``model``
        with ceiling ``ceiling``, at ``now``: where it resumes. A hit counts as a use of its
        entry."""
        found = self._nearest(worker, request, row, model, now)
        if found is None:
            return MISS_COLD
        step = self.setup.rules[model].allowed_step(
            found.similarity, ceiling, self.setup.cached_steps[model]
        )
        if step > 0:
            self.caches[worker].use(found.entry, step)
        return Resume(step, found.similarity)

    def similarity(
        self, worker: int, request: int, row: int, model: str, now: float
    ) -> float | None:
        """The similarity of request ``request``'s (prompt ``row``) nearest entry in
        ``worker``'s cache under its key on ``model`` at ``now``, as a cache-aware router
        sees it before choosing; None when the key holds none (or the request never looks
        up). Records no use."""
        found = self._nearest(worker, request, row, model, now)
        return None if found is None else found.similarity

    def _nearest(
        self, worker: int, request: int, row: int, model: str, now: float
    ) -> Neighbour | None:
        """The entry of ``worker``'s cache nearest request ``request`` (prompt ``row``)
        under its key on ``model`` at ``now``; None when the key holds none or the request
        never looks up (a ControlNet)."""
        adapters = self.setup.adapter_keys[request]
        if adapters is UNCACHEABLE:
            return None
        self._settle(worker, now)
        return self.caches[worker].nearest((model, adapters), self.setup.vectors[row])

    def feed(self, worker: int, request: int, row: int, model: str, finish_s: float) -> None:
        """A full AC generation of prompt ``row`` on ``worker`` ends at ``finish_s``: from
        then on the worker's cache holds it (unless the request has a ControlNet)."""
        adapters = self.setup.adapter_keys[request]
        if adapters is not UNCACHEABLE:
            self._pending[worker].append((finish_s, (model, adapters), row))

    def forget_unfinished(self, worker: int, now: float) -> None:
        """``worker`` failed at ``now``: runs not finished by then never feed its cache (the
        entries it had persist, as the live cache's do across a restart)."""
        self._settle(worker, now)
        self._pending[worker].clear()

    def _settle(self, worker: int, now: float) -> None:
        pending, cache, vectors = self._pending[worker], self.caches[worker], self.setup.vectors
        while pending and pending[0][0] <= now:
            _, key, row = pending.popleft()
            cache.insert(key, row, vectors[row])

    @property
    def inserts(self) -> int:
        return sum(cache.inserts for cache in self.caches)

    @property
    def evictions(self) -> int:
        return sum(cache.evictions for cache in self.caches)
