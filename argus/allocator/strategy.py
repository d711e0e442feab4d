"""AC↔SM strategy switching (Argus §4.6): decide from retrieval latency which strategy to run.

Argus serves with approximate caching (AC) by default. Every AC request reports how long cache
retrieval (vector search + latent fetch) took, or that it failed. When the p99 of the recent
window stays above a threshold, or retrieval fails outright, the monitor switches to smaller
models (SM). While on SM it expects background probe results; once the probes of a whole
window are healthy it switches back to AC.

Pure decision logic: callers report observations with their own clock and ask
:meth:`StrategyMonitor.decide`; what a switch means for the workers (fall back to K=0 on the
loaded SDXL, load small variants, re-plan with a 1.5× margin) is up to the allocator that acts.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

from argus import defaults
from argus.types import Strategy


@dataclass(frozen=True)
class StrategyConfig:
    """When to leave AC and when to come back."""

    threshold_s: float = defaults.RETRIEVAL_THRESHOLD_S
    """Retrieval p99 above this (seconds) makes AC not worth it: switch to SM."""

    window_s: float = defaults.RETRIEVAL_WINDOW_S
    """How far back observations count, seconds."""

    min_samples: int = 20
    """Observations needed in the window before a p99 is trusted (a failure counts at once)."""

    probe_interval_s: float = 10.0
    """While on SM, how often a background retrieval probe is sent."""

    def __post_init__(self) -> None:
        if not self.threshold_s > 0.0:
            raise ValueError(f"threshold_s: must be > 0, got {self.threshold_s}")
        if not self.window_s > 0.0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples: must be >= 1, got {self.min_samples}")
        if not self.probe_interval_s > 0.0:
            raise ValueError(f"probe_interval_s: must be > 0, got {self.probe_interval_s}")


class StrategyMonitor:
    """Tracks retrieval health and says which strategy to run."""

    def __init__(self, config: StrategyConfig | None = None, start: Strategy = Strategy.AC):
        self.config = config or StrategyConfig()
        self._strategy = start
        self._since_s = -math.inf  # when the current strategy was chosen
        self._samples: deque[tuple[float, float]] = deque()  # (time, latency; inf = failure)
        # the same latencies kept sorted as they arrive and expire: the allocator asks for a
        # decision on every heartbeat, and sorting the whole window each time cost more
        # than all the rest of the heartbeat
        self._sorted: list[float] = []
        # the time of the last decision while nothing was observed since: asked again at that
        # time (every worker's heartbeat of one instant asks), the answer cannot differ
        self._decided_at: float | None = None
        self.switches = 0

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def observe(self, now_s: float, latency_s: float | None) -> None:
        """A retrieval (request or probe) took ``latency_s``; ``None`` means it failed."""
        latency = math.inf if latency_s is None else latency_s
        if latency != latency:
            raise ValueError(f"latency_s: must be a number or None, got {latency_s}")
        self._samples.append((now_s, latency))
        insort(self._sorted, latency)
        self._decided_at = None

    def decide(self, now_s: float) -> Strategy:
        """The strategy to run from ``now_s`` on; counts a switch when it changes."""
        if now_s == self._decided_at:
            return self._strategy
        self._decided_at = now_s
        self._forget(now_s)
        wanted = self._wanted(now_s)
        if wanted is not self._strategy:
            self._strategy = wanted
            self._since_s = now_s
            self._samples.clear()
            self._sorted.clear()
            self.switches += 1
        return self._strategy

    def _wanted(self, now_s: float) -> Strategy:
        latencies = self._sorted
        if self._strategy is Strategy.AC:
            failed = bool(latencies) and math.isinf(latencies[-1])
            slow = len(latencies) >= self.config.min_samples and (
                _p99(latencies) > self.config.threshold_s
            )
            return Strategy.SM if failed or slow else Strategy.AC
        # on SM: come back only after a whole window of healthy probes
        window_done = now_s - self._since_s >= self.config.window_s
        probes_needed = max(1, int(self.config.window_s / self.config.probe_interval_s) - 1)
        healthy = len(latencies) >= probes_needed and _p99(latencies) <= self.config.threshold_s
        return Strategy.AC if window_done and healthy else Strategy.SM

    def _forget(self, now_s: float) -> None:
        horizon = now_s - self.config.window_s
        while self._samples and self._samples[0][0] < horizon:
            _, latency = self._samples.popleft()
            # equal latencies are interchangeable: drop the first of them
            del self._sorted[bisect_left(self._sorted, latency)]


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(0.99 * len(sorted_values)) - 1)]
