"""The allocator's control loop: statistics and heartbeats in, versioned plans out.

:class:`AllocatorControl` is what the allocator service runs, with no gRPC in it (the
servicer converts and delegates). It owns the product's own control plane, wired the way the
simulator wires it (``argus.sim.planned.PlannedPolicy``):

* :class:`~argus.allocator.allocator.Allocator`: load forecast W_t, class histogram H and
  the plan (the joint program over class × level, or the paper's Eq. 1 + ODA), with
  headroom from queueing against the SLO;
* :class:`~argus.allocator.strategy.StrategyMonitor`: AC↔SM from the workers' retrieval
  reports (§4.6): while retrieval is healthy each plan may solve AC and SM and keep the
  better; while it is slow or down only SM is allowed (``docs/control-plane-internals.md``
  says how the choice and the switch are made);
* :class:`~argus.allocator.membership.Membership`: who is alive.

The allocator is the PASM's one owner: the shift map is part of every plan it publishes, made
from the histogram H of every router's reported classes, and routers sample it as published
until the next plan (they run no ODA of their own, see :mod:`argus.router.routing`). A router
that needs a new one sooner says so in its report (``replan_wanted``, a backlog re-plan).

When plans are made, and why (:class:`~argus.contracts.plans.ReplanReason`):

* at once, inside the call that caused it: a worker joins (its heartbeat's answer already
  carries its level), leaves, or reports retrieval that forces AC → SM; a router asks because
  queues build up (at most once per ``min_replan_interval_s``);
* in :meth:`AllocatorControl.tick`, which a :class:`ControlLoop` thread calls a few times per
  heartbeat interval: a worker missed ``missed_heartbeats`` heartbeats; retrieval recovered
  (SM → AC); the period elapsed since the last plan; the workers' queues exceed
  ``backlog_replan_per_worker`` per live worker (at most once per ``min_replan_interval_s``).

A plan that fails (a solver error) leaves the current plan in force and is retried at the
next tick; the heartbeat or report that caused it is answered as usual.

Time is the ``clock`` passed in (``time.monotonic`` in the service, a fake in tests); every
decision reads it once per call. One lock serialises every call, so a plan and the membership
it was made from always agree. Solves take milliseconds (``benchmarks/bench_solver.py``); a
burst of N joins costs N solves, and each leaves a complete plan behind.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from argus.allocator.allocator import Allocator
from argus.allocator.cache_plan import CachePlanner
from argus.allocator.config import ControlConfig, StrategyChoice
from argus.allocator.measured import MeasuredSpeeds
from argus.allocator.membership import Change, Membership, NotOwnerError
from argus.allocator.paper_eq1 import SolverFactory
from argus.allocator.strategy import StrategyMonitor
from argus.contracts.cache_outlook import CacheOutlook
from argus.contracts.plans import PlannedWorker, PublishedPlan, ReplanReason
from argus.contracts.routers import RouterAnswer, RouterReport
from argus.contracts.workers import HeartbeatAnswer, WorkerReport
from argus.types import ClassQuality, ProfileSet, Strategy

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class PlanStats:
    """What making one plan cost and changed (for metrics; not sent to routers)."""

    changed: bool  # strategy or worker → level assignment differs from the previous plan
    strategy_switched: bool  # strategy differs from the previous plan's
    planning_s: float  # wall time of planning every allowed strategy
    dead_workers: int  # workers found dead and dropped for this plan


PlanListener = Callable[[PublishedPlan, PlanStats], None]


class AllocatorControl:
    """One per allocator process; thread-safe."""

    def __init__(
        self,
        profiles: ProfileSet,
        config: ControlConfig | None = None,
        *,
        clock: Clock | None = None,
        listeners: Sequence[PlanListener] = (),
        epoch: str | None = None,
        backend: SolverFactory | None = None,
        class_quality: Mapping[Strategy, ClassQuality] | None = None,
        classifier_key: str = "",
        cache: CachePlanner | None = None,
    ) -> None:
        """Build the control plane and make the first plan (no workers yet) at once, so
        ``current`` always has one; ``listeners`` receive it and every later plan. ``clock``
        is ``time.monotonic`` unless given. ``class_quality`` is Q(v | c) per strategy, from
        the classifier's calibration, for the joint planner; ``classifier_key`` identifies
        that classifier, and a router that reports another one is logged (its classes are
        priced with a Q that is not theirs). Empty: no check. ``cache``: price AC levels by
        the cache lookups reported (:meth:`report_cache`); None: as hits at their K."""
        self.profiles = profiles
        self.classifier_key = classifier_key
        self.config = config or ControlConfig()
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self._strategies = tuple(s for s in self.config.strategies if profiles.levels_for(s))
        if not self._strategies:
            allowed = ", ".join(s.value for s in self.config.strategies)
            raise ValueError(f"strategies: the profile has no level of {allowed}")
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._listeners = tuple(listeners)
        start = self._clock()
        self._allocator = Allocator(
            profiles,
            self.config,
            start_s=start,
            backend=backend,
            class_quality=class_quality,
            cache=cache,
        )
        self._cache_at = start  # when the cache evidence was last aged
        self._monitor = StrategyMonitor(self.config.retrieval, start=Strategy.AC)
        self._speeds = MeasuredSpeeds()  # the routers' measured worker speeds
        self._members = Membership(self.config.dead_after_s, self.config.max_workers)
        self._router_seq: OrderedDict[str, int] = OrderedDict()
        self._router_owners: OrderedDict[str, str] = OrderedDict()  # router id → identity
        self._router_classifier: OrderedDict[str, str] = OrderedDict()  # keys routers reported
        self._forced_sm = False  # the current plan excludes AC because retrieval is unhealthy
        self._margin_until = -math.inf  # plans before this time use switch_margin
        self._last: PublishedPlan | None = None
        self._pending: tuple[ReplanReason, str, int] | None = None  # a re-plan that failed
        self._answers: dict[str, HeartbeatAnswer] = {}  # replies for the state below
        self._answered_plan: PublishedPlan | None = None
        self._answered_strategy: Strategy | None = None
        with self._lock:
            self._current = self._replan(start, ReplanReason.STARTUP, "allocator started")

    # -- reads -----------------------------------------------------------------------------

    @property
    def current(self) -> PublishedPlan:
        """The latest plan (there is always one)."""
        with self._lock:
            return self._current

    def workers_alive(self) -> int:
        with self._lock:
            return len(self._members)

    def retrieval_healthy(self) -> bool:
        """False while the strategy monitor wants SM."""
        with self._lock:
            return self._monitor.strategy is Strategy.AC

    def class_quality(self, strategy: Strategy) -> ClassQuality | None:
        """The Q(v | c) ``strategy`` is planned with now (None: level averages)."""
        with self._lock:
            return self._allocator.class_quality.get(strategy)

    def routers_on_other_classifier(self) -> int:
        """Routers whose latest report named a classifier other than ``classifier_key``."""
        with self._lock:
            return sum(key != self.classifier_key for key in self._router_classifier.values())

    # -- events ----------------------------------------------------------------------------

    def heartbeat(self, report: WorkerReport, owner: str = "") -> HeartbeatAnswer:
        """Record a worker's heartbeat sent by identity ``owner``; re-plan at once when it
        joined, moved or left, or when its retrieval report forces AC → SM. Raises
        ``MembershipFullError`` on a join beyond ``max_workers``, ``NotOwnerError`` when another
        identity owns the worker id."""
        with self._lock:
            now = self._clock()
            change = self._members.heartbeat(report, now, owner)
            for observation in report.retrieval.observations():
                self._monitor.observe(now, observation)
            who = report.worker_id
            if change is Change.JOINED:
                detail = f"worker {who} joined at {report.address}"
                self._attempt(now, ReplanReason.WORKER_JOINED, detail)
            elif change is Change.MOVED:
                detail = f"worker {who} moved to {report.address}"
                self._attempt(now, ReplanReason.WORKER_JOINED, detail)
            elif change is Change.LEFT:
                self._attempt(now, ReplanReason.WORKER_LEFT, f"worker {who} left")
            elif self._switch_due(now):
                self._attempt(now, ReplanReason.STRATEGY_SWITCH, self._switch_detail())
            return self._answer(report.worker_id)

    def report_cache(self, lookups: CacheOutlook) -> None:
        """The AC lookups seen since the last call: the evidence the next plans price AC
        levels with (older evidence ages by the planner's half-life). Ignored without a
        cache planner."""
        with self._lock:
            planner = self._allocator.cache
            if planner is None:
                return
            now = self._clock()
            allocator = self._allocator
            allocator.cache_outlook = planner.merged(
                allocator.cache_outlook, lookups, now - self._cache_at
            )
            self._cache_at = now

    def report_router(self, report: RouterReport, owner: str = "") -> RouterAnswer:
        """Feed a router's arrivals, each at its weight in full requests
        (:meth:`RouterReport.arrival_weights`: the demand planned for is their sum), and its
        classifications to the forecast and H; a retried report (sequence not above the last
        one seen) counts nothing. A router id belongs to the identity ``owner`` whose report
        first used it: ``NotOwnerError`` for another."""
        with self._lock:
            now = self._clock()
            self._bind_router(report.router_id, owner)
            if self._duplicate(report):
                return RouterAnswer(self._current.version, duplicate=True)
            self._adopt_class_quality(report)
            self._check_classifier(report)
            self._speeds.observe(report.router_id, report.measured, now)
            # each arrival weighs what it costs in full requests (1 unless the router says)
            weights = report.arrival_weights()
            if report.arrival_ages_s:  # oldest first, so no arrival reads as late
                aged = sorted(zip(report.arrival_ages_s, weights, strict=True), reverse=True)
                for age, weight in aged:
                    self._allocator.observe_arrival(now - age, weight)
            else:
                for weight in weights:
                    self._allocator.observe_arrival(now, weight)
            for strategy, indices in report.classified:
                for index in indices:
                    self._allocator.observe_classification(strategy, index)
            if report.replan_wanted and self._since_plan(now) >= self.config.min_replan_interval_s:
                detail = f"router {report.router_id} sees queues building up"
                self._attempt(now, ReplanReason.BACKLOG, detail)
            return RouterAnswer(self._current.version, duplicate=False)

    def tick(self) -> PublishedPlan | None:
        """Make the plan that time alone calls for, if any: dead workers, recovered
        retrieval, the period, a backlog. Returns the new plan or None."""
        with self._lock:
            now = self._clock()
            if self._pending is not None:
                reason, detail, dead_count = self._pending
                return self._attempt(now, reason, f"{detail} (retried)", dead_count)
            dead = self._members.expire(now)
            if dead:
                detail = f"{_workers(dead)} missed {self.config.missed_heartbeats} heartbeats"
                return self._attempt(now, ReplanReason.WORKER_DEAD, detail, len(dead))
            if self._switch_due(now):
                return self._attempt(now, ReplanReason.STRATEGY_SWITCH, self._switch_detail())
            if self._since_plan(now) >= self.config.period_s:
                return self._attempt(now, ReplanReason.PERIODIC, "planning period elapsed")
            if self._backlogged(now):
                return self._attempt(now, ReplanReason.BACKLOG, "worker queues building up")
            surge = self._surge(now)
            if surge is not None:
                return self._attempt(now, ReplanReason.LOAD_SURGE, surge)
            return None

    # -- planning --------------------------------------------------------------------------

    def _attempt(
        self, now: float, reason: ReplanReason, detail: str, dead: int = 0
    ) -> PublishedPlan | None:
        """:meth:`_replan`, but a failure (a solver error) keeps the current plan in force and
        leaves the re-plan pending for the next tick instead of failing the caller: a worker's
        heartbeat must not fail because a solve did."""
        try:
            published = self._replan(now, reason, detail, dead)
        except Exception:
            log.exception("plan (%s) failed; the current plan stays in force", reason.value)
            if self._pending is None:
                self._pending = (reason, detail, dead)
            return None
        self._pending = None
        return published

    def _replan(
        self, now: float, reason: ReplanReason, detail: str, dead: int = 0
    ) -> PublishedPlan:
        """Plan the live workers with the allowed strategies, publish, return the plan."""
        late = self._members.expire(now)  # never plan a worker that is already dead
        if late:
            detail += f"; {_workers(late)} missed {self.config.missed_heartbeats} heartbeats"
        previous = self._last
        was_forced = self._forced_sm
        allowed = self._allowed(now, previous)
        if was_forced and not self._forced_sm:
            prefer = Strategy.AC  # back from a forced SM: AC is the default (§4.6)
        else:
            prefer = previous.plan.strategy if previous else self._strategies[0]
        margin = self.config.switch_margin if now < self._margin_until else 1.0
        members = self._members.members()
        self._allocator.use_profiles(self._speeds.profiles(self.profiles, now))
        started = time.perf_counter()
        plan = self._allocator.plan_best(
            now, self._members.view(), allowed, prefer=prefer, load_margin=margin
        )
        planning_s = time.perf_counter() - started
        assignment = plan.allocation.assignment
        published = PublishedPlan(
            epoch=self.epoch,
            plan=plan,
            reason=reason,
            detail=detail,
            workers=tuple(
                PlannedWorker(
                    m.worker_id,
                    m.report.address,
                    m.report.worker_class,
                    assignment[m.worker_id],
                    m.report.queue_length,
                )
                for m in members
            ),
            load_margin=margin,
            retrieval_healthy=not self._forced_sm,
        )
        switched = previous is not None and previous.plan.strategy is not plan.strategy
        changed = previous is None or switched or previous.plan.allocation.assignment != assignment
        stats = PlanStats(changed, switched, planning_s, dead + len(late))
        self._current = self._last = published
        log.info("plan %d (%s): %s; %s", plan.version, reason.value, detail, plan.strategy.value)
        for listener in self._listeners:
            try:
                listener(published, stats)
            except Exception:  # a broken listener must not stop planning
                log.exception("plan listener failed")
        return published

    def _allowed(self, now: float, previous: PublishedPlan | None) -> tuple[Strategy, ...]:
        """While retrieval is healthy: AC (``ac-first``) or every configured strategy
        (``best``); SM alone while it is not."""
        fallback = tuple(s for s in self._strategies if s is not Strategy.AC)
        if Strategy.AC not in self._strategies or not fallback:
            self._forced_sm = False
            return self._strategies
        if self._monitor.decide(now) is Strategy.AC:
            self._forced_sm = False
            if self.config.strategy_choice is StrategyChoice.AC_FIRST:
                return (Strategy.AC,)
            return self._strategies
        if previous is not None and previous.plan.strategy is Strategy.AC:
            self._margin_until = now + self.config.period_s  # cover the reload (§4.6)
        self._forced_sm = True
        return fallback

    def _switch_due(self, now: float) -> bool:
        """Retrieval went bad under an AC plan, or recovered under a forced SM plan."""
        if Strategy.AC not in self._strategies or len(self._strategies) < 2:
            return False
        healthy = self._monitor.decide(now) is Strategy.AC
        if healthy:
            return self._forced_sm
        return self._current.plan.strategy is Strategy.AC

    def _switch_detail(self) -> str:
        c = self._monitor.config
        if self._monitor.strategy is Strategy.SM:
            return f"retrieval p99 above {c.threshold_s:g} s or failing: AC → SM"
        return f"retrieval probes healthy for {c.window_s:g} s: AC allowed again"

    def _backlogged(self, now: float) -> bool:
        live = self._members.members()
        if not live or self._since_plan(now) < self.config.min_replan_interval_s:
            return False
        queued = sum(m.report.queue_length for m in live)
        return queued > self.config.backlog_replan_per_worker * len(live)

    def _surge(self, now: float) -> str | None:
        """A description when arrivals run ``surge_factor`` above the load the current plan
        was made for (at most once per ``min_replan_interval_s``), else None."""
        if self._since_plan(now) < self.config.min_replan_interval_s:
            return None
        planned = self._current.plan.forecast.qpm * self._current.load_margin
        seen = self._allocator.forecast(now).qpm
        if seen <= max(planned * self.config.surge_factor, planned + 1.0):
            return None
        return f"arrivals at {seen:.0f} QPM, the plan was made for {planned:.0f} QPM"

    def _since_plan(self, now: float) -> float:
        return now - self._current.plan.created_at_s

    def _bind_router(self, router_id: str, owner: str) -> None:
        """Bind ``router_id`` to ``owner`` on its first report, refuse it to anyone else. The
        bindings of the routers that reported least recently go first, beyond twice
        ``max_routers`` (a router that was silent that long may come back under any
        identity)."""
        bound = self._router_owners.get(router_id)
        if bound is not None and bound != owner:
            raise NotOwnerError(
                f"router_id: {router_id!r} belongs to another identity; "
                f"{owner or 'an anonymous caller'} may not report for it"
            )
        self._router_owners[router_id] = owner
        self._router_owners.move_to_end(router_id)
        while len(self._router_owners) > 2 * self.config.max_routers:
            self._router_owners.popitem(last=False)

    def _duplicate(self, report: RouterReport) -> bool:
        """True for a retried report; remembers the sequence of a new one."""
        if report.sequence == 0:
            return False
        last = self._router_seq.get(report.router_id, 0)
        if report.sequence <= last:
            return True
        self._router_seq[report.router_id] = report.sequence
        self._router_seq.move_to_end(report.router_id)
        while len(self._router_seq) > self.config.max_routers:
            self._router_seq.popitem(last=False)
        return False

    def _adopt_class_quality(self, report: RouterReport) -> None:
        """Plan with the Q(v | c) a router reports for a retrained strategy, and expect its
        classifier identity from now on (a router that retrains classifies into new classes;
        pricing them with the artifact's Q would be wrong). With several routers the latest
        report wins, and the others are then logged as classifying with another classifier."""
        for quality in report.class_quality:
            if self._allocator.class_quality.get(quality.strategy) == quality:
                continue
            self._allocator.class_quality[quality.strategy] = quality
            log.info(
                "router %s retrained its %s classifier (%s): planning with its Q(v | c) (%s)",
                report.router_id,
                quality.strategy.value,
                report.classifier or "no identity",
                quality.source,
            )
        if report.class_quality and report.classifier:
            self.classifier_key = report.classifier

    def _check_classifier(self, report: RouterReport) -> None:
        """Remember the classifier ``report`` names; warn when it changes to one that is not
        ``classifier_key`` (once per router and key, not once per report)."""
        if not self.classifier_key or not report.classifier:
            return
        if self._router_classifier.get(report.router_id) == report.classifier:
            return
        self._router_classifier[report.router_id] = report.classifier
        self._router_classifier.move_to_end(report.router_id)
        while len(self._router_classifier) > self.config.max_routers:
            self._router_classifier.popitem(last=False)
        if report.classifier != self.classifier_key:
            log.warning(
                "router %s classifies with classifier %s, but the allocator plans with the "
                "Q(v | c) of classifier %s: its classes are priced with another classifier's "
                "quality (give the router and the allocator the same --classifier)",
                report.router_id,
                report.classifier,
                self.classifier_key,
            )

    def _answer(self, worker_id: str) -> HeartbeatAnswer:
        """The reply to ``worker_id``'s heartbeat. Replies change only with the plan or the
        strategy the monitor wants, so they are kept per worker until either changes (a
        heartbeat per worker per second built the same frozen value again and again)."""
        plan, strategy = self._current, self._monitor.strategy
        if plan is not self._answered_plan or strategy is not self._answered_strategy:
            self._answered_plan, self._answered_strategy = plan, strategy
            self._answers.clear()
        answer = self._answers.get(worker_id)
        if answer is None:
            answer = self._answers[worker_id] = self._new_answer(worker_id)
        return answer

    def _new_answer(self, worker_id: str) -> HeartbeatAnswer:
        plan = self._current.plan
        return HeartbeatAnswer(
            plan_version=plan.version,
            strategy=plan.strategy,
            assigned_level=plan.allocation.assignment.get(worker_id, ""),
            probe_retrieval=self._monitor.strategy is Strategy.SM,
            probe_interval_s=self._monitor.config.probe_interval_s,
            heartbeat_interval_s=self.config.heartbeat_s,
            epoch=self.epoch,
        )


def _workers(ids: Sequence[str]) -> str:
    return ("worker " if len(ids) == 1 else "workers ") + ", ".join(ids)


class ControlLoop:
    """A daemon thread that calls :meth:`AllocatorControl.tick` every ``interval_s`` seconds
    of real time (the control's own clock decides what is due). Errors are logged and the
    loop goes on: a failed plan must not stop the next one."""

    def __init__(self, control: AllocatorControl, interval_s: float) -> None:
        if not interval_s > 0.0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.control = control
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="allocator-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.control.tick()
            except Exception:
                log.exception("allocator tick failed")
