"""The router's request path on typed values: :class:`RouterCore`.

:class:`RouterCore` serves one :class:`~argus.contracts.router_api.RouterRequest`, top to bottom:

1. check the request (:func:`check_request`, INVALID naming the field; an edit's image and
   mask are decoded and its size set from the image), resolve its steps once
   (:meth:`RouterPolicy.steps_of`) and price it (pixels × steps over the profile's reference
   request, img2img × its strength; above ``max_cost``, INVALID naming width, height and
   steps). From here on the request travels as one :class:`InFlight` value;
2. claim its request id (a retry joins or returns the first call);
3. take an in-flight slot (OVERLOADED when the router holds its maximum);
4. admit early, before the classifier (:meth:`RouterPolicy.admit_early`): a request that
   cannot finish in time even on an idle worker is DEADLINE naming its fields, one that
   cannot finish in time now is OVERLOADED with a retry-after hint, and neither takes
   classifier time. Refused or not, it is an arrival for the allocator's report, at its
   weight in full requests (:meth:`RouterCore._arrival_cost`);
5. classify the prompt (AC and SM levels; both are reported to the allocator); with
   cache-aware routing, embed it and look it up in the mirror of the workers' caches
   (:class:`~argus.router.cache_mirror.CacheMirror`) when that can matter, before the lock;
6. route on the installed plan (PASM sample, Eq. 3 worker selection; at an AC level, on the
   step each worker's cached neighbour allows) and admit against the deadline on the chosen
   worker (:meth:`RouterPolicy.route`); an inpainting edit may be placed by the edit balancer
   (:meth:`RouterPolicy.place_edit`);
7. forward to the worker through the :class:`WorkerTransport` with the remaining time as the
   call's timeout (and the mirror's cursor in its cache log, whose changes the reply brings);
   a worker that is UNAVAILABLE mid-request is marked down and the request is routed again to
   another worker while the deadline allows.

Every decision sees the cluster as the core believes it: each worker's address, level,
queue, down mark and last answered level, one record per worker
(:class:`~argus.router.worker_beliefs.WorkerBeliefs`), with the service times learned from the
workers' replies (:class:`~argus.router.service_times.ServiceTimes`), all under one lock.
``docs/router-internals.md`` tells the path at length.

Refusals are :class:`~argus.router.values.RouterError` with a
:class:`~argus.router.values.Refusal`, answered in each protocol's words by the gRPC servicer
and the HTTP app. The core imports neither grpc nor protobuf. Plans come from ``install``
(wired to ``PlanWatcher``'s ``on_plan``). The clock is passed in.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from argus import defaults
from argus.classifier.prompts import InvalidPromptError
from argus.classifier.serving import BatcherClosed, BatcherFull
from argus.contracts.cache_outlook import CacheOutlook
from argus.contracts.generate import AdapterKind, Progress, Stage
from argus.contracts.generate import GenerateCall as WorkerCall
from argus.contracts.generate import GenerateResult as WorkerReply
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterReply, RouterRequest, RouterTiming
from argus.profiles.cache_evidence import KRule
from argus.request_limits import (
    MAX_LEVEL_INDEX,
    MAX_PREVIEWS,
    EditInput,
    ImageLimits,
    InvalidRequestError,
    check_adapters,
    check_edit,
    check_edit_size,
    check_image,
    check_prompts,
    check_range,
    check_sampling,
)
from argus.router.cache_mirror import CacheMirror, Embedder, Lookup
from argus.router.config import RouterServiceConfig
from argus.router.drift import RouterDrift
from argus.router.edit_balance import EditJob
from argus.router.edit_loads import EditLoads, WorkerEdits, arrival_cost, template_key
from argus.router.late_binding import Held
from argus.router.ledger import (
    AnswerDroppedError,
    IdConflictError,
    LedgerFullError,
    RequestLedger,
)
from argus.router.policy import (
    NO_PLAN,
    Admitted,
    Refused,
    RouterPolicy,
    Snapshot,
    StepCount,
)
from argus.router.service_times import ServiceTimes
from argus.router.stats import NO_STATS, RouterStats, Served
from argus.router.values import Refusal, RouterError
from argus.router.worker_beliefs import WorkerBeliefs
from argus.types import MeasuredLatency, ProfileSet, RouteDecision, Strategy

if TYPE_CHECKING:  # its module reads plans from protobuf; the core only follows them
    from argus.contracts.plans import PublishedPlan

log = logging.getLogger(__name__)

MAX_ID_CHARS = defaults.MAX_REQUEST_ID_CHARS  # a client's request id
# a refusal that blames the request, not the cluster: no SLO violation
CALLER_ERRORS = frozenset(
    {Refusal.INVALID, Refusal.NOT_FOUND, Refusal.ANSWER_DROPPED, Refusal.CANCELLED}
)
DEFAULT_LIMITS = ImageLimits()


BUSY_RETRY_AFTER_S = 0.1  # the retry hint of a refusal for too many requests in flight


def busy_refusal(in_flight: int) -> RouterError:
    """The refusal of a request beyond ``in_flight`` requests held at once (the core's bound,
    and the gRPC server's in front of it, refuse in the same words)."""
    return RouterError(
        Refusal.OVERLOADED, f"router busy: {in_flight} requests in flight", BUSY_RETRY_AFTER_S
    )


class CallCancel:
    """Set when one call's client goes away (a gRPC cancel, an HTTP disconnect); cancels the
    worker call in flight then, or at once when it starts later. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._target: Callable[[], object] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            target, self._target = self._target, None
        if target is not None:
            target()

    def attach(self, target: Callable[[], object] | None) -> None:
        """Cancel ``target`` (a worker call's ``cancel``) when this call is cancelled; None
        detaches. A call already cancelled cancels the target at once."""
        with self._lock:
            if not self._cancelled:
                self._target = target
                return
        if target is not None:
            target()

    def check(self) -> None:
        if self._cancelled:
            raise RouterError(Refusal.CANCELLED, "the client cancelled the request")


class WorkerError(Exception):
    """A worker call that failed: ``kind`` as the worker's status says, ``details`` its text
    (the core names the worker in front of it)."""

    def __init__(self, kind: Refusal, details: str) -> None:
        super().__init__(details)
        self.kind = kind
        self.details = details


class WorkerTransport(Protocol):
    """How the core calls workers (:class:`~argus.router.worker_calls.GrpcWorkers` over gRPC;
    tests may pass fakes)."""

    def generate(
        self,
        address: str,
        call: WorkerCall,
        *,
        timeout_s: float,
        cancel: CallCancel,
        progress: ProgressSink | None,
    ) -> WorkerReply:
        """The worker's reply, within ``timeout_s``; raises :class:`WorkerError`. With
        ``progress``, the worker's events are passed to it as they come. The call is attached
        to ``cancel`` while it runs (and detached before returning)."""
        ...

    def keep_only(self, addresses: set[str]) -> None:
        """The plan now names only these workers (connections to others may be released)."""
        ...

    def close(self) -> None: ...


class PromptLevels(Protocol):
    """The classifier as the router uses it (``PromptClassifier`` implements it)."""

    def classify(
        self, prompt: str | bytes, timeout: float | None = None
    ) -> dict[Strategy, int]: ...


@dataclass(frozen=True)
class Classified:
    """A prompt's levels per strategy, for the allocator's affinity histogram H."""

    at_s: float
    levels: Mapping[Strategy, int]


@dataclass(frozen=True)
class RouterStatistics:
    """What the router saw since its last report, for the allocator
    (:meth:`RouterCore.take_report`)."""

    arrivals: tuple[float, ...]  # clock times of the requests that arrived, refused or not
    # each arrival's weight in the allocator's demand, in full requests (:meth:`RouterCore.
    # _arrival_cost`), in the order of ``arrivals``; empty: every one weighs 1
    arrival_costs: tuple[float, ...]
    classified: tuple[Classified, ...]
    replan_wanted: bool  # queues build up: re-plan early
    # what the workers' caches would have found for the prompts probed (CacheMirror); empty
    # without a mirror
    cache: CacheOutlook = field(default_factory=CacheOutlook)


# -- checks --------------------------------------------------------------------------------


def check_request(
    request: RouterRequest, limits: ImageLimits = DEFAULT_LIMITS
) -> tuple[RouterRequest, EditInput | None]:
    """Raise RouterError(INVALID) naming the first bad field; otherwise return the request as
    served and its checked edit (None for a generation). An edit's width and height are its
    image's (so that it is priced and admitted at its size); every other request is returned
    as it is. The edit's mask ratio and template digest place an inpainting edit.

    Prompts, image size, sampling and an edit's image and mask are checked by the rules the
    workers apply (:mod:`argus.request_limits`); a worker's defaults fill absent (None)
    fields.
    """
    try:
        if len(request.request_id) > MAX_ID_CHARS:
            raise InvalidRequestError(
                "request_id", f"at most {MAX_ID_CHARS} characters, got {len(request.request_id)}"
            )
        check_prompts(request.prompt, request.negative_prompt)
        check_image(request.width, request.height, limits)
        check_sampling(request.steps, request.guidance_scale, request.seed)
        check_adapters(request.adapters)  # before any walk of a list that may be huge
        if request.deadline_ms is not None and request.deadline_ms <= 0:
            raise InvalidRequestError("deadline_ms", "must be > 0")
        # the HTTP API's bounds too (its partial_images is previews)
        check_range("max_level_index", request.max_level_index, 0, MAX_LEVEL_INDEX)
        check_range("previews", request.previews, 0, MAX_PREVIEWS)
        for i, adapter in enumerate(request.adapters):
            if adapter.kind is None:  # unset, or a value this router's enum does not have
                known = ", ".join(kind.name for kind in AdapterKind)
                raise InvalidRequestError(
                    f"adapters[{i}]", f"unknown or unset kind; known kinds: {known}"
                )
            if not adapter.name:
                raise InvalidRequestError(f"adapters[{i}]", "needs a name")
        edit = check_edit(request.image, request.mask, request.strength, limits)
        if edit is None:
            return request, None
        check_edit_size(edit, request.width, request.height)
        return replace(request, width=edit.width, height=edit.height), edit
    except InvalidRequestError as err:
        raise RouterError(Refusal.INVALID, str(err)) from None


def fingerprint(request: RouterRequest) -> bytes:
    """What must match for a retried request id to be the same request: a digest of every
    field but ``deadline_ms`` (a retry may carry a shorter deadline). A digest, because the
    ledger keeps one per id for minutes and a request may carry an image."""
    digest = hashlib.blake2b(digest_size=16)
    for part in _identity(request):
        data = part if isinstance(part, bytes) else repr(part).encode()
        digest.update(len(data).to_bytes(8, "big"))  # lengths keep the parts apart
        digest.update(data)
    return digest.digest()


def _identity(request: RouterRequest) -> Iterator[object]:
    r = request
    yield from (r.request_id, r.prompt, r.negative_prompt, r.seed, r.width, r.height, r.steps)
    yield from (r.guidance_scale, r.max_level_index, r.previews, r.image, r.mask, r.strength)
    yield len(r.adapters)
    for adapter in r.adapters:
        kind = None if adapter.kind is None else adapter.kind.value
        yield from (kind, adapter.name, adapter.scale, adapter.control_image)


def worker_call(request: RouterRequest, level: str, *, previews: bool) -> WorkerCall:
    """The worker's call for ``request`` served at ``level``; ``previews``: the call streams
    (previews are only sent on a stream)."""
    return WorkerCall(
        prompt=request.prompt,
        level=level,
        negative_prompt=request.negative_prompt,
        seed=request.seed,
        width=request.width,
        height=request.height,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        adapters=request.adapters,
        request_id=request.request_id,
        previews=request.previews if previews else 0,
        image=request.image,
        mask=request.mask,
        strength=request.strength,
    )


# -- the core ------------------------------------------------------------------------------


class RouterCore:
    """Serves requests on the latest installed plan, calling workers through ``workers``;
    thread-safe."""

    def __init__(
        self,
        profiles: ProfileSet,
        classifier: PromptLevels,
        config: RouterServiceConfig,
        *,
        workers: WorkerTransport,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        stats: RouterStats = NO_STATS,
        drift: RouterDrift | None = None,
        embedder: Embedder | None = None,
        cache_rules: Mapping[str, KRule] | None = None,
    ) -> None:
        """``embedder``: the workers' prompt encoder; with it and ``routing.cache_aware`` the
        core mirrors the workers' caches and routes AC requests by them, each AC model's
        similarity → K rule from ``cache_rules`` (a model not named: the default rule)."""
        self.profiles = profiles
        self.classifier = classifier
        self.drift = drift  # takes the quality scores workers send on their replies
        self.config = config
        self.slo_s = config.slo_for(profiles)
        self.stats = stats  # hears every request, refusal and plan
        self._clock = clock
        # the workers' caches as their replies tell them; None: routing ignores the caches
        self.cache: CacheMirror | None = None
        if config.routing.cache_aware and embedder is not None:
            self.cache = CacheMirror(
                profiles,
                embedder,
                cache_rules,
                scheduler=config.scheduler,
                default_size=config.default_size,
                probe_interval_s=config.routing.cache_probe_interval_s,
                clock=clock,
                on_skipped=stats.cache_event_skipped,
                on_forgotten=stats.cache_forgotten,
            )
            view = self.cache.view
            stats.watch_cache_entries(lambda: view.stats().entries)
        rules = None if self.cache is None else (cache_rules or {})
        self.policy = RouterPolicy(profiles, config, rng, cache_rules=rules)
        self._router = self.policy.router  # the plan and the backlog signal
        self._workers = workers
        self._lock = threading.Lock()  # router, beliefs, observations
        self._beliefs = WorkerBeliefs()  # each worker's address, level, queue, down mark, ...
        self._times = ServiceTimes(profiles, config.service_times)
        self._plan_version = 0
        self._in_flight = threading.BoundedSemaphore(config.max_in_flight)
        self._ledger: RequestLedger[RouterReply] = RequestLedger(
            clock,
            window_s=config.id_window_s,
            max_entries=config.max_ids,
            max_bytes=config.max_id_bytes,
            size_of=RouterReply.size_bytes,
            on_evict=stats.id_evicted,
        )
        self._arrivals: list[float] = []
        self._arrival_costs: list[float] = []  # one per arrival (see _arrival_cost)
        self._classified: list[Classified] = []
        self._serving = 0
        self._classifying = 0  # requests admitted early and not yet routed
        # each worker's requests in flight and templates held: kept only for an edit balancer
        # (with "plan" nothing reads it, and an edit is placed and counted as a request)
        self._edits = (
            None
            if self.policy.balancer is None
            else EditLoads(config.edit_batch, config.edit_templates)
        )
        self._sends = itertools.count()  # tokens of the requests in flight
        if self.policy.balancer is not None:
            model = self.policy.edit_cost
            log.info(
                "edits placed by %s, batches of %d, on t(b, Σm) = %.4g + %.4g·b + %.4g·Σm "
                "(R² %.4f; %s), scaled per worker to its learned service time",
                self.policy.balancer.name,
                config.edit_batch,
                model.base_s,
                model.per_edit_s,
                model.per_mask_s,
                model.r2,
                model.source or "source not given",
            )
        self.worker_calls = 0  # Generate calls sent to workers (tests, metrics)
        stats.watch_in_flight(lambda: self._serving)

    def close(self) -> None:
        """Release the worker connections (after the server stopped)."""
        self._workers.close()

    def can_serve(self) -> bool:
        """A plan is installed and names at least one worker (workers join the allocator only
        once ready, so this is "some worker can take a request"); health reports this."""
        with self._lock:
            return self._router.plan is not None and self._beliefs.has_workers()

    def now(self) -> float:
        """The core's clock (the servicer turns gRPC deadlines into clock times with it)."""
        return self._clock()

    # plans -------------------------------------------------------------------------------

    def install(self, published: PublishedPlan) -> bool:
        """Follow ``published`` from now on (``PlanWatcher``'s ``on_plan``). A plan this router
        cannot route on (a worker class missing from its profile) is refused and logged: the
        previous plan stays; returns whether it was installed."""
        with self._lock:
            models = self._worker_models()
            try:
                self._router.install(published.plan, published.worker_classes(), self._clock())
            except KeyError as err:
                log.error("plan %d refused: %s", published.version, err)
                return False
            addresses = {w.worker_id: w.address for w in published.workers}
            beliefs = self._beliefs
            beliefs.install(
                addresses, published.plan.allocation.level_indices(), published.worker_classes()
            )
            self._times.forget(set(addresses))
            if self._edits is not None:
                self._edits.keep(addresses)
                for worker, model in self._worker_models().items():
                    if models.get(worker, model) != model:  # its records were of another model
                        self._edits.forget_templates(worker)
            self._plan_version = published.version
            now = self._clock()
            self._drop_held(set(beliefs.levels) - beliefs.down(now), now)
            queues = beliefs.queues()
        if self.cache is not None:  # off the lock: forgetting a large worker takes a while
            self.cache.keep_only(addresses)
        self._workers.keep_only(beliefs.addresses())
        self.stats.plan_installed(published.version, published.plan.strategy, queues)
        return True

    def _worker_models(self) -> dict[str, str]:
        """The model each planned worker runs on the installed plan. Under the lock."""
        if self._router.plan is None:
            return {}
        return {w: self.policy.model_of(i) for w, i in self._beliefs.levels.items()}

    # statistics for the allocator ---------------------------------------------------------

    def take_report(self) -> RouterStatistics:
        """Arrivals, their weights and classifications since the last call, and whether to
        re-plan early. The weights are empty when
        every arrival weighs 1 (always so with ``edit_balancer`` "plan"), so such a report is
        the one routers sent before arrivals had weights."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            costs, self._arrival_costs = self._arrival_costs, []
            classified, self._classified = self._classified, []
            now = self._clock()
            beliefs = self._beliefs
            wants = self._router.plan is not None and self._router.wants_replan(
                now, beliefs.queues(), beliefs.down(now)
            )
        if all(cost == 1.0 for cost in costs):
            costs = []
        cache = CacheOutlook() if self.cache is None else self.cache.take_outlook()
        return RouterStatistics(tuple(arrivals), tuple(costs), tuple(classified), wants, cache)

    def measured_latencies(self) -> tuple[MeasuredLatency, ...]:
        """Each level's mean service time per request on each worker class, as the workers'
        replies showed it (for the allocator's report)."""
        with self._lock:
            return self._times.measured(self._clock())

    # requests ----------------------------------------------------------------------------

    def generate(
        self,
        request: RouterRequest,
        deadline_s: float | None = None,
        *,
        progress: ProgressSink | None = None,
        cancel: CallCancel | None = None,
    ) -> RouterReply:
        """Serve one request; RouterError says why it was not served.

        ``deadline_s`` is the caller's own deadline as a clock time, when it has one (a gRPC
        deadline); ``progress`` receives the ROUTED event and then the worker's events;
        ``cancel`` is set when the caller goes away.
        """
        arrived = self._clock()
        try:
            return self._generate(request, arrived, deadline_s, progress, cancel or CallCancel())
        except RouterError as err:
            overloaded = err.kind is Refusal.OVERLOADED
            self.stats.failed(err.kind, self._clock() - arrived if overloaded else None)
            raise

    def _generate(
        self,
        request: RouterRequest,
        arrived: float,
        deadline_s: float | None,
        progress: ProgressSink | None,
        cancel: CallCancel,
    ) -> RouterReply:
        request, edit = check_request(request, self.config.limits)
        steps = self.policy.steps_of(request)
        cost = self._price(request, steps)
        work = self._work(request, edit, steps)
        deadline = arrived + (request.deadline_ms or self.config.default_deadline_ms) / 1e3
        if deadline_s is not None:
            deadline = min(deadline, deadline_s)
        flight = InFlight(request, steps, cost, work, arrived, deadline, progress, cancel)
        if not request.request_id:
            return self._serve(flight)
        try:
            future, owner = self._ledger.claim(request.request_id, fingerprint(request))
        except IdConflictError as err:
            raise RouterError(Refusal.ID_CONFLICT, str(err)) from None
        except AnswerDroppedError as err:
            raise RouterError(Refusal.ANSWER_DROPPED, str(err)) from None
        except LedgerFullError as err:
            self.stats.rejected("ids")
            raise RouterError(Refusal.OVERLOADED, str(err), 1.0) from None
        if not owner:
            return self._join(future, deadline)
        try:
            response = self._serve(flight)
        except BaseException as err:
            self._ledger.fail(request.request_id, err)
            raise
        self._ledger.finish(request.request_id, response)
        return response

    def _join(self, future: Future[RouterReply], deadline: float) -> RouterReply:
        try:
            return future.result(timeout=max(0.0, deadline - self._clock()))
        except TimeoutError:
            raise RouterError(
                Refusal.DEADLINE, "the first call with this id is still running"
            ) from None

    def _work(self, request: RouterRequest, edit: EditInput | None, steps: StepCount) -> _Work:
        """What ``request`` puts on a worker, as the edit balancer counts it: an inpainting
        edit at its mask ratio with its template's key (none with adapters: the worker's cache
        serves no edit with adapters; none without a balancer, which spares the digest of the
        template's pixels), anything else at ratio 1 with none; its steps are those it runs
        (img2img: the last ``strength`` of them)."""
        if edit is None or edit.region is None:
            return _Work(EditJob(1.0, steps.run), inpainting=False)
        template = None
        if self._edits is not None and not request.adapters:
            template = template_key(
                edit.template_digest,
                edit.width,
                edit.height,
                steps.given,
                request.guidance_scale,
            )
        return _Work(EditJob(edit.mask_ratio, steps.run, template), inpainting=True)

    def _price(self, request: RouterRequest, steps: StepCount) -> float:
        """The request's cost in reference requests; INVALID above ``max_cost``."""
        cost = self.policy.price(request, steps=steps)
        if isinstance(cost, Refused):
            raise cost.error()
        return cost

    def _serve(self, flight: InFlight) -> RouterReply:
        if not self._in_flight.acquire(blocking=False):
            self.stats.rejected("busy")
            raise busy_refusal(self.config.max_in_flight)
        with self._lock:
            self._serving += 1
        try:
            return self._classify_route_forward(flight)
        finally:
            with self._lock:
                self._serving -= 1
            self._in_flight.release()

    def _classify(self, prompt: str, deadline: float) -> Mapping[Strategy, int]:
        """The prompt's levels; classifier failures become refusals."""
        try:
            return self.classifier.classify(prompt, timeout=max(0.001, deadline - self._clock()))
        except InvalidPromptError as err:
            raise RouterError(Refusal.INVALID, f"prompt: {err}") from None
        except TimeoutError:
            raise RouterError(Refusal.DEADLINE, "deadline passed while classifying") from None
        except BatcherFull as err:
            self.stats.rejected("busy")
            raise RouterError(Refusal.OVERLOADED, str(err), 0.1) from None
        except BatcherClosed:
            raise RouterError(Refusal.UNAVAILABLE, "router shutting down", 1.0) from None

    def _admit_early(self, flight: InFlight) -> None:
        """Refuse, before the classifier sees the prompt, a request that cannot finish by
        its deadline (:meth:`RouterPolicy.admit_early`); otherwise count it among the requests
        being classified (the caller uncounts it)."""
        backlog = getattr(self.classifier, "backlog_s", None)
        classifier_s = backlog() if backlog is not None else 0.0
        with self._lock:
            now = self._clock()
            # refused or not, it is load the allocator plans for, at its weight
            self._arrivals.append(flight.arrived)
            self._arrival_costs.append(self._arrival_cost(flight.work, now))
            refused = self.policy.admit_early(
                flight.request,
                flight.cost,
                self._snapshot(flight, now),
                flight.deadline - now,
                classifying=self._classifying,
                classifier_s=classifier_s,
                edit=flight.work.edit,
                steps=flight.steps,
            )
            if refused is not None:
                raise self._refusal(refused)
            self._classifying += 1

    def _arrival_cost(self, work: _Work, now: float) -> float:
        """The request's weight in the allocator's demand, in full requests. 1 for a
        generation or img2img, and for every request with ``edit_balancer`` "plan" (today's
        count); an inpainting edit placed by an edit balancer weighs its share of a batched
        step (:func:`~argus.router.edit_loads.arrival_cost`: the edit cost model, InstGenIE
        §4.4, at the workers' ``edit_batch``), at its mask ratio when a live worker of the plan
        is believed to hold its template, else in full. That is the best case at arrival,
        before its level and worker are known: a template-aware balancer places it on a holder
        when that one serves its level. It is fixed at arrival, so a refused edit counts at
        what it would have cost served: it is load the allocator plans for. Under the lock."""
        edit, account = work.edit, self._edits
        if edit is None or account is None:
            return 1.0
        live = set(self._beliefs.levels) - self._beliefs.down(now)
        hit = account.held_by_any(edit.template, live)
        ratio = edit.mask_ratio if hit else 1.0
        return arrival_cost(self.policy.edit_cost, self.config.edit_batch, ratio)

    def _snapshot(
        self,
        flight: InFlight,
        now: float,
        tried: AbstractSet[str] = frozenset(),
        lookup: Lookup | None = None,
    ) -> Snapshot:
        """The planned workers as a decision for ``flight`` sees them now (its cost at each
        level by :meth:`RouterPolicy.level_cost`), the workers in ``tried`` counted down, and
        what their caches hold for its prompt (``lookup``; None: not looked at). Under the
        lock."""
        beliefs = self._beliefs

        def elapsed_s(worker: str) -> float:
            return beliefs.elapsed_s(worker, now)

        def service_s(worker: str, index: int) -> float:
            return self._request_s(flight, worker, index, now)

        account = self._edits
        edits = None  # plan: edits as requests
        if account is not None:

            def edits(worker: str) -> WorkerEdits:
                return account.view(worker, now)

        down = beliefs.down(now) | tried
        neighbours = None if lookup is None else lookup.neighbours
        return Snapshot(
            beliefs.levels, beliefs.queue_view(now), down, elapsed_s, service_s, edits, neighbours
        )

    def _level_cost(self, flight: InFlight, level: str) -> float:
        """``flight``'s cost as ``level``'s service times count it."""
        return self.policy.level_cost(flight.request, flight.cost, level, steps=flight.steps)

    def _service_s(
        self, worker: str, level: str, cost: float, now: float, *, headroom: bool = True
    ) -> float:
        """A request of ``cost`` on ``worker`` at ``level``: the service time learned from the
        worker's replies (its seed until it has answered), with admission's headroom unless
        ``headroom`` is False. Under the lock."""
        gpu_class = self._beliefs.gpu_class(worker)
        return self._times.predict_s(worker, gpu_class, level, cost, now, headroom=headroom)

    def _request_s(
        self, flight: InFlight, worker: str, index: int, now: float, *, headroom: bool = True
    ) -> float:
        """``flight``'s service time on ``worker`` at level ``index`` (at the level its last
        reply came from while its planned model loads), as :meth:`_service_s`."""
        level = self._router.level_name(index)
        level = self.policy.serving_level(level, self._beliefs.answered_level(worker))
        cost = self._level_cost(flight, level)
        return self._service_s(worker, level, cost, now, headroom=headroom)

    def _classify_route_forward(self, flight: InFlight) -> RouterReply:
        self._admit_early(flight)
        try:
            levels = self._classify(flight.request.prompt, flight.deadline)
        finally:
            with self._lock:
                self._classifying -= 1
        arrived = flight.arrived
        classified_at = self._clock()
        self.stats.classified(classified_at - arrived)
        with self._lock:
            self._classified.append(Classified(classified_at, dict(levels)))
        lookup = self._look_up(flight)
        tried: set[str] = set()
        admitted = False
        try:
            for attempt in range(1, self.config.max_attempts + 1):
                decision, strategy, held, token = self._route(flight, levels, tried, lookup)
                admitted = True
                try:
                    decision, address = self._bind(flight, decision, held)
                except RouterError as err:
                    if err.kind is not Refusal.UNAVAILABLE or attempt == self.config.max_attempts:
                        raise
                    tried.add(decision.worker_id)  # it left the plan or went down meanwhile
                    self.stats.retried()
                    continue
                routed_at = self._clock()
                flight.routed(decision, self._router.level_name, routed_at - arrived)
                try:
                    reply = self._forward(flight, decision, address, token, lookup)
                except RouterError as err:
                    if err.kind is not Refusal.UNAVAILABLE:
                        raise
                    if attempt == self.config.max_attempts:
                        raise
                    tried.add(decision.worker_id)
                    self.stats.retried()
                    continue
                done = self._clock()
                return self._response(
                    flight, reply, decision, strategy, attempt,
                    (arrived, classified_at, routed_at, done),
                )  # fmt: skip
        except RouterError as err:
            if admitted and err.kind not in CALLER_ERRORS:
                self.stats.admitted_unserved()
            raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _look_up(self, flight: InFlight) -> Lookup | None:
        """``flight``'s nearest cached neighbour on each worker (:meth:`CacheMirror.look`),
        before the lock is taken, when that can matter (:meth:`CacheMirror.wanted`); None
        otherwise."""
        cache = self.cache
        plan = self._router.plan  # read without the lock: a plan installed meanwhile only
        # changes whether this prompt is worth embedding
        strategy = None if plan is None else plan.strategy
        if cache is None or not cache.wanted(flight.request, strategy):
            return None
        lookup = cache.look(flight.request, flight.steps.given)
        if lookup is not None:
            self.stats.cache_embedded(lookup.embed_s)
        return lookup

    def _route(
        self,
        flight: InFlight,
        levels: Mapping[Strategy, int],
        tried: set[str],
        lookup: Lookup | None = None,
    ) -> tuple[RouteDecision, Strategy, Held | None, int]:
        """Route and admit under the lock (:meth:`RouterPolicy.route`), with the workers'
        cached neighbours of ``lookup`` when the plan is AC; the chosen worker's queue and
        its requests in flight count this request, under the returned token. With late
        binding the request is sent at once only when that worker has room; else it is held
        (the returned :class:`Held`, None when sent at once). A first attempt counts
        ``lookup``'s probes over the live workers, admitted or not."""
        with self._lock:
            plan = self._router.plan
            if plan is None:
                raise RouterError(Refusal.UNAVAILABLE, NO_PLAN, 1.0)
            now = self._clock()
            snapshot = self._snapshot(flight, now, tried, lookup)
            live = [w for w in snapshot.levels if w not in snapshot.down]
            outcome = self.policy.route(
                levels.get(plan.strategy, 0),
                flight.request,
                snapshot,
                flight.deadline - now,
                retry=bool(tried),
                edit=flight.work.edit,
                steps=flight.steps,
            )
            if not isinstance(outcome, Refused):
                worker = outcome.decision.worker_id
                self._beliefs.sent(worker, now)
                token = next(self._sends)
                if self._edits is not None:
                    self._edits.sent(worker, token, flight.work.job, now)
                held = self._hold(flight, outcome, snapshot, token)
        if lookup is not None and self.cache is not None and not tried:
            self.cache.record(lookup, live)
        if isinstance(outcome, Refused):
            raise self._refusal(outcome)
        if outcome.cache is not None:
            self.stats.cache_routed(outcome.cache)
        if outcome.balancer:
            self.stats.edit_placed(outcome.balancer, held=outcome.held)
        decision = outcome.decision
        if decision.spilled:
            names = self._router.level_name
            self.stats.spilled(names(decision.target_level), names(decision.served_level))
        return decision, plan.strategy, held, token

    def _hold(
        self, flight: InFlight, outcome: Admitted, snapshot: Snapshot, token: int
    ) -> Held | None:
        """Send the admitted request at once when its worker has room and no request is held
        for it (None); else hold it there (:class:`Held`). Tied to its worker when the
        caches or an edit balancer chose it. Under the lock."""
        binder = self.policy.binder
        worker = outcome.decision.worker_id
        if binder is None:
            return None
        if binder.has_room(worker) and not binder.line(worker):
            binder.send(worker)
            return None
        served = outcome.decision.served_level if outcome.cache is None else outcome.cache.index

        def held_s(target: str) -> float:
            return self._request_s(flight, target, served, self._clock())

        def expected_s(target: str) -> float:  # as learned, without admission's headroom
            return self._request_s(flight, target, served, self._clock(), headroom=False)

        pinned = outcome.cache is not None or self._edits is not None
        held = Held(
            token,
            worker,
            snapshot.levels[worker],
            served,
            flight.deadline,
            held_s,
            pinned=pinned,
            expected_s=expected_s,
        )
        binder.hold(held)
        if not pinned:  # another worker of its level may have room for it already
            now = self._clock()
            for other, level in snapshot.levels.items():
                if other != worker and level == held.level and binder.has_room(other):
                    self._dispatch(other, now)
        return held

    def _bind(
        self, flight: InFlight, decision: RouteDecision, held: Held | None
    ) -> tuple[RouteDecision, str]:
        """Wait until a worker with room takes ``flight``'s held request (none held: sent at
        once), and return the decision with that worker and its address. Refused OVERLOADED,
        with the excess as the retry hint, as soon as the router predicts it cannot finish by
        its deadline; UNAVAILABLE when its worker leaves the plan or goes down (the caller
        routes it again); CANCELLED when the client leaves."""
        binder = self.policy.binder
        if held is None or binder is None:
            with self._lock:
                return decision, self._beliefs.address(decision.worker_id)
        wake = threading.Event()
        with self._lock:  # any change to its state after this wakes it
            held.wake = wake.set
        flight.cancel.attach(wake.set)
        try:
            while True:
                with self._lock:
                    wake.clear()
                    now = self._clock()
                    if flight.cancel.cancelled and binder.withdraw(held.token) is not None:
                        held.dropped = True
                        self._uncount([held], now)
                    elif binder.expire(held, now):
                        self._uncount([held], now)
                    if held.sent_to is not None:
                        worker = held.sent_to
                        return replace(decision, worker_id=worker), self._beliefs.address(worker)
                    waiting = not held.late and not held.dropped
                    wait_s = binder.expires_at(held) - now if waiting else 0.0
                flight.cancel.check()
                if held.late:
                    self.stats.rejected("late")
                    raise RouterError(
                        Refusal.OVERLOADED,
                        f"deadline: predicted {held.predicted_s * 1e3:.0f} ms exceeds the "
                        f"{held.budget_s * 1e3:.0f} ms left while held for a worker",
                        max(held.predicted_s - max(held.budget_s, 0.0), 0.05),
                    )
                if held.dropped:
                    raise RouterError(
                        Refusal.UNAVAILABLE, f"worker {held.worker} left while the request waited"
                    )
                wake.wait(max(wait_s, 0.001))
        finally:
            flight.cancel.attach(None)

    def _uncount(self, gone: list[Held], now: float) -> None:
        """Uncount requests no longer held and never sent from the workers they were counted
        on, and wake their callers. Under the lock."""
        for held in gone:
            self._beliefs.withdrawn(held.worker)
            if self._edits is not None:
                self._edits.answered(held.worker, held.token, ok=False, now=now)
            held.wake()

    def _dispatch(self, worker: str, now: float) -> None:
        """``worker`` may have room: predict its held requests again on the newest service
        times (refusing those now late) and let it take held requests while it has room.
        Under the lock."""
        binder = self.policy.binder
        if binder is None:
            return
        level = self._beliefs.levels.get(worker)
        if level is None or worker in self._beliefs.down(now):
            return
        elapsed = self._beliefs.elapsed_s(worker, now)
        late = binder.overdue(worker, now, elapsed)
        while True:
            taken, also_late = binder.take(worker, level, now, elapsed)
            late += also_late
            if taken is None:
                break
            if taken.worker != worker:
                self._beliefs.moved(taken.worker, worker, now)
            taken.wake()
        self._uncount(late, now)

    def _drop_held(self, keep: AbstractSet[str], now: float) -> None:
        """Give the held requests counted on a worker not in ``keep`` back to be routed again,
        and let every worker in ``keep`` take held requests. Under the lock."""
        binder = self.policy.binder
        if binder is None:
            return
        gone = binder.forget(set(keep))
        for held in gone:
            held.dropped = True
        self._uncount(gone, now)
        for worker in keep:
            self._dispatch(worker, now)

    def _forward(
        self,
        flight: InFlight,
        decision: RouteDecision,
        address: str,
        token: int,
        lookup: Lookup | None,
    ) -> WorkerReply:
        level = self._router.level_name(decision.served_level)
        work = worker_call(flight.request, level, previews=flight.progress is not None)
        cache = self.cache
        if cache is not None:  # the worker answers with its cache's changes since then, and
            # takes the prompt's vector from ``lookup`` instead of embedding it again
            vector, encoder = cache.vector_for(lookup)
            work = replace(
                work,
                cache_cursor=cache.cursor(decision.worker_id),
                prompt_embedding=vector,
                prompt_encoder=encoder,
            )
        with self._lock:
            self.worker_calls += 1
        answered = False
        try:
            flight.cancel.check()  # the client left while the request was classified or routed
            reply = self._workers.generate(
                address,
                work,
                timeout_s=max(0.001, flight.deadline - self._clock()),
                cancel=flight.cancel,
                progress=flight.progress,
            )
            served = reply.level or level
            if cache is not None:
                cache.apply(decision.worker_id, reply.cache_events)
                cache.answered(decision.worker_id, reply.cache_miss_reason)
            self._learn(decision.worker_id, served, self._level_cost(flight, served), reply)
            answered = True
            return reply
        except WorkerError as err:
            if err.kind is Refusal.UNAVAILABLE:
                with self._lock:
                    now = self._clock()
                    self._beliefs.mark_down(decision.worker_id, now + self.config.down_for_s)
                    self._drop_held(set(self._beliefs.levels) - self._beliefs.down(now), now)
            if err.kind in (Refusal.DEADLINE, Refusal.CANCELLED):
                at_level = self._level_cost(flight, level)
                self._abandoned(decision.worker_id, level, at_level, flight.steps)
            if err.kind is Refusal.CANCELLED and flight.cancel.cancelled:
                raise RouterError(err.kind, "the client cancelled the request") from None
            if err.kind in (Refusal.INVALID, Refusal.NOT_FOUND):  # the field first, as ours
                raise RouterError(
                    err.kind, f"{err.details} (worker {decision.worker_id})"
                ) from None
            raise RouterError(err.kind, f"worker {decision.worker_id}: {err.details}") from None
        finally:
            flight.cancel.attach(None)
            with self._lock:
                now = self._clock()
                if self._edits is not None:
                    self._edits.answered(decision.worker_id, token, ok=answered, now=now)
                self._beliefs.answered(decision.worker_id, now)
                if self.policy.binder is not None:
                    self.policy.binder.done(decision.worker_id)
                    self._dispatch(decision.worker_id, now)

    def _learn(self, worker: str, level: str, cost: float, reply: WorkerReply) -> None:
        """Learn the worker's service time at ``level`` from its reply's timings."""
        timing = reply.timing
        with self._lock:
            if not self._beliefs.planned(worker):
                return  # it left the plan while serving
            self._beliefs.replied(worker, level)
            self._times.observe(
                worker,
                self._beliefs.gpu_class(worker),
                level,
                cost,
                (timing.total_ms - timing.queue_ms) / 1e3,
                timing.denoise_ms / 1e3,
                self._clock(),
            )

    def _abandoned(self, worker: str, level: str, cost: float, steps: StepCount) -> None:
        """The call to ``worker`` ended without an answer (deadline, cancel): the worker stops
        at its next denoising step, so count it busy for one step's time more."""
        with self._lock:
            if not self._beliefs.planned(worker):
                return
            now = self._clock()
            gpu_class = self._beliefs.gpu_class(worker)
            step_s = self._times.step_s(worker, gpu_class, level, cost, steps.counted, now)
            self._beliefs.abandoned(worker, now, now + step_s)

    def _refusal(self, refused: Refused) -> RouterError:
        """The policy's refusal as the error the caller gets, counted by its reason."""
        if refused.reason:
            self.stats.rejected(refused.reason)
        return refused.error()

    def _response(
        self,
        flight: InFlight,
        reply: WorkerReply,
        decision: RouteDecision,
        strategy: Strategy,
        attempts: int,
        marks: tuple[float, float, float, float],
    ) -> RouterReply:
        arrived, classified_at, routed_at, done = marks
        names = self._router.level_name
        if self.drift is not None and reply.scores:
            self.drift.observe(reply.scores)
        level = reply.level or names(decision.served_level)
        self.stats.served(
            Served(
                level,
                strategy,
                names(decision.optimal_level),
                done - arrived,
                reply.timing.total_ms / 1e3,
                late=done - arrived > self.slo_s,
            )
        )
        return RouterReply(
            request_id=flight.request.request_id,
            png=reply.png,
            level=level,
            level_index=decision.served_level,
            strategy=strategy,
            worker_id=reply.worker_id or decision.worker_id,
            classified_level=names(decision.optimal_level),
            target_level=names(decision.target_level),
            plan_version=self._plan_version,
            timing=RouterTiming(
                classify_ms=(classified_at - arrived) * 1e3,
                route_ms=(routed_at - classified_at) * 1e3,
                forward_ms=(done - routed_at) * 1e3,
                total_ms=(done - arrived) * 1e3,
                worker=reply.timing,
                attempts=attempts,
            ),
            # other requests' prompts in the scores (for the drift monitor) and in the cache's
            # events (for the router's view of the worker's cache): never to the client
            worker_response=replace(reply, png=b"", scores=(), cache_events=None),
        )


@dataclass(frozen=True)
class _Work:
    """What one request puts on a worker, for the edit balancer (:meth:`RouterCore._work`)."""

    job: EditJob  # as counted in flight: an edit's mask ratio and template, else ratio 1
    inpainting: bool  # an inpainting edit: placed by the edit balancer when one is configured

    @property
    def edit(self) -> EditJob | None:
        """The job, when the policy may place it as an edit."""
        return self.job if self.inpainting else None


@dataclass(frozen=True)
class InFlight:
    """One request being served, as checked and priced: what each step of
    :meth:`RouterCore.generate` hands the next, and what its caller listens with."""

    request: RouterRequest  # as served: checked, an edit's width and height its image's
    steps: StepCount  # its denoising steps, resolved once (RouterPolicy.steps_of)
    cost: float  # in reference requests (RouterPolicy.price)
    work: _Work  # what it puts on a worker, for the edit balancer
    arrived: float  # the core's clock when it arrived
    deadline: float  # the core's clock by which it must be answered
    progress: ProgressSink | None  # the caller's listener for progress events; None: none
    cancel: CallCancel  # set when the caller goes away

    def routed(
        self, decision: RouteDecision, names: Callable[[int], str], elapsed_s: float
    ) -> None:
        if self.progress is not None:
            self.progress(
                Progress(
                    stage=Stage.ROUTED,
                    level=names(decision.served_level),
                    worker_id=decision.worker_id,
                    elapsed_ms=elapsed_s * 1e3,
                )
            )
