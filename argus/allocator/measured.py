"""The speed the workers really run at, as the routers measured it, for planning.

A profile gives each level's latency on each worker class as it was profiled (the default one
on A100 and H100 GPUs). The workers a cluster really runs may be faster or slower: tiny models
on a CPU, an older card, a noisy neighbour. Each router learns its workers' service times from
their replies (:mod:`argus.router.service_times`) and reports, per class and level, the mean
service time of the requests it served there, as they came: the allocator counts load in
requests, so the speed that matters is a request's of the real mix, not a reference request's
(on 64 × 64 requests the tiny CPU workers take 0.55 s against the profile's 4.2 s, though a
1024 × 1024 request would take them minutes). :class:`MeasuredSpeeds` keeps each router's
latest report for ``max_age_s`` and turns them into one **speed factor per class**: the median,
over the levels reported by any router, of measured ÷ profiled latency. The allocator plans
with the profile scaled by those factors (:meth:`~argus.types.ProfileSet.with_speed`), so its
capacity, its load shares and its shortfall are those of the hardware it has.

Why one factor per class and not each level's own figure: a class's hardware speeds up or
slows down every level alike, while a level's own figure also carries the workload it served
(an AC level on a cold cache runs every step, so it measures as slow as the exact level until
the cache fills). Planning on per-level figures would stop sending prompts to approximate
levels exactly while their caches are cold, and they would never warm; the router still
prices each request with its worker's own per-level figure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from argus.types import MeasuredLatency, ProfileSet


@dataclass
class MeasuredSpeeds:
    """Routers' measured latencies → a speed factor per worker class; not thread-safe (the
    allocator's control calls it under its lock)."""

    max_age_s: float = 300.0
    """A router's report counts this long after it arrived."""

    _reports: dict[str, tuple[float, tuple[MeasuredLatency, ...]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_age_s) and self.max_age_s > 0.0):
            raise ValueError(f"max_age_s: must be a finite number > 0, got {self.max_age_s}")

    def observe(self, router_id: str, measured: Sequence[MeasuredLatency], now: float) -> None:
        """A router's latest measurements (an empty report keeps its previous ones)."""
        if measured:
            self._reports[router_id] = (now, tuple(measured))

    def factors(self, profiles: ProfileSet, now: float) -> dict[str, float]:
        """Worker class → how many times slower than ``profiles`` its workers run (classes
        nobody measured are absent)."""
        ratios: dict[str, list[float]] = {}
        for router_id, (at, measured) in list(self._reports.items()):
            if now - at > self.max_age_s:
                del self._reports[router_id]
                continue
            for m in measured:
                profiled = profiles.table.get((m.worker_class, m.level))
                if profiled is not None and profiled.latency_s > 0.0 and m.latency_s > 0.0:
                    ratios.setdefault(m.worker_class, []).append(m.latency_s / profiled.latency_s)
        return {worker_class: statistics.median(r) for worker_class, r in ratios.items()}

    def profiles(self, profiles: ProfileSet, now: float) -> ProfileSet:
        """``profiles`` at the measured speed of each class (as they are where none is)."""
        factors = self.factors(profiles, now)
        return profiles.with_speed(factors) if factors else profiles
