"""The allocator's state: predictors plus the last plan, and the call that makes the next one.

The live allocator service and the simulator both own one :class:`Allocator`. They feed it
arrivals and classifier decisions as they happen and call :meth:`Allocator.plan` every period
and whenever a worker dies or joins; it returns a new :class:`~argus.types.Plan` and never
touches a worker itself (decide, then act). Time is always the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from argus.allocator.cache_plan import CachePlanner
from argus.allocator.config import ControlConfig
from argus.allocator.paper_eq1 import SolverFactory
from argus.allocator.planner import make_plan
from argus.allocator.predictor import AffinityHistogram, LoadPredictor
from argus.contracts.cache_outlook import CacheOutlook
from argus.types import ClassQuality, ClusterView, LoadForecast, Plan, ProfileSet, Strategy


class Allocator:
    """Observes the workload and decides plans; one per cluster."""

    def __init__(
        self,
        profiles: ProfileSet,
        config: ControlConfig | None = None,
        *,
        start_s: float = 0.0,
        backend: SolverFactory | None = None,
        class_quality: Mapping[Strategy, ClassQuality] | None = None,
        cache: CachePlanner | None = None,
    ) -> None:
        """``config``: the allocator's (its planner's and forecast's configs are made from it,
        the SLO from ``profiles`` unless it gives one). ``class_quality``: Q(v | c) per
        strategy for the joint planner (the classifier's calibration); a strategy without one
        plans with the level averages (Eq. 1). ``cache``: AC plans price each level by what
        the caches find (:attr:`cache_outlook`, :mod:`argus.allocator.cache_plan`); None:
        every AC request is planned as a hit at its level's K."""
        self.profiles = profiles
        self.config = config or ControlConfig()
        self._planner = self.config.planner_config(profiles)
        self._backend = backend
        self.class_quality = dict(class_quality or {})
        self.cache = cache
        self.cache_outlook = CacheOutlook()  # the lookups seen so far (aged by the control)
        self._load = LoadPredictor(
            self.config.forecast_config(), start_s=start_s, period_s=self.config.period_s
        )
        self._affinity = AffinityHistogram(
            {s: len(profiles.levels_for(s)) for s in Strategy if profiles.levels_for(s)},
            self.config.histogram_window,
        )
        self._last: Plan | None = None

    def use_profiles(self, profiles: ProfileSet) -> None:
        """Plan with ``profiles`` from now on: the same levels and classes at another speed
        (the workers' measured one, :mod:`argus.allocator.measured`)."""
        self.profiles = profiles

    def forecast(self, now_s: float) -> LoadForecast:
        """The load forecast at ``now_s`` (arrivals only, no backlog)."""
        return self._load.forecast(now_s)

    def observe_arrival(self, arrival_s: float, weight: float = 1.0) -> None:
        """A prompt arrived at the router (for the load forecast), weighing ``weight`` full
        requests (an edit's share of a batched step: ``RouterReport.arrival_costs``)."""
        self._load.observe(arrival_s, weight)

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
        flap between near-equal strategies; when the kept plan cannot serve the whole forecast
        (saturated), the better objective wins outright, since every period spent on the
        worse plan then costs refused requests: on Azure arrivals at 1.2 x capacity (tuning
        seeds 10-14 of ``argus evaluate``), Argus stayed on SM, which a burst had made the
        better choice, while AC led by 1.8% at overload, and refused 14.1% of the requests
        against 10.8% with this rule. The objectives compared are made from full class
        histograms from the first plan on (:meth:`histogram`).
        """
        if not strategies:
            raise ValueError("strategies: at least one strategy must be allowed")
        forecast = self._planned_load(now_s, workers)
        candidates = [self._candidate(forecast, workers, s, load_margin) for s in strategies]
        best = max(candidates, key=lambda plan: plan.allocation.objective)
        kept = next((plan for plan in candidates if plan.strategy is prefer), None)
        if kept is not None:
            margin = 0.0 if kept.allocation.saturated else hysteresis
            kept_objective = kept.allocation.objective
            if best.allocation.objective <= kept_objective + margin * abs(kept_objective):
                best = kept
        self._last = best
        return best

    def _candidate(
        self, forecast: LoadForecast, workers: ClusterView, strategy: Strategy, load_margin: float
    ) -> Plan:
        """A plan for ``strategy`` following the last one; does not change the allocator."""
        planner = self._planner
        if load_margin != planner.load_margin:
            planner = replace(planner, load_margin=load_margin)
        profiles, quality = self.profiles, self.class_quality.get(strategy)
        if self.cache is not None and strategy is Strategy.AC:
            quality = self.cache.quality(
                profiles,
                quality or ClassQuality.from_levels(profiles.levels_for(strategy)),
                self.cache_outlook,
            )
            profiles = self.cache.profiles(profiles, self.cache_outlook)
        return make_plan(
            profiles,
            strategy,
            workers,
            forecast,
            self.histogram(strategy),
            config=planner,
            period_s=self.config.period_s,
            previous=self._last,
            backend=self._backend,
            class_quality=quality,
        )

    def histogram(self, strategy: Strategy) -> tuple[float, ...]:
        """The class histogram H ``strategy`` is planned with: the classes of the last prompts
        classified, and while they are fewer than ``ControlConfig.histogram_prior_prompts``,
        the classifier's calibration shares (``ClassQuality.prior``) for the rest. A histogram
        of a few dozen prompts is noise: with the strategy in force kept until 100 were
        classified instead, Argus served AC for the first two minutes of a run at 0.7 of
        capacity where PAC, planning with level averages, moved to SM after ten seconds."""
        quality = self.class_quality.get(strategy)
        if quality is None:
            return self._affinity.histogram(strategy)
        prompts = self.config.histogram_prior_prompts
        return self._affinity.histogram(strategy, quality.prior, prompts)

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
