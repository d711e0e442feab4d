"""The allocator's state: predictors plus the last plan, and the call that makes the next one.

The live allocator service and the simulator both own one :class:`Allocator`. They feed it
arrivals and classifier decisions as they happen and call :meth:`Allocator.plan` every period
and whenever a worker dies or joins; it returns a new :class:`~argus.types.Plan` and never
touches a worker itself (decide, then act). Time is always the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from argus.allocator.planner import PlannerConfig, make_plan
from argus.allocator.predictor import AffinityHistogram, LoadPredictor, LoadPredictorConfig
from argus.allocator.solver import SolverFactory
from argus.types import ClassQuality, ClusterView, LoadForecast, Plan, ProfileSet, Strategy


@dataclass(frozen=True)
class AllocatorConfig:
    """Everything the allocator needs besides profiles."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """How a plan is solved: period, switching cost weight, load margin."""

    forecast: LoadPredictorConfig = field(default_factory=LoadPredictorConfig)
    """How W_t is forecast; its period must equal the planner's."""

    histogram_window: int = 1000
    """Classified prompts the affinity histogram H looks back over (the paper uses 1000)."""

    backlog_drain_s: float = 60.0
    """Requests waiting on the workers (not those in service) are planned to drain within
    this many seconds, on top of the forecast (0: ignore the backlog). Without it a plan sized
    to the arrival rate alone never catches up with a queue built before it. Headroom for
    the queue that arrivals build comes from the planner's queue model, not from here."""

    def __post_init__(self) -> None:
        if not self.backlog_drain_s >= 0.0:
            raise ValueError(f"backlog_drain_s: must be >= 0, got {self.backlog_drain_s}")
        if self.forecast.period_s != self.planner.period_s:
            raise ValueError(
                f"forecast.period_s ({self.forecast.period_s}) must equal planner.period_s "
                f"({self.planner.period_s}): the forecast is for the next planning period"
            )
        if self.histogram_window < 1:
            raise ValueError(f"histogram_window: must be >= 1, got {self.histogram_window}")


class Allocator:
    """Observes the workload and decides plans; one per cluster."""

    def __init__(
        self,
        profiles: ProfileSet,
        config: AllocatorConfig | None = None,
        *,
        start_s: float = 0.0,
        backend: SolverFactory | None = None,
        class_quality: Mapping[Strategy, ClassQuality] | None = None,
    ) -> None:
        """``class_quality``: Q(v | c) per strategy for the joint planner (the classifier's
        calibration); a strategy without one plans with the level averages (Eq. 1)."""
        self.profiles = profiles
        self.config = config or AllocatorConfig()
        self._backend = backend
        self.class_quality = dict(class_quality or {})
        self._load = LoadPredictor(self.config.forecast, start_s=start_s)
        self._affinity = AffinityHistogram(
            {s: len(profiles.levels_for(s)) for s in Strategy if profiles.levels_for(s)},
            self.config.histogram_window,
        )
        self._last: Plan | None = None

    def use_profiles(self, profiles: ProfileSet) -> None:
        """Plan with ``profiles`` from now on: the same levels and classes at another speed
        (the workers' measured one, :mod:`argus.allocator.measured`)."""
        self.profiles = profiles

    @property
    def last_plan(self) -> Plan | None:
        return self._last

    def forecast(self, now_s: float) -> LoadForecast:
        """The load forecast at ``now_s`` (arrivals only, no backlog)."""
        return self._load.forecast(now_s)

    def observe_arrival(self, arrival_s: float) -> None:
        """A prompt arrived at the router (for the load forecast)."""
        self._load.observe(arrival_s)

    def observe_classification(self, strategy: Strategy, level_index: int) -> None:
        """The classifier of ``strategy`` chose ``level_index`` as a prompt's optimal level."""
        self._affinity.observe(strategy, level_index)

    def plan(
        self, now_s: float, workers: ClusterView, strategy: Strategy, *, load_margin: float = 1.0
    ) -> Plan:
        """Make the plan for the next period from what was observed up to ``now_s``.

        ``workers`` carries liveness, each worker's current level (for the switching cost) and
        queue length (the backlog to drain); ``load_margin`` > 1 over-provisions further, as
        during the AC→SM switch (1.5 in the paper). The plan's forecast is the load planned
        for: the predicted arrival rate plus the backlog's drain rate.
        """
        plan = self._candidate(self._planned_load(now_s, workers), workers, strategy, load_margin)
        self._last = plan
        return plan

    def plan_best(
        self,
        now_s: float,
        workers: ClusterView,
        strategies: Sequence[Strategy],
        *,
        prefer: Strategy,
        hysteresis: float = 0.02,
        load_margin: float = 1.0,
    ) -> Plan:
        """Plan every allowed strategy and keep the one with the best objective (§3.1, §4.6).

        Argus runs one strategy at a time (never a mix). The objectives are comparable
        because each strategy's Q is relative to the same SDXL; the switching cost charges the
        model loads a change of strategy needs. ``prefer`` (the strategy running now) is kept
        unless another beats it by more than ``hysteresis`` of its objective, so plans do not
        flap between near-equal strategies.
        """
        if not strategies:
            raise ValueError("strategies: at least one strategy must be allowed")
        forecast = self._planned_load(now_s, workers)
        candidates = [self._candidate(forecast, workers, s, load_margin) for s in strategies]
        best = max(candidates, key=lambda plan: plan.allocation.objective)
        kept = next((plan for plan in candidates if plan.strategy is prefer), None)
        if kept is not None and best.allocation.objective <= kept.allocation.objective + (
            hysteresis * abs(kept.allocation.objective)
        ):
            best = kept
        self._last = best
        return best

    def _candidate(
        self, forecast: LoadForecast, workers: ClusterView, strategy: Strategy, load_margin: float
    ) -> Plan:
        """A plan for ``strategy`` following the last one; does not change the allocator."""
        planner = self.config.planner
        if load_margin != planner.load_margin:
            planner = replace(planner, load_margin=load_margin)
        return make_plan(
            self.profiles,
            strategy,
            workers,
            forecast,
            self._affinity.histogram(strategy),
            config=planner,
            previous=self._last,
            backend=self._backend,
            class_quality=self.class_quality.get(strategy),
        )

    def _planned_load(self, now_s: float, workers: ClusterView) -> LoadForecast:
        """The forecast arrival rate plus the drain rate of the requests already waiting (a
        worker's queue length counts the request in service too, which needs no capacity
        beyond what it already has)."""
        forecast = self._load.forecast(now_s)
        if self.config.backlog_drain_s == 0.0:
            return forecast
        backlog = sum(max(0, w.queue_length - 1) for w in workers.alive())
        drain_qpm = backlog * 60.0 / self.config.backlog_drain_s
        return replace(forecast, qpm=forecast.qpm + drain_qpm)
