"""What each worker really takes: service times learned from its replies.

The profile's latencies describe the GPUs a deployment was profiled on, not the workers it
runs: tiny models on a loaded CPU serve a request in a fifth of a second, an SDXL worker on a
slower card or beside a noisy neighbour in more than the profile says, and a worker whose
approximate cache is still cold runs every request in full. A router that prices requests
from the profile alone admits work it cannot finish (so requests time out at their deadline
instead of being refused at arrival) or refuses work it could serve.

:class:`ServiceTimes` learns, per worker and level, what a request costs there from the
timings every reply already carries (:class:`~argus.contracts.generate.Timing`):

* the **service time** of a reply is ``total_ms - queue_ms`` (the worker's time from taking the
  GPU slot to the answer); its denoising part ``denoise_ms`` scales with the request's cost
  (pixels × steps asked for, in the profile's reference requests: on an AC hit the worker runs
  fewer steps, so a warm cache shows as a cheaper level); the rest (text encoding, retrieval,
  decoding, PNG) is taken as fixed;
* a worker's figure is ``fixed + unit × cost``, each part the **mean** of its last ``window``
  samples with every sample clipped at ``outlier_factor`` × their median (one LoRA load or a
  vCPU preempted for seconds moves it little, while the long tail a busy host gives every
  request stays in: a trimmed mean, which drops the tail, came out 10-20% short on CPU workers
  and admitted requests that then ran late), forgotten once its newest sample is
  ``max_age_s`` old (decayed by window and age), so a worker whose speed changed is learned
  again;
* a worker that **slowed down** (a neighbour arrived on its host) is learned from its last
  ``recent`` replies when their median service time is over ``slowdown`` above the window's
  mean and above the 90th percentile of the replies before them: the requests held for it
  are priced at its new speed within a handful of replies, not dozens, and one slow reply (a
  LoRA load) does not move the median. Speed-ups are learned at the window's pace;
* until a worker has ``min_samples`` at a level, its figure is **seeded**: from the median of
  the workers of the same class already learned at that level, else from the profile scaled
  by how the learned workers compare with the profile (the median ratio of their unit cost to
  their level's profiled latency), else from the profile as it is.

The router's admission (early refusal and the routed check), its worker selection (Eq. 3's
``t_proc``) and the measured latencies it reports to the allocator all read this one figure
(:meth:`predict_s`; :meth:`measured` gives the allocator each level's mean service time per
request as served). Pure: no grpc, no clock of its own (times come in),
not thread-safe (the router calls it under its lock).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from argus.types import MeasuredLatency, ProfileSet


@dataclass(frozen=True)
class ServiceTimeConfig:
    """How the router learns its workers' service times."""

    window: int = 64
    """Replies kept per worker and level."""

    max_age_s: float = 300.0
    """A worker's figure at a level is forgotten when its newest reply there is this old."""

    outlier_factor: float = 4.0
    """Samples above this many times the window's median count as that much."""

    min_samples: int = 3
    """Replies at a level before a worker's own figure replaces its seed."""

    recent: int = 8
    """Newest replies whose median can show a slowdown (0, or more than half the ``window``:
    the window's mean alone)."""

    slowdown: float = 0.15
    """Share by which the newest replies' median must exceed the window's mean service time
    for the figure to be theirs."""

    headroom: float = 0.1
    """Share by which a learned figure is raised when the router predicts with it. Workers slow
    down as load rises (a host's CPU shared with more work, a cache turning over), and the
    admission check multiplies the figure by the queue ahead: behind 30 s of admitted work, a
    figure 10% short finishes requests 3 s late."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.min_samples > self.window:
            raise ValueError(
                f"window, min_samples: need 1 <= min_samples <= window, got {self.window}, "
                f"{self.min_samples}"
            )
        if self.recent < 0:
            raise ValueError(f"recent: must be >= 0, got {self.recent}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 0.0):
            raise ValueError(f"slowdown: must be a finite number >= 0, got {self.slowdown}")
        if not (math.isfinite(self.max_age_s) and self.max_age_s > 0.0):
            raise ValueError(f"max_age_s: must be a finite number > 0, got {self.max_age_s}")
        if not (math.isfinite(self.headroom) and self.headroom >= 0.0):
            raise ValueError(f"headroom: must be a finite number >= 0, got {self.headroom}")
        if not (math.isfinite(self.outlier_factor) and self.outlier_factor >= 1.0):
            raise ValueError(
                f"outlier_factor: must be a finite number >= 1, got {self.outlier_factor}"
            )


@dataclass(frozen=True)
class LearnedTime:
    """One worker's service time at one level: ``fixed_s + unit_s × cost``."""

    fixed_s: float  # seconds every request takes whatever its size
    unit_s: float  # seconds per reference request of denoising (pixels × steps asked for)
    samples: int  # replies behind it; 0 for a seed
    served_s: float = 0.0  # mean service time of the requests it served, as they came
    measured: bool = True  # False: the profile's figure, no reply behind it at all

    def seconds(self, cost: float) -> float:
        return self.fixed_s + self.unit_s * cost


@dataclass
class _Samples:
    fixed: deque[float]
    unit: deque[float]
    served: deque[float]
    last_at: float = -math.inf
    learned: LearnedTime | None = None  # recomputed on each reply

    @classmethod
    def empty(cls, window: int) -> _Samples:
        return cls(deque(maxlen=window), deque(maxlen=window), deque(maxlen=window))


@dataclass
class ServiceTimes:
    """Learned service times per (worker, level); see the module docstring."""

    profiles: ProfileSet
    config: ServiceTimeConfig = field(default_factory=ServiceTimeConfig)
    _samples: dict[tuple[str, str], _Samples] = field(default_factory=dict)
    _classes: dict[str, str] = field(default_factory=dict)  # worker → class, as last seen

    def observe(
        self,
        worker: str,
        worker_class: str,
        level: str,
        cost: float,
        service_s: float,
        denoise_s: float,
        now: float,
    ) -> None:
        """Learn from one reply of ``worker`` at ``level`` for a request of ``cost``
        (``service_s``: the worker's time from its GPU slot to the answer; ``denoise_s`` its
        denoising part). Replies whose timings make no sense are ignored."""
        if not (cost > 0.0 and math.isfinite(cost)):
            return
        if not (math.isfinite(service_s) and math.isfinite(denoise_s) and service_s > 0.0):
            return
        denoise_s = min(max(denoise_s, 0.0), service_s)
        self._classes[worker] = worker_class
        held = self._samples.get((worker, level))
        if held is None:
            held = self._samples[(worker, level)] = _Samples.empty(self.config.window)
        held.fixed.append(service_s - denoise_s)
        held.unit.append(denoise_s / cost)
        held.served.append(service_s)
        held.last_at = now
        held.learned = self._learn(held)

    def forget(self, keep: set[str]) -> None:
        """Drop the workers not in ``keep`` (they left the plan)."""
        for key in [key for key in self._samples if key[0] not in keep]:
            del self._samples[key]
        self._classes = {w: c for w, c in self._classes.items() if w in keep}

    def predict_s(
        self,
        worker: str,
        worker_class: str,
        level: str,
        cost: float,
        now: float,
        *,
        headroom: bool = True,
    ) -> float:
        """Seconds ``worker`` (of ``worker_class``) takes to serve a request of ``cost`` at
        ``level``: its own figure, or its seed (see the module docstring), raised by
        ``headroom`` when learned (a profile's figure is taken as it is); ``headroom=False``:
        the figure as learned, its expected time."""
        learned = self.learned(worker, worker_class, level, now)
        scale = 1.0 + self.config.headroom if learned.measured and headroom else 1.0
        return learned.seconds(cost) * scale

    def learned(self, worker: str, worker_class: str, level: str, now: float) -> LearnedTime:
        """``worker``'s figure at ``level``, or its seed."""
        own = self._fresh(worker, level, now)
        if own is not None:
            return own
        return self._seed(worker_class, level, now)

    def step_s(
        self, worker: str, worker_class: str, level: str, cost: float, steps: int, now: float
    ) -> float:
        """One denoising step's time of a request of ``cost`` and ``steps`` steps there."""
        return self.learned(worker, worker_class, level, now).unit_s * cost / max(steps, 1)

    def measured(self, now: float) -> tuple[MeasuredLatency, ...]:
        """Each (class, level) some worker was learned at: the median over its workers of the
        mean service time of the requests they served there, as they came (the allocator
        counts load in requests, so it plans with what a request of the real mix takes)."""
        by_key: dict[tuple[str, str], list[LearnedTime]] = {}
        for worker, level, learned in self._fresh_all(now):
            by_key.setdefault((self._classes[worker], level), []).append(learned)
        return tuple(
            MeasuredLatency(
                worker_class,
                level,
                statistics.median(t.served_s for t in times),
                sum(t.samples for t in times),
            )
            for (worker_class, level), times in sorted(by_key.items())
        )

    # -- internals ------------------------------------------------------------------------

    def _learn(self, held: _Samples) -> LearnedTime:
        """The window's clipped means, or the newest replies' when they show a slowdown."""
        factor, recent = self.config.outlier_factor, self.config.recent
        fixed, unit, served = list(held.fixed), list(held.unit), list(held.served)
        mean_s = _clipped_mean(served, factor)
        if recent > 0 and 2 * recent <= len(served):
            older, newest = served[:-recent], served[-recent:]
            # beyond the margin and beyond what the older replies' own spread gives (their
            # 90th percentile: a steady worker's median of 8 passes it less than 1 time in 200)
            bar = max(mean_s * (1.0 + self.config.slowdown), _p90(older))
            if statistics.median(newest) > bar:
                fixed, unit, served = fixed[-recent:], unit[-recent:], newest
                mean_s = _clipped_mean(served, factor)
        return LearnedTime(
            _clipped_mean(fixed, factor), _clipped_mean(unit, factor), len(held.unit), mean_s
        )

    def _fresh(self, worker: str, level: str, now: float) -> LearnedTime | None:
        held = self._samples.get((worker, level))
        if held is None or held.learned is None:
            return None
        if len(held.unit) < self.config.min_samples:
            return None
        if now - held.last_at > self.config.max_age_s:
            return None
        return held.learned

    def _fresh_all(self, now: float) -> Iterator[tuple[str, str, LearnedTime]]:
        for worker, level in list(self._samples):
            learned = self._fresh(worker, level, now)
            if learned is not None:
                yield worker, level, learned

    def _seed(self, worker_class: str, level: str, now: float) -> LearnedTime:
        """Peers of the same class at ``level``; else the profile scaled as the learned
        workers compare with it; else the profile."""
        peers: list[LearnedTime] = []
        ratios: list[float] = []
        fixed: list[float] = []
        for worker, their_level, learned in self._fresh_all(now):
            their_class = self._classes[worker]
            if their_level == level and their_class == worker_class:
                peers.append(learned)
            profiled = self._profiled_s(their_class, their_level)
            if profiled is not None and profiled > 0.0:
                ratios.append(learned.unit_s / profiled)
                fixed.append(learned.fixed_s)
        if peers:
            return LearnedTime(
                statistics.median(t.fixed_s for t in peers),
                statistics.median(t.unit_s for t in peers),
                0,
            )
        profiled = self._profiled_s(worker_class, level)
        if profiled is None:  # a level the profile lacks on this class: the slowest known
            profiled = max(p.latency_s for p in self.profiles.table.values())
        if ratios:
            return LearnedTime(statistics.median(fixed), profiled * statistics.median(ratios), 0)
        return LearnedTime(0.0, profiled, 0, measured=False)

    def _profiled_s(self, worker_class: str, level: str) -> float | None:
        entry = self.profiles.table.get((worker_class, level))
        return None if entry is None else entry.latency_s


def _p90(values: list[float]) -> float:
    """The 90th percentile of ``values`` (linear between order statistics)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def _clipped_mean(values: Sequence[float], factor: float) -> float:
    """The mean of ``values``, each clipped at ``factor`` × their median."""
    ceiling = statistics.median(values) * factor
    return math.fsum(min(v, ceiling) for v in values) / len(values)
