"""Prometheus metrics of the ControlNet service: the one module of it that touches
prometheus_client.

Names carry the ``argus_controlnet_`` prefix and base units. Request-path metrics (sessions
by status code, step and session latency) are observed by the servicer; the cache's counters
are not double-booked here but read from :class:`~argus.contracts.controlnet.CacheStats` when
Prometheus scrapes (:class:`CacheCollector`), so the ``Stats`` RPC and ``/metrics`` can never
disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from argus.contracts.controlnet import ExecutorStats

# a tiny ControlNet step on a CPU takes ~2 ms, an SDXL one on a slow GPU ~100 ms
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SESSION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class CacheCollector(Collector):
    """Cache and session counters, read from the executor's stats at scrape time."""

    def __init__(self, stats: Callable[[], ExecutorStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        cache = stats.cache
        for name, help_text, value in (
            ("cache_hits", "Session ControlNets found resident", cache.hits),
            ("cache_misses", "Session ControlNets not resident", cache.misses),
            ("cache_loads", "ControlNet loads (one per cold burst)", cache.loads),
            ("cache_load_failures", "ControlNet loads that failed", cache.load_failures),
            ("cache_evictions", "ControlNets evicted from the device", cache.evictions),
            ("cache_load_seconds", "Time spent loading ControlNets", cache.load_seconds),
            ("steps", "Steps computed", stats.steps_total),
        ):
            yield CounterMetricFamily(f"argus_controlnet_{name}", help_text, value=value)
        for name, help_text, value in (
            ("cache_resident", "ControlNets resident on the device", len(cache.resident)),
            ("cache_resident_bytes", "Bytes of resident ControlNets", cache.resident_bytes),
            ("sessions_open", "Sessions (requests) open now", stats.sessions_open),
        ):
            yield GaugeMetricFamily(f"argus_controlnet_{name}", help_text, value=value)


class ControlNetMetrics:
    def __init__(
        self,
        stats: Callable[[], ExecutorStats],
        registry: CollectorRegistry | None = None,
    ) -> None:
        reg = registry if registry is not None else REGISTRY
        self.sessions = Counter(
            "argus_controlnet_sessions",
            "Sessions (one per request) by final gRPC status code",
            ["code"],
            registry=reg,
        )
        self.session_seconds = Histogram(
            "argus_controlnet_session_seconds",
            "Time a session was open, from its first message to its end",
            buckets=SESSION_BUCKETS,
            registry=reg,
        )
        self.step_seconds = Histogram(
            "argus_controlnet_step_seconds",
            "Time to compute one step's residuals (all of a request's ControlNets)",
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        reg.register(CacheCollector(stats))

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def observe_session(self, code: str, seconds: float) -> None:
        self.sessions.labels(code).inc()
        self.session_seconds.observe(seconds)
