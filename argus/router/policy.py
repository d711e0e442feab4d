"""The router's decision, apart from what carries it out: :class:`RouterPolicy`.

For one request the policy prices it, refuses it early when no live worker can finish it in
time, caps the levels it may be served at, routes it on the installed plan (PASM sample, Eq. 3
worker selection, the capped-level fallback) and admits it on the chosen worker, or, when that
worker cannot finish it in time, on the nearest level whose quickest worker can (the spill on
refusal; ``RoutingConfig.spill_on_refusal``). It answers
with an :class:`Admitted` route or a :class:`Refused`; it takes no lock, calls no worker,
counts no metric and reads no clock. What it knows of the cluster comes in a
:class:`Snapshot`: each planned worker's level, queue and how long its current request has
run, the workers that are down, and the request's service time on each worker at each level.

Two data planes run it. The live router (:class:`argus.router.core.RouterCore`) takes the
snapshot under its lock, with service times learned from the workers' replies, and around the
decision keeps the request ledger, forwards to the worker and retries. The simulator's planned
policies (:mod:`argus.sim.planned`) route every request through it with the profile's
latencies; the simulator admits the baselines' choices with :func:`admit_on`, the same check.
So early refusals, caps and fallbacks are simulated as they are served.

An inpainting edit, when the config names an edit balancer (``edit_balancer`` other than
"plan"), keeps the plan's level but not its worker: the balancer
(:mod:`argus.router.edit_balance`) chooses among that level's live workers on the snapshot's
account of their requests in flight and the templates they hold (:mod:`argus.router.edit_loads`),
and the edit is admitted on the edit cost model's predicted finish there
(:func:`~argus.router.edit_balance.predict_finish_s`: a worker that holds the template runs it
at its mask ratio, any other in full). The cost model's seconds on a worker are the request's
learned service time there: scaled so that the edit in full, alone, takes it.

A request's steps are worked out in one place, :meth:`RouterPolicy.steps_of` (a
:class:`StepCount`); the core resolves them once and passes them to each decision, and a
caller that passes none (the simulator's reference request) gets them resolved the same way.

It imports neither grpc, protobuf nor prometheus_client.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from argus.contracts.generate import AdapterKind, runs_controlnets
from argus.contracts.router_api import RouterRequest
from argus.profiles.cache_evidence import KRule
from argus.profiles.edit_cost import default_cost_model
from argus.request_limits import img2img_steps
from argus.router.admission import (
    AdmissionRule,
    WorkerLoad,
    admit,
    earliest_completion_s,
    request_cost,
)
from argus.router.cache_routing import CacheChoice, CacheRouting, Neighbours
from argus.router.config import EDIT_BALANCER, RouterServiceConfig
from argus.router.edit_balance import (
    EditBalancer,
    EditJob,
    WorkerSnapshot,
    make_balancer,
    predict_finish_s,
)
from argus.router.edit_loads import NO_EDITS, WorkerEdits, time_scale, worker_snapshot
from argus.router.late_binding import LateBinder
from argus.router.routing import PlanRouter
from argus.router.scheduler import NoLiveWorkerError, nearest_first
from argus.router.values import Refusal, RouterError
from argus.types import Plan, ProfileSet, RouteDecision, Strategy

NO_PLAN = "no plan yet"
NO_LIVE_WORKER = "no live worker left"


@dataclass(frozen=True)
class Refused:
    """A request the policy will not serve, and why, in the words the caller sees."""

    kind: Refusal
    details: str
    retry_after_s: float | None = None
    reason: str = ""
    """What the router's ``rejected`` counter calls it ("deadline"); "" when not counted."""

    def error(self) -> RouterError:
        return RouterError(self.kind, self.details, self.retry_after_s)


@dataclass(frozen=True)
class Admitted:
    """A routed and admitted request: where it goes and when it should finish there."""

    decision: RouteDecision
    predicted_s: float  # predicted completion on the chosen worker, seconds from now
    balancer: str = ""  # the edit balancer that chose the worker; "": the plan did
    held: bool = False  # the chosen worker was believed to hold the edit's template
    cache: CacheChoice | None = None
    """The cache-aware choice of worker (the step its neighbour allows, the similarity);
    None: the worker was chosen without looking at the caches."""


@dataclass(frozen=True)
class StepCount:
    """A request's denoising steps as the router counts them, resolved once per request
    (:meth:`RouterPolicy.steps_of`, where the core has checked it) and passed on to every
    decision that needs them."""

    given: int | None
    """The request's steps, else the workers' default when the config names one
    (``default_steps``); None: left to a worker's default the router does not know."""
    counted: int
    """``given``, else the profile's reference request's steps: what the router prices and
    predicts service times with."""
    run: int
    """The steps the worker denoises: ``counted``, or an img2img edit's last ``strength`` of
    them (:func:`~argus.request_limits.img2img_steps`)."""


ServiceTime = Callable[[str, int], float]
"""The request's service time on a worker at a level index, seconds (already × its cost)."""


@dataclass(frozen=True)
class Snapshot:
    """The cluster at the moment of one decision. The simulator builds one per request, so
    what costs a pass over the workers is a function, asked only for the workers a decision
    looks at."""

    levels: Mapping[str, int]  # each worker of the installed plan → its level index there
    queues: Mapping[str, int]  # requests sent and not answered (+1 while it drops abandoned work)
    down: AbstractSet[str]  # down, or already tried for this request
    elapsed_s: Callable[[str], float]  # how long the request a worker is serving has run
    service_s: ServiceTime
    edits: Callable[[str], WorkerEdits] | None = None
    """Each worker's requests in flight and templates held, for the edit balancer (None: not
    kept, as in the simulator's planned policies: edits are routed on the plan)."""
    neighbours: Neighbours | None = None
    """The request's nearest cached neighbour on each worker (:data:`~argus.router.
    cache_routing.Neighbours`); None: the worker is chosen without looking at the caches."""


def admit_on(
    rule: AdmissionRule,
    queue: int,
    elapsed_s: float,
    t_proc_s: float,
    budget_s: float,
    *,
    count: bool = True,
) -> float | Refused:
    """Admit a request whose service takes ``t_proc_s`` on a worker with ``queue`` requests
    (the first running for ``elapsed_s``) if ``rule`` predicts it finishes within
    ``budget_s``: the predicted completion, seconds from now; else OVERLOADED with the
    predicted excess as the retry hint (a "deadline" rejection when ``count``; a retry's
    refusal is not counted)."""
    verdict = admit(rule.completion_s(queue, t_proc_s, elapsed_s), budget_s)
    if verdict.admitted:
        return verdict.predicted_s
    return Refused(
        Refusal.OVERLOADED,
        f"deadline: predicted {verdict.predicted_s * 1e3:.0f} ms exceeds the "
        f"{verdict.budget_s * 1e3:.0f} ms left",
        verdict.retry_after_s,
        "deadline" if count else "",
    )


class RouterPolicy:
    """Decides for one request at a time on the installed plan. Not thread-safe: the live
    router calls it under its lock."""

    def __init__(
        self,
        profiles: ProfileSet,
        config: RouterServiceConfig,
        rng: random.Random | None = None,
        cache_rules: Mapping[str, KRule] | None = None,
    ) -> None:
        """``cache_rules``: each AC model's similarity → K rule; given, a request at an AC
        level goes to the worker whose cached neighbour serves it soonest whenever the
        snapshot says what the workers hold (:class:`~argus.router.cache_routing.
        CacheRouting`)."""
        self.profiles = profiles
        self.config = config  # reads admission, default_steps, default_size, max_cost, routing
        self.router = PlanRouter(profiles, rng or random.Random(0), config.routing)
        self._runnable = {s: _runnable_levels(profiles, s) for s in Strategy}
        self._controlnet_cap = {s: _controlnet_levels(profiles, s) for s in Strategy}
        self._models = {level.name: level.model for level in profiles.levels}
        self._skips = {level.name: level.skip_steps for level in profiles.levels}
        self.edit_cost = config.edit_cost or default_cost_model()
        self.balancer: EditBalancer | None = None  # None: edits are routed on the plan
        self.cache = None if cache_rules is None else CacheRouting(profiles, cache_rules)
        if config.edit_balancer != EDIT_BALANCER:
            self.balancer = make_balancer(config.edit_balancer, self.edit_cost)
        # the admitted requests held until a worker has room (None: sent at once)
        self.binder: LateBinder | None = None
        window = config.routing.late_binding_window
        if window:
            if self.balancer is not None:
                window = max(window, config.edit_batch)
            self.binder = LateBinder(window, config.admission)

    # the plan ----------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        return self.router.plan

    def install(self, plan: Plan, worker_classes: Mapping[str, str], now_s: float) -> None:
        """Route on ``plan`` from now on; KeyError for a worker class the profile lacks."""
        self.router.install(plan, worker_classes, now_s)

    def level_name(self, index: int) -> str:
        return self.router.level_name(index)

    # the decision ------------------------------------------------------------------------

    def steps_of(self, request: RouterRequest) -> StepCount:
        """``request``'s steps as every decision on it counts them (the one place they are
        worked out; a checked request asks for at least one step or none)."""
        given = request.steps or self.config.default_steps
        counted = given or self.profiles.reference.steps
        run = counted
        if request.image and request.strength is not None:  # img2img
            run = img2img_steps(counted, request.strength)
        return StepCount(given, counted, run)

    def price(self, request: RouterRequest, *, steps: StepCount | None = None) -> float | Refused:
        """The request's cost in reference requests; INVALID above ``max_cost``. ``steps``:
        the request's, resolved (:meth:`steps_of`, which resolves them when not given; so for
        the methods below).

        An edit costs as a generation of its size (the core has set it from the image) and
        steps: inpainting runs every step over the whole latent, so its mask does not make it
        cheaper (the mask-aware activation cache would); img2img runs the last ``strength`` of
        the steps."""
        steps = steps or self.steps_of(request)
        ref = self.profiles.reference
        size = self.config.default_size
        cost = request_cost(request.width or size, request.height or size, steps.given, ref)
        cost *= steps.run / steps.counted  # img2img runs fewer; any other request, all (× 1)
        cap = self.config.max_cost
        if cap is not None and cost > cap:
            return Refused(
                Refusal.INVALID,
                f"width, height, steps: {describe_size(request)} costs {cost:.3g} reference "
                f"requests ({ref.width}×{ref.height}, {ref.steps} steps); this deployment "
                f"accepts at most {cap:.3g}",
            )
        return cost

    def level_cost(
        self, request: RouterRequest, cost: float, level: str, *, steps: StepCount | None = None
    ) -> float:
        """``cost`` (:meth:`price`) as ``level``'s service times count it. A level's times are
        of runs that resume at its K; an edit never resumes from the cache (it starts from
        its own image), so on an AC level skipping K of its N steps it runs N/(N−K) times
        the level's work per unit of cost. A generation, and any request on a level with
        K = 0, costs what it was priced at. The router learns from an edit's reply at the
        same cost, so edits and generations teach a level one rate."""
        skip = self._skips.get(level, 0)
        if not request.image or skip == 0:
            return cost
        n = (steps or self.steps_of(request)).counted
        return cost * n / (n - skip) if n > skip else cost

    def level_cap(
        self, strategy: Strategy, request: RouterRequest, *, steps: StepCount | None = None
    ) -> int | Refused | None:
        """The highest level index ``request`` may be served at: its ``max_level_index``, the
        levels that skip fewer steps than it runs and, when it names a ControlNet, the levels
        before the first whose model runs none (:data:`~argus.contracts.generate.
        CONTROLNET_FAMILIES`: on SM's ladder SD-2.0 comes second, so only SDXL serves it);
        None when any level may serve it."""
        max_level = request.max_level_index
        if _names_controlnet(request):
            controlnet = self._controlnet_cap[strategy]
            if controlnet < 0:
                return Refused(
                    Refusal.UNAVAILABLE,
                    f"adapters: no model of the {strategy.value} levels runs ControlNets",
                    1.0,
                )
            max_level = controlnet if max_level is None else min(max_level, controlnet)
        given = (steps or self.steps_of(request)).given
        if given is None:  # neither the request nor the workers' default is known
            return max_level
        runnable = self._runnable[strategy](given)
        if runnable < 0:
            return Refused(
                Refusal.INVALID, f"steps: {given} leaves no level of {strategy.value} runnable"
            )
        return runnable if max_level is None else min(max_level, runnable)

    def admit_early(
        self,
        request: RouterRequest,
        cost: float,
        snapshot: Snapshot,
        budget_s: float,
        *,
        classifying: int = 0,
        classifier_s: float = 0.0,
        edit: EditJob | None = None,
        steps: StepCount | None = None,
    ) -> Refused | None:
        """Refuse, before the classifier sees the prompt, a request that cannot finish within
        ``budget_s`` on any live worker at the cheapest level it may be served at:
        DEADLINE when not even an idle worker could (naming the fields that make it so),
        OVERLOADED with a retry hint when the queues are the reason. ``classifying``
        requests passed this check ahead of it; the classifier's backlog is
        ``classifier_s``. ``edit``: the request is an inpainting edit, priced by the edit cost
        model when an edit balancer places it (:meth:`balances`)."""
        cap = self._plan_cap(request, steps)
        if isinstance(cap, Refused):
            return cap
        serving = self._serving(cap, snapshot)
        if not serving:
            return Refused(Refusal.UNAVAILABLE, self._cap_note(request) + NO_LIVE_WORKER, 1.0)
        if edit is not None and self.balances(snapshot):
            loaded, idle = self._edit_earliest_s(edit, serving, snapshot, classifying)
        else:
            loads = [self._load(worker, index, snapshot) for worker, index in serving]
            loaded, idle = earliest_completion_s(self.config.admission, loads, classifying)
        if idle > budget_s:
            return Refused(
                Refusal.DEADLINE,
                f"width, height, steps, deadline_ms: {describe_size(request)} ({cost:.3g} "
                f"reference requests) takes {idle * 1e3:.0f} ms on an idle worker, more than "
                f"the {budget_s * 1e3:.0f} ms left",
                reason="deadline",
            )
        verdict = admit(loaded + classifier_s, budget_s)
        if not verdict.admitted:
            return Refused(
                Refusal.OVERLOADED,
                f"deadline: the earliest completion is {verdict.predicted_s * 1e3:.0f} ms "
                f"away (classifier backlog {classifier_s * 1e3:.0f} ms), more than the "
                f"{verdict.budget_s * 1e3:.0f} ms left",
                verdict.retry_after_s,
                "deadline",
            )
        return None

    def route(
        self,
        optimal: int,
        request: RouterRequest,
        snapshot: Snapshot,
        budget_s: float,
        *,
        retry: bool = False,
        edit: EditJob | None = None,
        steps: StepCount | None = None,
    ) -> Admitted | Refused:
        """Route a prompt whose classified level for the plan's strategy is ``optimal``, no
        level above its cap, and admit it on the chosen worker (a ``retry``'s refusal is not
        counted as a rejection). Levels that skip as many steps as the request runs (K ≥ N)
        are never chosen. ``edit``: the request is an inpainting edit, placed by the edit
        balancer among the routed level's workers when one is configured
        (:meth:`place_edit`)."""
        cap = self._plan_cap(request, steps)
        if isinstance(cap, Refused):
            return cap
        decision = self._route_capped(optimal, snapshot, cap)
        if isinstance(decision, Refused):
            return replace(decision, details=self._cap_note(request) + decision.details)
        worker = decision.worker_id
        if worker in snapshot.down:
            return Refused(Refusal.UNAVAILABLE, NO_LIVE_WORKER, 1.0)
        if edit is not None and self.balances(snapshot):
            return self.place_edit(edit, decision, snapshot, budget_s, count=not retry)
        cache = self._cache_choice(decision, request, snapshot)
        served = decision.served_level
        if cache is not None:
            worker, served = cache.worker_id, cache.index
            decision = replace(decision, worker_id=worker, score=cache.score)
        t_proc = snapshot.service_s(worker, served)
        queue, elapsed = snapshot.queues.get(worker, 0), snapshot.elapsed_s(worker)
        predicted = admit_on(
            self.config.admission, queue, elapsed, t_proc, budget_s, count=not retry
        )
        if isinstance(predicted, Refused):
            return self._spill(decision, request, snapshot, budget_s, cap) or predicted
        return Admitted(decision, predicted, cache=cache)

    # the parts ---------------------------------------------------------------------------

    def _cache_choice(
        self, decision: RouteDecision, request: RouterRequest, snapshot: Snapshot
    ) -> CacheChoice | None:
        """The cache-aware choice (:meth:`CacheRouting.choose`) among the live workers
        whose planned AC level runs the model of ``decision``'s level, when the request looks
        the cache up there and the snapshot says what the workers hold; None otherwise (an
        edit never resumes from the cache). Every AC level of a model is the same model with
        another ceiling, so any of its workers serves the request at the routed ceiling: the
        PASM keeps choosing how far it may be approximated, the caches where it is served."""
        index = decision.served_level
        looked = self._looks_up(index, request, snapshot)
        if looked is None:
            return None
        cache, neighbours = looked
        down, model = snapshot.down, cache.model_of(index)
        workers = {
            w for w, i in snapshot.levels.items() if w not in down and cache.model_of(i) == model
        }
        workers.add(decision.worker_id)
        choice = cache.choose(
            index, sorted(workers), snapshot.queues, neighbours, snapshot.service_s
        )
        if choice is None:
            return None
        return replace(choice, moved=choice.worker_id != decision.worker_id)

    def _plan_cap(self, request: RouterRequest, steps: StepCount | None) -> int | Refused | None:
        """The request's level cap on the installed plan's strategy; UNAVAILABLE without a
        plan."""
        plan = self.router.plan
        if plan is None:
            return Refused(Refusal.UNAVAILABLE, NO_PLAN, 1.0)
        return self.level_cap(plan.strategy, request, steps=steps)

    def _cap_note(self, request: RouterRequest) -> str:
        """Why a request finds no worker, when its ControlNet caps it below the strategy's
        fastest level: "adapters: …; " to put before the refusal's details, else ""."""
        plan = self.router.plan
        if plan is None or not _names_controlnet(request):
            return ""
        cap = self._controlnet_cap[plan.strategy]  # >= 0: level_cap refused the request else
        if cap == len(plan.allocation.levels) - 1:  # every level takes a ControlNet
            return ""
        return (
            f"adapters: a ControlNet runs only on {plan.strategy.value} levels up to "
            f"{self.level_name(cap)}, whose models take one; "
        )

    def _serving(self, cap: int | None, snapshot: Snapshot) -> list[tuple[str, int]]:
        """The live workers that may serve a request capped at level ``cap``, each with the
        cheapest level it can serve it at."""
        serving = []
        for worker, index in snapshot.levels.items():
            if worker in snapshot.down:
                continue
            if cap is not None and index > cap:
                if self.model_of(index) != self.model_of(cap):
                    continue
                index = cap  # it runs the capped level on the same model (see _route_capped)
            serving.append((worker, index))
        return serving

    def _spill(
        self,
        decision: RouteDecision,
        request: RouterRequest,
        snapshot: Snapshot,
        budget_s: float,
        cap: int | None,
    ) -> Admitted | None:
        """Admit elsewhere a request that ``decision``'s worker cannot finish within
        ``budget_s``: on the nearest level to the one chosen (that level's other workers
        first, then slower first on equal distance, the scheduler's fallback order) whose
        quickest live worker the admission rule predicts finishes in time. None when no
        worker can, or ``spill_on_refusal`` is off. Why: a refusal should mean the cluster is
        full, not that one sampled level is; a request queued behind a burst at the slow
        level it was sampled for is served a level away instead of being turned back. With
        the caches in view, a worker at a level that looks up is priced at the step its
        neighbour allows."""
        if not self.config.routing.spill_on_refusal:
            return None
        rule, chosen = self.config.admission, decision.worker_id
        # level index → (completion, worker, its cache-aware pricing)
        quickest: dict[int, tuple[float, str, CacheChoice | None]] = {}
        for worker, index in self._serving(cap, snapshot):
            if worker == chosen:
                continue
            cache = self._priced(worker, index, request, snapshot)
            load = self._load(worker, index if cache is None else cache.index, snapshot)
            done = rule.completion_s(load.queue_length, load.t_proc_s, load.head_elapsed_s)
            if not admit(done, budget_s).admitted:
                continue
            if index not in quickest or (done, worker) < quickest[index][:2]:
                quickest[index] = (done, worker, cache)
        plan = self.router.plan
        assert plan is not None  # route() decided on it
        order = nearest_first(decision.served_level, len(plan.allocation.levels))
        served = next((j for j in order if j in quickest), None)
        if served is None:
            return None
        done, worker, cache = quickest[served]
        spilled = replace(decision, served_level=served, worker_id=worker, score=done, spilled=True)
        return Admitted(spilled, done, cache=cache)

    def _priced(
        self, worker: str, index: int, request: RouterRequest, snapshot: Snapshot
    ) -> CacheChoice | None:
        """``worker`` at level ``index`` priced at the step its neighbour allows, when the
        request would look the cache up there and the caches are in view; None otherwise."""
        looked = self._looks_up(index, request, snapshot)
        if looked is None:
            return None
        cache, neighbours = looked
        return cache.choose(index, (worker,), snapshot.queues, neighbours, snapshot.service_s)

    def _looks_up(
        self, index: int, request: RouterRequest, snapshot: Snapshot
    ) -> tuple[CacheRouting, Neighbours] | None:
        """The cache rules and the snapshot's view of the caches when ``request`` served at
        level ``index`` of the installed plan looks the cache up (an AC level with K > 0, not
        an edit) and the snapshot says what the workers hold; else None."""
        plan, cache, neighbours = self.router.plan, self.cache, snapshot.neighbours
        if cache is None or neighbours is None or plan is None or request.image:
            return None
        if not cache.looks_up(plan.strategy, index):
            return None
        return cache, neighbours

    @staticmethod
    def _load(worker: str, index: int, snapshot: Snapshot) -> WorkerLoad:
        """``worker`` as the pre-classification check sees it, serving at level ``index``."""
        t_proc = snapshot.service_s(worker, index)
        return WorkerLoad(snapshot.queues.get(worker, 0), t_proc, snapshot.elapsed_s(worker))

    # inpainting edits placed by the edit balancer -----------------------------------------

    def balances(self, snapshot: Snapshot) -> bool:
        """Whether an inpainting edit is placed by the edit balancer on ``snapshot``: one is
        configured and the snapshot keeps the workers' edits."""
        return self.balancer is not None and snapshot.edits is not None

    def edit_view(
        self, edit: EditJob, worker: str, index: int, snapshot: Snapshot
    ) -> WorkerSnapshot:
        """``worker`` serving at level ``index`` as the edit balancer sees it: its requests in
        flight and templates held (:func:`~argus.router.edit_loads.worker_snapshot`), its
        steps at the cost model's times scaled so that ``edit`` in full, alone, takes its
        service time there (:func:`~argus.router.edit_loads.time_scale`)."""
        edits = snapshot.edits(worker) if snapshot.edits is not None else NO_EDITS
        scale = time_scale(self.edit_cost, snapshot.service_s(worker, index), edit.steps)
        return worker_snapshot(edits, self.config.edit_batch, self.edit_cost, scale)

    def edit_finish_s(self, edit: EditJob, view: WorkerSnapshot, *, idle: bool = False) -> float:
        """Seconds until ``edit`` placed now on ``view``'s worker finishes there
        (:func:`~argus.router.edit_balance.predict_finish_s`); ``idle``: were the worker
        idle (its templates kept)."""
        if idle:
            view = WorkerSnapshot(templates=view.templates, bound=view.bound, scale=view.scale)
        return predict_finish_s(edit, view, self.edit_cost)

    def place_edit(
        self,
        edit: EditJob,
        decision: RouteDecision,
        snapshot: Snapshot,
        budget_s: float,
        *,
        count: bool = True,
    ) -> Admitted | Refused:
        """Place an inpainting edit the plan routed to ``decision``: its level stays, the
        balancer chooses among the live workers of the chosen worker's planned level, and the
        edit is admitted when its predicted finish there fits ``budget_s``. Else DEADLINE
        when it would not fit even were those workers idle, OVERLOADED with the predicted
        excess as the retry hint otherwise (counted as "deadline" rejections when
        ``count``)."""
        assert self.balancer is not None
        planned = snapshot.levels.get(decision.worker_id)
        workers = [
            w for w, index in snapshot.levels.items() if index == planned and w not in snapshot.down
        ] or [decision.worker_id]
        index = decision.served_level
        views = [self.edit_view(edit, w, index, snapshot) for w in workers]
        chosen = self.balancer.choose(edit, views)
        predicted = self.edit_finish_s(edit, views[chosen])
        idle = min(self.edit_finish_s(edit, view, idle=True) for view in views)
        reason = "deadline" if count else ""
        if idle > budget_s:
            return Refused(
                Refusal.DEADLINE,
                f"deadline_ms: the edit takes {idle * 1e3:.0f} ms on an idle worker of its "
                f"level, more than the {budget_s * 1e3:.0f} ms left",
                reason=reason,
            )
        verdict = admit(predicted, budget_s)
        if not verdict.admitted:
            return Refused(
                Refusal.OVERLOADED,
                f"deadline: the edit's predicted finish on {workers[chosen]} is "
                f"{verdict.predicted_s * 1e3:.0f} ms away, more than the "
                f"{verdict.budget_s * 1e3:.0f} ms left",
                verdict.retry_after_s,
                reason,
            )
        held = edit.template is not None and edit.template in views[chosen].templates
        placed = replace(decision, worker_id=workers[chosen], score=predicted)
        return Admitted(placed, predicted, self.balancer.name, held)

    def _edit_earliest_s(
        self,
        edit: EditJob,
        serving: list[tuple[str, int]],
        snapshot: Snapshot,
        classifying: int,
    ) -> tuple[float, float]:
        """``(loaded, idle)`` for an edit as :func:`earliest_completion_s` gives them for a
        request: the least predicted finish over ``serving`` with their edits in flight, and
        were they idle, the requests being classified ahead of it spread over them."""
        views = [self.edit_view(edit, worker, index, snapshot) for worker, index in serving]
        loaded = min(self.edit_finish_s(edit, view) for view in views)
        idle = min(self.edit_finish_s(edit, view, idle=True) for view in views)
        return loaded + classifying * idle / len(views), idle

    def _route_capped(
        self, optimal: int, snapshot: Snapshot, cap: int | None
    ) -> RouteDecision | Refused:
        """Route with no level above ``cap``. When no live worker serves such a level, a worker
        whose model also runs the capped level serves it there (AC levels share one model:
        an ac-k25 worker runs ac-k0 for a request of 4 steps); otherwise UNAVAILABLE."""
        queues, down, t_proc = snapshot.queues, snapshot.down, snapshot.service_s
        try:
            return self.router.route(optimal, queues, down, cap, t_proc)
        except NoLiveWorkerError as err:
            if cap is None:
                return Refused(Refusal.UNAVAILABLE, str(err), 1.0)
            try:
                decision = self.router.route(optimal, queues, down, t_proc=t_proc)
            except NoLiveWorkerError:
                return Refused(Refusal.UNAVAILABLE, str(err), 1.0)
        if decision.served_level <= cap:
            return decision
        if self.model_of(decision.served_level) == self.model_of(cap):
            return replace(decision, served_level=cap, fallback=True)
        return Refused(
            Refusal.UNAVAILABLE, f"no live worker can serve level index {cap} or slower now", 1.0
        )

    def serving_level(self, planned: str, answered: str | None) -> str:
        """The level a worker the plan put at ``planned`` serves a request at, as far as the
        router knows: ``answered``, the level of its last reply, while that level runs another
        model than ``planned`` (the worker keeps serving it until the planned model has loaded
        in the background, Argus §4.6), else ``planned``. Priced at the planned level, such a
        worker is sent requests at a speed it does not have yet, which queue behind its old
        model and finish late."""
        if answered is None or answered not in self._models:
            return planned
        return planned if self._models[answered] == self._models.get(planned) else answered

    def model_of(self, index: int) -> str:
        """The model that level ``index`` of the installed plan's strategy runs."""
        return self._models[self.router.level_name(index)]


def describe_size(request: RouterRequest) -> str:
    """The request's size for messages, "W×H, N steps" ("default" for a field it left to the
    worker)."""

    def shown(value: int | None) -> str:
        return "default" if value is None else str(value)

    return f"{shown(request.width)}×{shown(request.height)}, {shown(request.steps)} steps"


def _runnable_levels(profiles: ProfileSet, strategy: Strategy) -> Callable[[int], int]:
    """For N steps, the highest index of ``strategy``'s levels that skips fewer than N (K < N);
    -1 when none does. Levels are slowest first, so K grows with the index."""
    skips = [level.skip_steps for level in profiles.levels_for(strategy)]

    def highest(steps: int) -> int:
        return max((i for i, k in enumerate(skips) if k < steps), default=-1)

    return highest


def _controlnet_levels(profiles: ProfileSet, strategy: Strategy) -> int:
    """The highest index of ``strategy``'s levels before the first whose model runs no
    ControlNet (slowest first); -1 when the first runs none."""
    runs = [runs_controlnets(level.model) for level in profiles.levels_for(strategy)]
    return runs.index(False) - 1 if False in runs else len(runs) - 1


def _names_controlnet(request: RouterRequest) -> bool:
    return any(a.kind is AdapterKind.CONTROLNET for a in request.adapters)
