"""Prometheus metrics of the allocator process: the one module of it that touches
prometheus_client.

It listens to the control's plans (:class:`~argus.allocator.control.PlanStats` is the data)
and reads the control's state at scrape time. Names carry the ``argus_allocator_`` prefix and
base units; labels are bounded: reasons and strategies are enums, levels come from the
profile, RPC methods from the service.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from argus.allocator.control import AllocatorControl, PlanStats
from argus.contracts.plans import PlannedWorker, PublishedPlan
from argus.types import ProfileSet, Strategy

# a solve of a few workers takes milliseconds, a large multi-class one up to seconds
SOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AllocatorMetrics:
    def __init__(self, profiles: ProfileSet, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self._levels = {s: [lv.name for lv in profiles.levels_for(s)] for s in Strategy}
        self._control: AllocatorControl | None = None  # set by watch
        self._shown_key: str | None = None  # the classifier key the gauge shows
        self.plans = Counter(
            "argus_allocator_plans",
            "Plans made, by the reason they were made for",
            ["reason"],
            registry=reg,
        )
        self.plan_changes = Counter(
            "argus_allocator_plan_changes",
            "Plans whose strategy or worker → level assignment differs from the previous one",
            registry=reg,
        )
        self.strategy_switches = Counter(
            "argus_allocator_strategy_switches",
            "Plans whose strategy differs from the previous plan's",
            registry=reg,
        )
        self.dead_workers = Counter(
            "argus_allocator_dead_workers",
            "Workers dropped from the plan after missing their heartbeats",
            registry=reg,
        )
        self.solve_seconds = Histogram(
            "argus_allocator_solve_seconds",
            "Wall time of making one plan (every allowed strategy solved and aligned)",
            buckets=SOLVE_BUCKETS,
            registry=reg,
        )
        self.plan_version = Gauge(
            "argus_allocator_plan_version", "Version of the current plan", registry=reg
        )
        self.strategy = Gauge(
            "argus_allocator_strategy",
            "1 for the current plan's strategy, 0 for the other",
            ["strategy"],
            registry=reg,
        )
        self.workers_alive = Gauge(
            "argus_allocator_workers_alive", "Live workers the allocator plans for", registry=reg
        )
        self.workers_at_level = Gauge(
            "argus_allocator_workers_at_level",
            "Workers the current plan assigns to each level",
            ["level"],
            registry=reg,
        )
        self.load_share = Gauge(
            "argus_allocator_load_share_qpm",
            "F(v): load the current plan sends to each level, queries per minute",
            ["level"],
            registry=reg,
        )
        self.affinity = Gauge(
            "argus_allocator_affinity",
            "H(v): share of recent prompts whose optimal level is this one (plan's strategy)",
            ["level"],
            registry=reg,
        )
        self.forecast = Gauge(
            "argus_allocator_forecast_qpm",
            "Load the current plan was made for, queries per minute",
            registry=reg,
        )
        self.shortfall = Gauge(
            "argus_allocator_shortfall_qpm",
            "Load beyond the cluster's capacity at the fastest levels (scale out)",
            registry=reg,
        )
        self.retrieval_healthy = Gauge(
            "argus_allocator_retrieval_healthy",
            "1 while cache retrieval allows AC, 0 while SM is forced",
            registry=reg,
        )
        self.watchers = Gauge(
            "argus_allocator_plan_watchers", "Open WatchPlan streams", registry=reg
        )
        self.classifier = Gauge(
            "argus_allocator_classifier",
            "1 for the classifier whose Q(v | c) the plans price classes with (its "
            'classifier_key; "none": level averages)',
            ["key"],
            registry=reg,
        )
        self.routers_other_classifier = Gauge(
            "argus_allocator_routers_other_classifier",
            "Routers whose latest report named another classifier than the allocator's",
            registry=reg,
        )
        self.rejected = Counter(
            "argus_allocator_rejected_requests",
            "Requests answered with an error status, by method and code",
            ["method", "code"],
            registry=reg,
        )

    def watch(self, control: AllocatorControl, watchers: Callable[[], int]) -> None:
        """Read live values from ``control`` and the watcher count at scrape time."""
        self._control = control
        self._show_classifier()
        self.routers_other_classifier.set_function(
            lambda: float(control.routers_on_other_classifier())
        )
        self.workers_alive.set_function(lambda: control.workers_alive())
        self.retrieval_healthy.set_function(lambda: 1.0 if control.retrieval_healthy() else 0.0)
        self.watchers.set_function(lambda: float(watchers()))

    def observe_plan(self, published: PublishedPlan, stats: PlanStats) -> None:
        """A :data:`~argus.allocator.control.PlanListener`."""
        plan = published.plan
        self.plans.labels(published.reason.value).inc()
        if stats.changed:
            self.plan_changes.inc()
        if stats.strategy_switched:
            self.strategy_switches.inc()
        self.dead_workers.inc(stats.dead_workers)
        self.solve_seconds.observe(stats.planning_s)
        self.plan_version.set(plan.version)
        for strategy in Strategy:
            self.strategy.labels(strategy.value).set(1.0 if strategy is plan.strategy else 0.0)
        self._per_level(plan.strategy, published.workers, plan.allocation.load_share_qpm)
        for name, share in zip(plan.allocation.levels, plan.histogram, strict=True):
            self.affinity.labels(name).set(share)
        self.forecast.set(plan.forecast.qpm)
        self.shortfall.set(plan.allocation.shortfall_qpm)
        self._show_classifier()

    def _show_classifier(self) -> None:
        """The classifier key the plans price with; it changes when a router reports a
        drift-retrained classifier's Q(v | c)."""
        if self._control is None:
            return
        key = self._control.classifier_key or "none"
        if key != self._shown_key:
            self.classifier.clear()
            self.classifier.labels(key).set(1.0)
            self._shown_key = key

    def _per_level(
        self, strategy: Strategy, workers: tuple[PlannedWorker, ...], shares: tuple[float, ...]
    ) -> None:
        """Levels of the other strategy read 0, so a switch shows in one panel."""
        counts = {w.level: 0 for w in workers}
        for w in workers:
            counts[w.level] += 1
        for s, names in self._levels.items():
            for i, name in enumerate(names):
                self.workers_at_level.labels(name).set(counts.get(name, 0))
                self.load_share.labels(name).set(shares[i] if s is strategy else 0.0)
                if s is not strategy:
                    self.affinity.labels(name).set(0.0)

    def observe_rejected(self, method: str, code: str) -> None:
        self.rejected.labels(method, code).inc()
