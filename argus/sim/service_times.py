"""The simulator's service-time distribution, for the planner's measured queueing caps.

:class:`SimServiceSpread` draws what a simulated worker takes to serve one request at a level:
the level's profiled latency on the worker's class plus the seconds the request's adapters
add (:func:`argus.sim.adapters.draw_adapters` and :func:`~argus.sim.adapters.adapter_cost`,
the simulator's own sampling; the LoRA fetch a wait hides is kept apart), times the
log-normal jitter of :attr:`argus.sim.cluster.SimConfig.jitter`. The simulator serves
request ``i`` in ``(latency + fixed_i + max(hideable_i − wait_i, 0)) × jitter_i``
(``_Run._serve``); these draws are that, with fresh adapters from the same mix. A
:class:`~argus.allocator.queueing.QueueModel` with ``caps="measured"`` simulates its queue
with them.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from argus.allocator.queueing import ServiceDraws
from argus.sim.adapters import AdapterModel, adapter_cost, draw_adapters
from argus.types import ProfileSet


@dataclass(frozen=True)
class SimServiceSpread:
    """Service times of a simulated cluster: base latencies, jitter and adapters."""

    latencies: tuple[tuple[str, str, float, int], ...]
    """(worker class, level, profiled latency in seconds without adapters, skip steps K)."""

    jitter: float = 0.05
    """Standard deviation of the log-normal factor on every service time (the simulator's)."""

    adapters: AdapterModel | None = None
    """The requests' adapters and how they are served; None: none."""

    @classmethod
    def of(
        cls, profiles: ProfileSet, jitter: float, adapters: AdapterModel | None
    ) -> SimServiceSpread:
        """The spread of a simulation of ``profiles`` (the adapter-free ones it serves)."""
        skips = {level.name: level.skip_steps for level in profiles.levels}
        latencies = tuple(
            (worker_class, name, profile.latency_s, skips[name])
            for (worker_class, name), profile in sorted(profiles.table.items())
        )
        return cls(latencies, jitter, adapters)

    def _level(self, worker_class: str, level: str) -> tuple[float, int]:
        for each_class, name, latency_s, skip in self.latencies:
            if (each_class, name) == (worker_class, level):
                return latency_s, skip
        raise KeyError(f"no profile for level {level!r} on class {worker_class!r}")

    def key(self, worker_class: str, level: str) -> Hashable:
        return (*self._level(worker_class, level), self.jitter, self.adapters)

    def draws(self, worker_class: str, level: str, count: int, seed: int) -> ServiceDraws:
        latency_s, skip = self._level(worker_class, level)
        # seeded by what the distribution is, so equal distributions get equal draws
        rng = np.random.default_rng(
            [seed, zlib.crc32(repr(self.key(worker_class, level)).encode())]
        )
        fixed = np.full(count, latency_s)
        hideable = np.zeros(count)
        if self.adapters is not None:
            cost = adapter_cost(
                self.adapters, draw_adapters(count, rng, self.adapters.mix), latency_s, skip
            )
            fixed = fixed + cost.fixed_s
            hideable = cost.hideable_s
        factor = np.exp(rng.normal(0.0, self.jitter, count)) if self.jitter > 0 else np.ones(count)
        return ServiceDraws(fixed, hideable, factor)
