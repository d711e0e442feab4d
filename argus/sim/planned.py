"""The policies that follow the allocator's plans (Argus, its ablations, PAC, Proteus), run
through the product's own control loop on the simulated clock.

A :class:`PlannedPolicy` owns what the live cluster runs, unchanged:

* the allocator's :class:`~argus.allocator.control.AllocatorControl` (membership from
  heartbeats, re-plan triggers, the AC↔SM switch and its margin, the planner), with the
  simulator's clock as its clock;
* the router's decision, :class:`~argus.router.policy.RouterPolicy` (early admission before
  the classifier, level caps and the capped-level fallback, PASM sampling, Eq. 3 worker
  selection, spill, admission on the chosen worker) and its plan's backlog signal.

and plays the parts of the processes around them the way they talk live: every
``heartbeat_s`` of simulated time each live worker sends its heartbeat (queue length, level,
the retrievals it saw, probes while the allocator asks for them) and the router sends its
report (arrivals, classifications, whether queues are building up); then the control's
``tick`` runs. A dead GPU simply stops sending heartbeats and is planned around once the
allocator notices, as live. The router's service times are the profile's latencies (the
simulated workers run them); the baselines that do not plan are admitted by the same check
(:func:`argus.router.policy.admit_on`) with the same rule.

The policies differ only by a :class:`PlannedConfig`: which planner and strategies the
control runs, whether routing looks at the prompt, and which classifier.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from argus.allocator.cache_plan import CachePlanner
from argus.allocator.config import ControlConfig, StrategyChoice
from argus.allocator.control import AllocatorControl
from argus.allocator.planner import PlannerMode
from argus.allocator.queueing import CapSource
from argus.contracts.cache_outlook import CacheOutlook
from argus.contracts.router_api import RouterRequest
from argus.contracts.routers import RouterReport
from argus.contracts.workers import RetrievalReport, WorkerReport
from argus.profiles.cache_evidence import SimilarityBins
from argus.router.config import RouterServiceConfig, RoutingConfig
from argus.router.policy import Refused, RouterPolicy, Snapshot
from argus.router.values import Refusal
from argus.sim.classifiers import Classifier, OracleClassifier
from argus.sim.cluster import Dispatch, Policy, SimContext
from argus.sim.cluster_cache import CacheMode
from argus.types import ClusterView, Strategy, WorkerState

SIM_ADDRESS = "sim"  # simulated workers have no address; the membership only stores it
NO_RETRIEVALS = RetrievalReport()  # what every heartbeat but an interval's first carries
# every simulated request is the profile's reference request: default size and steps, cost 1
SIM_REQUEST = RouterRequest(prompt="(simulated)")


@dataclass(frozen=True)
class PlannedConfig:
    """Everything that tells one planned policy from another."""

    control: ControlConfig = field(default_factory=ControlConfig)
    """The allocator's configuration: planner, strategies, switching cost, margins, timers.
    Its ``slo_s`` is set from the simulated cluster's SLO."""

    prompt_aware: bool = True
    """Route each prompt by its class through the PASM; False: by the load shares F alone
    (and plan with level averages: the classifier is not consulted at all)."""

    cache_aware: bool = False
    """Choose among a level's workers by what their caches hold (the realistic cache only;
    :mod:`argus.router.cache_routing`): the worker whose neighbour serves the request
    soonest, admitted at the step that neighbour allows. False: Eq. 3 on the routed K."""

    spill_on_refusal: bool = True
    """Admit a request the chosen worker cannot finish in time on the nearest level that can
    (``RoutingConfig.spill_on_refusal``, the live router's default); False: refuse it."""


class PlannedPolicy(Policy):
    """A policy whose levels and routes come from the allocator's and the router's code."""

    def __init__(
        self,
        name: str,
        config: PlannedConfig,
        classifier: Classifier | None = None,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.config = config
        # the simulated workers load the way the planner believes they do
        self.background_loads = config.control.background_loads
        self.classifier = classifier or OracleClassifier()
        self._seed = seed

    def reset(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self._now = 0.0
        control = replace(self.config.control, slo_s=ctx.slo_s, service_spread=ctx.service_spread)
        quality = None
        if self.config.prompt_aware:
            self.classifier.reset(ctx)
            if control.planner is PlannerMode.JOINT:
                quality = self.classifier.class_quality()
        self.cache_planner = None
        self._bins: dict[str, SimilarityBins] = {}  # AC level → its model's similarity bins
        self._bin_counts: dict[str, int] = {}  # AC level → how many bins it has
        if ctx.cache == CacheMode.REALISTIC:
            self.cache_planner = CachePlanner(ctx.cache_rules, ctx.reuse_quality, ctx.lookup_s)
            for level in ctx.profiles.levels_for(Strategy.AC):
                self._bins[level.name] = self.cache_planner.bins(level)
            self._bin_counts = self.cache_planner.bin_counts(ctx.profiles)
        self.control = AllocatorControl(
            ctx.profiles,
            control,
            clock=self._clock,
            epoch="sim",
            class_quality=quality,
            cache=self.cache_planner,
        )
        self._lookups: list[tuple[str, int, float]] = []  # (level, bin, similarity) to report
        routing = RoutingConfig(
            prompt_aware=self.config.prompt_aware,
            spill_on_refusal=self.config.spill_on_refusal,
            backlog_replan_per_worker=control.backlog_replan_per_worker,
            min_replan_interval_s=control.min_replan_interval_s,
            late_binding_window=ctx.late_binding_window,
        )
        aware = self.config.cache_aware and ctx.cache == CacheMode.REALISTIC
        self.decider = RouterPolicy(
            ctx.profiles,
            RouterServiceConfig(routing=routing, admission=ctx.admission_rule),
            random.Random(self._seed),
            cache_rules=ctx.cache_rules if aware else None,
        )
        self.router = self.decider.router  # the installed plan and its backlog signal
        self.binder = self.decider.binder
        self._router_queues: Mapping[str, int] = {}  # the router's queues, held ones in them
        self._plan_levels: dict[str, int] = {}  # worker → its level index in the plan
        self.early_refusals = 0
        self.fallbacks = 0
        self.spills = 0  # admitted at another level than the one routed (spill on refusal)
        self._installed = -1
        self._next_beat = 0.0
        self._next_probe = 0.0
        self._arrivals: list[float] = []
        self._classified: dict[Strategy, list[int]] = {s: [] for s in Strategy}
        self._retrievals: list[float] = []
        self._failures = 0
        self._report_seq = 0
        self._switches = 0
        # worker id -> (its state, the heartbeat sent for it) when that carried no retrievals
        self._reports: dict[str, tuple[WorkerState, WorkerReport] | None] = {}

    @property
    def strategy_switches(self) -> int:
        """Changes of strategy between consecutive plans (for the report)."""
        return self._switches

    def _clock(self) -> float:
        return self._now

    # -- the simulator's hooks ---------------------------------------------------------------

    def observe_arrival(self, now_s: float) -> None:
        self._arrivals.append(now_s)

    def observe_retrieval(self, now_s: float, latency_s: float | None) -> None:
        if latency_s is None:
            self._failures += 1
        else:
            self._retrievals.append(latency_s)

    def observe_lookup(self, now_s: float, level: str, similarity: float) -> None:
        bins = self._bins.get(level)
        if bins is not None and self.decider.cache is None:  # cache-aware: probes instead
            self._lookups.append((level, bins.index(similarity), similarity))

    def _probe(self, dispatch: Dispatch) -> None:
        """A cache-aware router's evidence for the plan, as the live router gathers it
        (:meth:`~argus.router.cache_routing.CacheRouting.probes`): for every request, whatever
        level it is routed to, the closest neighbour any live worker holds. So a plan serving
        SM still learns what AC would find now, and a cold start or a retreat to SM does not
        lock AC out for want of lookups."""
        cache, neighbours = self.decider.cache, dispatch.neighbours
        if cache is None or neighbours is None:
            return
        live = [w for w in self.ctx.worker_ids if w not in dispatch.down]
        self._lookups.extend(cache.probes(neighbours, live))

    def next_timer(self) -> float | None:
        return self._next_beat

    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        """One heartbeat interval: workers' heartbeats, the router's report, the control's
        tick; returns the levels of the plan in force."""
        self._now = now_s
        self._send_heartbeats(view)
        self._send_report(view)
        self._send_lookups()
        self.control.tick()
        self._install(view)
        self._next_beat = now_s + self.control.config.heartbeat_s
        return self.control.current.plan.allocation.assignment

    def decide(self, request: int, now_s: float, dispatch: Dispatch) -> tuple[str, str] | Refused:
        """As the live router: refuse early what no worker can finish in time, else classify
        the prompt, then route and admit it through :class:`RouterPolicy`."""
        decider = self.decider
        self._router_queues = dispatch.queues
        self._probe(dispatch)

        def service_s(worker: str, index: int) -> float:
            return dispatch.latency_s(worker, decider.level_name(index))

        snapshot = Snapshot(
            self._plan_levels,
            dispatch.queues,
            dispatch.down,
            dispatch.elapsed_s,
            service_s,
            neighbours=dispatch.neighbours if decider.cache is not None else None,
        )
        budget = dispatch.budget_s if dispatch.admission is not None else math.inf
        refused = decider.admit_early(SIM_REQUEST, 1.0, snapshot, budget)
        if refused is not None:
            self.early_refusals += refused.kind is not Refusal.UNAVAILABLE
            return refused
        outcome = decider.route(self._optimal(request), SIM_REQUEST, snapshot, budget)
        if isinstance(outcome, Refused):
            return outcome
        decision = outcome.decision
        self.tied_last = outcome.cache is not None
        self.fallbacks += decision.fallback
        self.spills += decision.spilled
        return decision.worker_id, decider.level_name(decision.served_level)

    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        """Route with nothing refused: :meth:`decide` with no admission, at the profile's
        latencies (the simulator calls :meth:`decide`)."""
        profiles, classes = self.ctx.profiles, self.ctx.worker_classes

        def latency_s(worker: str, level: str) -> float:
            return profiles.profile(classes[worker], level).latency_s

        dispatch = Dispatch(queues, down, lambda _: 0.0, latency_s, None, math.inf)
        outcome = self.decide(request, now_s, dispatch)
        if isinstance(outcome, Refused):  # only UNAVAILABLE can be: no live worker
            raise RuntimeError(outcome.details)
        return outcome

    def _optimal(self, request: int) -> int:
        """The prompt's level for the plan's strategy; its classes for both strategies go to
        the allocator's statistics."""
        optimal = 0
        if self.config.prompt_aware:
            strategy = self.router.plan.strategy if self.router.plan else Strategy.AC
            for s in self.ctx.quality:
                c = self._classify(s, request)
                self._classified[s].append(c)
                if s is strategy:
                    optimal = c
        return optimal

    # -- the processes around the control plane ----------------------------------------------

    def _classify(self, strategy: Strategy, request: int) -> int:
        if self.control.config.planner is PlannerMode.JOINT:
            return self.classifier.predict_class(strategy, request)
        return self.classifier.predict_level(strategy, request)

    def _send_heartbeats(self, view: ClusterView) -> None:
        """Every live worker reports; the retrievals of the interval travel with the first
        (the allocator pools them), probes run while the allocator asks for them."""
        retrieval = self._retrieval_report()
        for worker in view.alive():
            answer = self.control.heartbeat(self._report(worker, retrieval))
            retrieval = NO_RETRIEVALS
            self._probe_if_asked(answer.probe_retrieval, answer.probe_interval_s)

    def _report(self, worker: WorkerState, retrieval: RetrievalReport) -> WorkerReport:
        """``worker``'s heartbeat: its last one again when nothing in it changed (most
        seconds, for most workers), else a new one."""
        last = self._reports.get(worker.worker_id)
        if retrieval is NO_RETRIEVALS and last is not None and last[0] == worker:
            return last[1]
        report = WorkerReport(
            worker_id=worker.worker_id,
            address=SIM_ADDRESS,
            worker_class=worker.worker_class,
            queue_length=worker.queue_length,
            level=worker.level,
            retrieval=retrieval,
        )
        self._reports[worker.worker_id] = (worker, report) if retrieval is NO_RETRIEVALS else None
        return report

    def _retrieval_report(self) -> RetrievalReport:
        if not self._retrievals and not self._failures:
            return NO_RETRIEVALS  # the same value, and the heartbeats it rides on repeat
        report = RetrievalReport(samples_s=tuple(self._retrievals), failures=self._failures)
        self._retrievals, self._failures = [], 0
        return report

    def _probe_if_asked(self, asked: bool, interval_s: float) -> None:
        if not asked or self._now < self._next_probe:
            return
        self._next_probe = self._now + interval_s
        self.observe_retrieval(self._now, self.ctx.probe_retrieval(self._now))

    def _send_report(self, view: ClusterView) -> None:
        self._report_seq += 1
        # the router's own count, as live: the requests it holds for a worker (late binding)
        # are in it, where a worker's queue shows only what it was sent
        seen = self._router_queues
        queues = {w.worker_id: seen.get(w.worker_id, w.queue_length) for w in view.workers}
        down = {w.worker_id for w in view.workers if not w.alive}
        wants = self.router.plan is not None and self.router.wants_replan(self._now, queues, down)
        self.control.report_router(
            RouterReport(
                router_id="sim-router",
                sequence=self._report_seq,
                arrivals=len(self._arrivals),
                arrival_ages_s=tuple(self._now - t for t in self._arrivals),
                classified=tuple((s, tuple(levels)) for s, levels in self._classified.items()),
                replan_wanted=wants,
            )
        )
        self._arrivals = []
        self._classified = {s: [] for s in Strategy}

    def _send_lookups(self) -> None:
        """The interval's cache lookups, as a live router would gather them from its workers'
        replies (realistic cache only)."""
        if self.cache_planner is None:
            return
        self.control.report_cache(CacheOutlook.of_lookups(self._lookups, self._bin_counts))
        self._lookups = []

    def _install(self, view: ClusterView) -> None:
        published = self.control.current
        if published.version == self._installed:
            return
        if (
            self.router.plan is not None
            and self.router.plan.strategy is not published.plan.strategy
        ):
            self._switches += 1
        self._installed = published.version
        classes = {w.worker_id: w.worker_class for w in view.workers}
        self.decider.install(published.plan, classes, self._now)
        self._plan_levels = published.plan.allocation.level_indices()


def planned_policies() -> dict[str, PlannedConfig]:
    """The planned policies by name; each differs from Argus only by what its config says.

    * ``argus``: the joint program over (classifier class × level) with Q(v | c) from the
      classifier's calibration; each period it plans AC and SM and serves the better, SM
      alone on retrieval trouble (§4.6; ``StrategyChoice.BEST``); its workers load models in
      the background, so the planner charges a load no forgone work; with the realistic
      cache it chooses among a level's workers by what their caches hold
      (``cache_aware``);
    * ``argus-text``: ``argus`` deciding from the prompt's text alone, Eq. 3 on the routed K
      whatever the caches hold (what ``argus`` was before the router saw the caches); the
      ablations and baselines below derive from it, so only ``argus`` looks at the caches;
    * ``argus-paper``: the paper's prototype as an ablation: Eq. 1 with level averages, then
      ODA on the predicted optimal levels, AC while retrieval is healthy (``AC_FIRST``);
    * ``pac``: prompt-agnostic Argus: the same control loop and strategy choice, planning with
      level averages and routing by the load shares alone;
    * ``proteus``: SM only, prompt-agnostic accuracy scaling with the same solver; its workers
      stop while they load (no background model loads), and its planner counts no switching
      cost (Proteus has none); its model loads cost it the profile's load time as every
      policy's do.

    All four plan with queueing caps measured on the simulator's own service times
    (``CapSource.MEASURED``, the spread the simulation hands them): against the analytic
    bound they kept or raised quality at every load of ``argus evaluate`` (poisson and azure,
    0.3–1.5 × capacity, 5 seeds), with goodput and SLO violations within the intervals. The
    live allocator keeps the analytic caps (:class:`ControlConfig`'s default), having no
    service-time spread to simulate.
    """
    text = PlannedConfig(control=ControlConfig(caps=CapSource.MEASURED))
    argus = replace(text, cache_aware=True)
    paper = replace(
        text.control, planner=PlannerMode.PAPER, strategy_choice=StrategyChoice.AC_FIRST
    )
    return {
        "argus": argus,
        "argus-text": text,
        "argus-paper": replace(text, control=paper),
        "pac": replace(text, prompt_aware=False),
        "proteus": PlannedConfig(
            control=ControlConfig(
                strategies=(Strategy.SM,),
                background_loads=False,
                switch_cost_weight=0.0,
                strategy_choice=StrategyChoice.AC_FIRST,
                caps=CapSource.MEASURED,
            ),
            prompt_aware=False,
        ),
    }
