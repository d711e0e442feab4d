"""The allocator's one config: every setting of its planning, each defined once.

:class:`ControlConfig` is what ``argus allocator``'s flags fill (through
:class:`~argus.allocator.app.AllocatorSettings`, which holds one), what the simulator's
planned policies run with (:mod:`argus.sim.planned`), and what
:class:`~argus.allocator.control.AllocatorControl` and the
:class:`~argus.allocator.allocator.Allocator` it owns read. The components' own configs
(:class:`~argus.allocator.planner.PlannerConfig`,
:class:`~argus.allocator.predictor.LoadPredictorConfig`) are made from it. The planning period
is in neither: it is :attr:`ControlConfig.period_s` alone, which the allocator passes to the
planner and the forecast, so they cannot count different periods.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from argus import defaults
from argus.allocator.planner import PlannerConfig, PlannerMode
from argus.allocator.predictor import LoadPredictorConfig
from argus.allocator.queueing import CapSource, QueueModel, ServiceSpread
from argus.allocator.strategy import StrategyConfig
from argus.slo import default_slo_s
from argus.types import ProfileSet, Strategy


class StrategyChoice(enum.StrEnum):
    """Which strategy runs while retrieval is healthy (the first is the default)."""

    BEST = "best"  # plan AC and SM each period, keep the better objective (§3.1, §4.6)
    AC_FIRST = "ac-first"  # AC; SM only while retrieval is slow or down (the paper, §4.6)


@dataclass(frozen=True)
class ControlConfig:
    """How the allocator plans; each ``argus allocator`` flag maps to one field (the
    retrieval flags to :attr:`retrieval`'s). The planner's and the forecast's configs are
    made from it (:meth:`planner_config`, :meth:`forecast_config`), and :attr:`period_s`,
    which both read, is passed to them, so no shared setting has a second field to drift."""

    period_s: float = defaults.PLANNING_PERIOD_S
    """Re-plan at least this often, seconds (the paper: every minute). Also the load
    forecast's counting period and the period the planner amortises switching cost over."""

    heartbeat_s: float = defaults.HEARTBEAT_S
    """Interval workers are told to send heartbeats at, seconds."""

    missed_heartbeats: int = 3
    """A worker silent for this many intervals is dead and planned around."""

    switch_margin: float = 1.5
    """Load margin of the plans made within one period after a forced AC → SM switch (§4.6):
    SDXL at K=0 serves while the small variants load, so plan for more than the forecast."""

    background_loads: bool = True
    """Workers load a new model beside the one they serve and keep serving it until the new
    one is ready (§4.6: the GPU holds both; the worker's registry and the simulated cluster do
    this), so a plan's model load forgoes no work and the planner charges none. False: the
    workers stop while loading (a GPU too small to hold two models), and each load is charged
    the work it forgoes, × :attr:`switch_cost_weight`."""

    switch_cost_weight: float = 1.0
    """Weight of the forgone work of a model load in the objective, when the workers stop
    while loading (:attr:`background_loads` False); 0 plans as if loads were free."""

    backlog_replan_per_worker: float = 2.0
    """Queued requests per live worker above which a plan is made before the period ends."""

    min_replan_interval_s: float = 10.0
    """Backlog and surge re-plans (the workers' queues, a router's request, a jump in the
    arrival rate) at most this often. Also how much of an open period must pass before its
    arrival rate counts in the forecast."""

    surge_factor: float = 1.2
    """Re-plan before the period ends when the forecast, the open period's rate included,
    exceeds the load the plan was made for by this factor."""

    max_workers: int = defaults.MAX_WORKERS
    """Workers tracked at most; further joins get RESOURCE_EXHAUSTED."""

    max_routers: int = 1024
    """Router ids whose last report sequence is remembered (oldest forgotten first)."""

    strategies: tuple[Strategy, ...] = (Strategy.AC, Strategy.SM)
    """Strategies plans may use (those the profile has levels for); the better one is run."""

    retrieval: StrategyConfig = field(default_factory=StrategyConfig)
    """When retrieval is too slow for AC and when it has recovered."""

    histogram_window: int = defaults.HISTOGRAM_WINDOW
    """Classified prompts the class histogram H looks back over (the paper: 1000)."""

    backlog_drain_s: float = 60.0
    """Requests waiting on the workers (not those in service) are planned to drain within
    this many seconds, on top of the forecast (0: ignore the backlog). Without it a plan sized
    to the arrival rate alone never catches up with a queue built before it. Headroom for
    the queue that arrivals build comes from the planner's queue model, not from here."""

    planner: PlannerMode = PlannerMode.JOINT
    """``joint``: one program over (prompt class × level) with Q(v | c); ``paper``: Eq. 1
    with level averages, then ODA (the ablation)."""

    strategy_choice: StrategyChoice = StrategyChoice.BEST
    """``best``: each plan solves AC and SM and keeps the better objective (§3.1, §4.6), with a
    hysteresis in favour of the strategy in force; ``ac-first``: AC while retrieval is healthy,
    as the paper's prototype. Either way retrieval trouble leaves SM alone. ``best`` is the
    default since the planner stopped charging background loads as lost work: until then it
    kept AC at 0.8-0.9 of capacity where SM serves better (README, `argus evaluate`)."""

    histogram_prior_prompts: int = 100
    """Until a strategy's class histogram holds this many classified prompts, the planner
    fills it up to this many with the classifier's calibration shares (``ClassQuality.prior``),
    so the objectives ``best`` compares, and the first plans, are made from a histogram of at
    least this many prompts; 0 plans with what was observed alone (uniform before the first).
    100 as the gate it replaces, which kept the strategy in force until 100 prompts were
    classified (chosen on seeds 10-14 of ``argus evaluate``'s workloads, none of them an
    evaluation seed: 100 and 50 served alike at 0.8 and 1.3 of capacity)."""

    slo_s: float | None = None
    """The SLO the queue model plans against, seconds; None: the shared rule
    (:func:`argus.slo.default_slo_s`) on the profile's first worker class (the router's
    default deadline)."""

    queueing: bool = True
    """Plan each level's utilisation so the expected wait fits in the SLO; False plans every
    level up to its peak throughput."""

    caps: CapSource = CapSource.ANALYTIC
    """Where the queue model's utilisation caps come from: ``analytic`` (Allen–Cunneen over
    Erlang C) or ``measured`` (the simulated queue with :attr:`service_spread`'s service
    times, :func:`argus.allocator.queueing.measured_caps`; ``benchmarks/queueing_caps.py``
    prints both tables). Analytic here, for the live allocator, which has no spread to
    simulate; the simulator's planned policies plan with measured caps
    (:func:`argus.sim.planned.planned_policies` says why)."""

    service_spread: ServiceSpread | None = field(default=None, compare=False)
    """The service-time distribution measured caps simulate (the simulator gives its own);
    ``caps="measured"`` without one fails when a plan is made."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "planner", PlannerMode(self.planner))
        object.__setattr__(self, "strategy_choice", StrategyChoice(self.strategy_choice))
        object.__setattr__(self, "caps", CapSource(self.caps))
        if self.slo_s is not None and not (math.isfinite(self.slo_s) and self.slo_s > 0.0):
            raise ValueError(f"slo_s: must be a finite number > 0, got {self.slo_s}")
        for name in ("period_s", "heartbeat_s", "backlog_replan_per_worker", "surge_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value}")
        if not (math.isfinite(self.min_replan_interval_s) and self.min_replan_interval_s >= 0):
            raise ValueError(
                f"min_replan_interval_s: must be a finite number >= 0, "
                f"got {self.min_replan_interval_s}"
            )
        if not (math.isfinite(self.switch_margin) and self.switch_margin >= 1.0):
            raise ValueError(f"switch_margin: must be >= 1, got {self.switch_margin}")
        if not self.backlog_drain_s >= 0.0:
            raise ValueError(f"backlog_drain_s: must be >= 0, got {self.backlog_drain_s}")
        if self.histogram_prior_prompts < 0:
            raise ValueError(
                f"histogram_prior_prompts: must be >= 0, got {self.histogram_prior_prompts}"
            )
        for name in ("missed_heartbeats", "max_workers", "max_routers", "histogram_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.strategies:
            raise ValueError("strategies: at least one strategy must be allowed")

    @property
    def dead_after_s(self) -> float:
        """Silence after which a worker is dead."""
        return self.missed_heartbeats * self.heartbeat_s

    def forecast_config(self) -> LoadPredictorConfig:
        """The load forecast the plans are made for: the expected rate, not a peak.

        With queueing headroom in the planner, the forecast is an EWMA of the per-period
        rates (weight 0.5 on the newest), raised to the open period's rate once
        ``min_replan_interval_s`` of it has passed (so a re-plan in a burst sees the burst),
        but only when that rate is above the EWMA by more than two Poisson standard
        deviations: ten seconds of 110 QPM Poisson traffic read as 85–135 QPM, and the raw
        rate, in a max, planned 25–50% above the offered load at random and set off surge
        re-plans on noise. A real surge (60 → 180 QPM) still shows after ten seconds. No peak
        term and no flat multiplier.
        """
        return LoadPredictorConfig(
            alpha=0.5,
            peak_window=1,
            peak_fraction=0.0,
            partial_min_s=min(self.min_replan_interval_s, self.period_s),
            partial_z=2.0,
        )

    def slo_for(self, profiles: ProfileSet) -> float:
        """The SLO in seconds: ``slo_s``, or the shared rule on the profile's first class."""
        if self.slo_s is not None:
            return self.slo_s
        return default_slo_s(profiles, profiles.worker_classes[:1])

    def planner_config(self, profiles: ProfileSet) -> PlannerConfig:
        """How each plan is solved for ``profiles`` (the SLO is theirs unless given); the
        period it amortises switching over is :attr:`period_s`, given to each plan."""
        queue = None
        if self.queueing:
            queue = QueueModel(self.slo_for(profiles), caps=self.caps, spread=self.service_spread)
        return PlannerConfig(self.load_cost_weight, mode=self.planner, queue=queue)

    @property
    def load_cost_weight(self) -> float:
        """The weight the planner gives a model load's forgone work: none is forgone when the
        workers keep serving while they load (:attr:`background_loads`)."""
        return 0.0 if self.background_loads else self.switch_cost_weight
