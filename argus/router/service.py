"""The router's request path and its thin gRPC servicer (``argus.v1.Router``).

:class:`RouterCore` serves one request, top to bottom:

1. check the request (:func:`check_request`, INVALID_ARGUMENT naming the field) and price it
   (:func:`~argus.router.admission.request_cost`: pixels × steps over the profile's reference
   request); a cost above ``max_cost`` is INVALID_ARGUMENT naming width, height and steps;
2. claim its request id (a retry joins or returns the first call);
3. take an in-flight slot (RESOURCE_EXHAUSTED when the router holds its maximum);
4. admit early, before the classifier: the earliest completion over the live workers, each at
   the cheapest level it may serve the request at, with their queues, the requests being
   classified ahead of it and the classifier's backlog. A request that cannot finish in time
   even on an idle worker is DEADLINE_EXCEEDED naming its fields; one that cannot finish in
   time now is RESOURCE_EXHAUSTED with ``retry-after-ms``. Either way the refusal takes no
   classifier time, which under overload is what keeps refusals fast and served throughput up;
5. classify the prompt (AC and SM levels; both are reported to the allocator);
6. route on the installed plan (PASM sample, Eq. 3 worker selection) and admit against the
   deadline with the chosen worker's queue and the request's cost (RESOURCE_EXHAUSTED with
   ``retry-after-ms`` trailing metadata);
7. forward to the worker with the remaining time as the call's gRPC deadline (the worker
   drops the request if it expires in its queue and stops denoising when it passes); a worker
   that is UNAVAILABLE mid-request is marked down and the request is routed again to another
   worker while the deadline allows.

Plans come from ``install`` (wired to ``PlanWatcher``'s ``on_plan``). The clock is passed in.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, Protocol

import grpc

from argus import defaults, rpc
from argus.classifier.prompts import InvalidPromptError
from argus.classifier.serving import BatcherClosed, BatcherFull
from argus.contracts.plans import PublishedPlan
from argus.contracts.wire import STRATEGY_TO_PB as _STRATEGY_TO_PB
from argus.grpc_server import reconnect_options, set_serving
from argus.request_limits import (
    ImageLimits,
    InvalidRequestError,
    check_image,
    check_prompts,
    check_sampling,
)
from argus.router.admission import (
    AdmissionRule,
    AnswerDroppedError,
    IdConflictError,
    LedgerFullError,
    RequestLedger,
    WorkerLoad,
    admit,
    earliest_completion_s,
    request_cost,
)
from argus.router.drift import RouterDrift
from argus.router.metrics import RouterMetrics
from argus.router.routing import PlanRouter, RouterConfig
from argus.router.scheduler import NoLiveWorkerError
from argus.types import ProfileSet, RouteDecision, Strategy

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

log = logging.getLogger(__name__)

SERVICE_NAME = "argus.v1.Router"
RETRY_AFTER_KEY = "retry-after-ms"
MAX_ID_CHARS = 128
# a worker's answer that blames the request, not the cluster: no SLO violation
CALLER_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.CANCELLED,  # the client went away
    }
)
ProgressSink = Callable[[Any], None]  # takes argus.v1.Progress messages
DEFAULT_LIMITS = ImageLimits()
SLO_FACTOR = 3.0  # SLO = 3 × the best level's latency (Argus §5; the simulator's default)


class CallCancel:
    """Set when one call's client goes away (a gRPC cancel, an HTTP disconnect); cancels the
    worker call in flight then, or at once when it starts later. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._target: Callable[[], Any] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            target, self._target = self._target, None
        if target is not None:
            target()

    def attach(self, target: Callable[[], Any] | None) -> None:
        """Cancel ``target`` (a gRPC call's ``cancel``) when this call is cancelled; None
        detaches. A call already cancelled cancels the target at once."""
        with self._lock:
            if not self._cancelled:
                self._target = target
                return
        if target is not None:
            target()

    def check(self) -> None:
        if self._cancelled:
            raise RouterError(grpc.StatusCode.CANCELLED, "the client cancelled the request")


class PromptLevels(Protocol):
    """The classifier as the router uses it (``PromptClassifier`` implements it)."""

    def classify(
        self, prompt: str | bytes, timeout: float | None = None
    ) -> dict[Strategy, int]: ...


@dataclass(frozen=True)
class RouterServiceConfig:
    """How one router process serves requests."""

    router_id: str = defaults.ROUTER_ID
    """Stable id in the allocator's reports."""

    default_deadline_ms: int = defaults.DEFAULT_DEADLINE_MS
    """Deadline of requests that set none, milliseconds."""

    max_in_flight: int = defaults.MAX_IN_FLIGHT
    """Requests served at once; more are refused with RESOURCE_EXHAUSTED (bounded memory)."""

    id_window_s: float = 300.0
    """Seconds a finished request id is remembered for retries."""

    max_ids: int = 4096
    """Request ids remembered at most (finished ones are dropped oldest first)."""

    max_id_bytes: int = defaults.MAX_ID_BYTES
    """Bytes of finished answers kept for retries (serialized size), oldest dropped first; a
    retry whose answer was dropped is FAILED_PRECONDITION naming its id, never run twice."""

    down_for_s: float = 5.0
    """Seconds a worker that failed with UNAVAILABLE is routed around."""

    max_attempts: int = 3
    """Workers tried per request."""

    slo_s: float | None = None
    """Latency objective of the SLO-violation count; None: 3 × the best level's latency."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    """Largest image accepted (the workers' limits)."""

    routing: RouterConfig = field(default_factory=RouterConfig)

    admission: AdmissionRule = field(default_factory=AdmissionRule)
    """How sure the predicted completion must be to admit a request (the simulator's rule)."""

    max_cost: float | None = None
    default_steps: int | None = None
    """The workers' default steps (``argus worker --default-steps``): a request without
    ``steps`` runs that many, so no level may skip as many. None: not known, not capped."""
    """Largest request accepted, in reference requests of the profile (pixels × steps over the
    reference's; 80 for 2048 × 2048 at 1000 steps against 1024 × 1024 at 50); None: no cap."""

    def __post_init__(self) -> None:
        if self.max_cost is not None and not (math.isfinite(self.max_cost) and self.max_cost > 0):
            raise ValueError(f"max_cost: must be a finite number > 0, got {self.max_cost}")
        for name in ("default_deadline_ms", "max_in_flight", "max_ids", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.id_window_s < 0.0 or self.down_for_s < 0.0:
            raise ValueError("id_window_s, down_for_s: must be >= 0")
        if self.max_id_bytes < 0:
            raise ValueError(f"max_id_bytes: must be >= 0, got {self.max_id_bytes}")
        if self.slo_s is not None and not self.slo_s > 0.0:
            raise ValueError(f"slo_s: must be > 0, got {self.slo_s}")

    def slo_for(self, profiles: ProfileSet) -> float:
        """The SLO in seconds: ``slo_s``, or 3 × the best level's latency on the profile's
        first worker class (the simulator's rule, so live and simulated reports agree)."""
        if self.slo_s is not None:
            return self.slo_s
        return SLO_FACTOR * profiles.best_latency_s(profiles.worker_classes[0])


class RouterError(Exception):
    """A request ends with ``code``; ``retry_after_s`` becomes the retry-after-ms hint."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(details)
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Classified:
    """A prompt's levels per strategy, for the allocator's affinity histogram H."""

    at_s: float
    levels: Mapping[Strategy, int]


# -- checks --------------------------------------------------------------------------------


def check_request(request: Any, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """Raise RouterError(INVALID_ARGUMENT) naming the first bad field; return otherwise.

    Prompts, image size and sampling are checked by the rules the workers apply
    (:mod:`argus.request_limits`); a worker's defaults fill absent fields.
    """

    def given(name: str) -> Any:
        return getattr(request, name) if request.HasField(name) else None

    try:
        if len(request.request_id) > MAX_ID_CHARS:
            raise InvalidRequestError(
                "request_id", f"at most {MAX_ID_CHARS} characters, got {len(request.request_id)}"
            )
        check_prompts(request.prompt, request.negative_prompt)
        check_image(given("width"), given("height"), limits)
        check_sampling(given("steps"), given("guidance_scale"), request.seed)
        if request.HasField("deadline_ms") and request.deadline_ms == 0:
            raise InvalidRequestError("deadline_ms", "must be > 0")
        for i, adapter in enumerate(request.adapters):
            if adapter.kind == 0 or not adapter.name:
                raise InvalidRequestError(f"adapters[{i}]", "needs a kind and a name")
    except InvalidRequestError as err:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None


def fingerprint(request: Any) -> bytes:
    """What must match for a retried request id to be the same request."""
    copy = router_pb2.RouterGenerateRequest()
    copy.CopyFrom(request)
    copy.ClearField("deadline_ms")  # a retry may carry a shorter deadline
    # a digest: the ledger keeps one per id for minutes, and a request may carry an image
    return hashlib.blake2b(copy.SerializeToString(deterministic=True), digest_size=16).digest()


# -- workers -------------------------------------------------------------------------------


def _worker_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=reconnect_options())


class WorkerChannels:
    """One gRPC channel per worker address, reused across requests.

    A channel dropped from the plan is closed only ``grace_s`` later: closing a gRPC channel
    cancels the calls on it, and a worker that left a plan (or was restarted at the same
    address and rejoins) may still be serving requests the router sent it, which would
    otherwise fail as CANCELLED although nobody cancelled them.
    """

    def __init__(
        self,
        factory: Callable[[str], grpc.Channel] | None = None,
        *,
        grace_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory or _worker_channel
        self._grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, Any]] = {}
        self._retired: list[tuple[float, grpc.Channel]] = []  # (close at, channel)

    def stub(self, address: str) -> Any:
        with self._lock:
            found = self._stubs.get(address)
            if found is None:
                channel = self._factory(address)
                found = (channel, worker_pb2_grpc.WorkerStub(channel))
                self._stubs[address] = found
            return found[1]

    def keep_only(self, addresses: set[str]) -> None:
        """Retire the channels of addresses not in ``addresses``; close retired channels
        whose grace has passed."""
        now = self._clock()
        with self._lock:
            gone = [a for a in self._stubs if a not in addresses]
            self._retired += [(now + self._grace_s, self._stubs.pop(a)[0]) for a in gone]
            due = [channel for at, channel in self._retired if at <= now]
            self._retired = [(at, channel) for at, channel in self._retired if at > now]
        for channel in due:
            channel.close()

    def close(self) -> None:
        """Close every channel now (the router is stopping)."""
        with self._lock:
            channels = [channel for channel, _ in self._stubs.values()]
            channels += [channel for _, channel in self._retired]
            self._stubs.clear()
            self._retired.clear()
        for channel in channels:
            channel.close()


# -- the core ------------------------------------------------------------------------------


class RouterCore:
    """Serves requests on the latest installed plan; thread-safe."""

    def __init__(
        self,
        profiles: ProfileSet,
        classifier: PromptLevels,
        config: RouterServiceConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        channels: WorkerChannels | None = None,
        metrics: RouterMetrics | None = None,
        drift: RouterDrift | None = None,
    ) -> None:
        self.profiles = profiles
        self.classifier = classifier
        self.drift = drift  # takes the quality scores workers send on their replies
        self.config = config
        self.slo_s = config.slo_for(profiles)
        self.metrics = metrics
        self._clock = clock
        self._router = PlanRouter(profiles, rng or random.Random(0), config.routing)
        self._channels = channels or WorkerChannels()
        self._lock = threading.Lock()  # router, queues, down, addresses, observations
        self._addresses: dict[str, str] = {}
        self._queues: dict[str, int] = {}
        self._head_started: dict[str, float] = {}  # when each worker began its current request
        self._down_until: dict[str, float] = {}
        self._plan_version = 0
        self._in_flight = threading.BoundedSemaphore(config.max_in_flight)
        self._ledger: RequestLedger[Any] = RequestLedger(
            clock,
            window_s=config.id_window_s,
            max_entries=config.max_ids,
            max_bytes=config.max_id_bytes,
            size_of=lambda response: int(response.ByteSize()),
            on_evict=metrics.ids_evicted.inc if metrics is not None else None,
        )
        self._arrivals: list[float] = []
        self._classified: list[Classified] = []
        self._serving = 0
        self._runnable = {s: _runnable_levels(profiles, s) for s in Strategy}
        self._worker_levels: dict[str, tuple[int, str]] = {}  # worker → (level index, class)
        self._classifying = 0  # requests admitted early and not yet routed
        self._models = {level.name: level.model for level in profiles.levels}
        self.worker_calls = 0  # Generate calls sent to workers (tests, metrics)
        if metrics is not None:
            metrics.in_flight.set_function(lambda: self._serving)

    def close(self) -> None:
        """Close the worker channels (after the server stopped)."""
        self._channels.close()

    def has_plan(self) -> bool:
        with self._lock:
            return self._router.plan is not None

    def can_serve(self) -> bool:
        """A plan is installed and names at least one worker (workers join the allocator only
        once ready, so this is "some worker can take a request"); health reports this."""
        with self._lock:
            return self._router.plan is not None and bool(self._addresses)

    def now(self) -> float:
        """The core's clock (the servicer turns gRPC deadlines into clock times with it)."""
        return self._clock()

    # plans -------------------------------------------------------------------------------

    def install(self, published: PublishedPlan) -> bool:
        """Follow ``published`` from now on (``PlanWatcher``'s ``on_plan``). A plan this router
        cannot route on (a worker class missing from its profile) is refused and logged: the
        previous plan stays; returns whether it was installed."""
        with self._lock:
            try:
                self._router.install(published.plan, published.worker_classes(), self._clock())
            except KeyError as err:
                log.error("plan %d refused: %s", published.version, err)
                return False
            self._addresses = {w.worker_id: w.address for w in published.workers}
            levels = published.plan.allocation.levels
            classes = published.worker_classes()
            self._worker_levels = {
                w: (levels.index(level), classes[w])
                for w, level in published.plan.allocation.assignment.items()
            }
            self._queues = {w: self._queues.get(w, 0) for w in self._addresses}
            self._head_started = {
                w: t for w, t in self._head_started.items() if w in self._addresses
            }
            self._down_until = {w: t for w, t in self._down_until.items() if w in self._addresses}
            self._plan_version = published.version
            queues = dict(self._queues)
        self._channels.keep_only(set(self._addresses.values()))
        if self.metrics is not None:
            self.metrics.observe_plan(published.version, published.plan.strategy, queues)
        return True

    # statistics for the allocator ---------------------------------------------------------

    def take_statistics(self) -> tuple[list[float], list[Classified], bool]:
        """Arrivals and classifications since the last call, and whether to re-plan early."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            classified, self._classified = self._classified, []
            now = self._clock()
            wants = self._router.plan is not None and self._router.wants_replan(
                now, self._queues, self._down(now)
            )
        return arrivals, classified, wants

    # requests ----------------------------------------------------------------------------

    def generate(
        self,
        request: Any,
        deadline_s: float | None = None,
        *,
        progress: ProgressSink | None = None,
        cancel: CallCancel | None = None,
    ) -> Any:
        """Serve one RouterGenerateRequest; RouterError carries the status to answer with.

        ``deadline_s`` is the gRPC deadline as a clock time, when the client set one;
        ``progress`` and ``cancel``: see the module's docstring.
        """
        arrived = self._clock()
        call = _Call(progress, cancel or CallCancel())
        try:
            return self._generate(request, arrived, deadline_s, call)
        except RouterError as err:
            if self.metrics is not None:
                self.metrics.requests.labels(err.code.name).inc()
            raise

    def _generate(self, request: Any, arrived: float, deadline_s: float | None, call: _Call) -> Any:
        check_request(request, self.config.limits)
        cost = self._price(request)
        budget_ms = request.deadline_ms if request.HasField("deadline_ms") else None
        deadline = arrived + (budget_ms or self.config.default_deadline_ms) / 1e3
        if deadline_s is not None:
            deadline = min(deadline, deadline_s)
        if not request.request_id:
            return self._serve(request, arrived, deadline, cost, call)
        try:
            future, owner = self._ledger.claim(request.request_id, fingerprint(request))
        except IdConflictError as err:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, str(err)) from None
        except AnswerDroppedError as err:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        except LedgerFullError as err:
            self._rejected("ids")
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), 1.0) from None
        if not owner:
            return self._join(future, deadline)
        try:
            response = self._serve(request, arrived, deadline, cost, call)
        except BaseException as err:
            self._ledger.fail(request.request_id, err)
            raise
        self._ledger.finish(request.request_id, response)
        return response

    def _join(self, future: Any, deadline: float) -> Any:
        try:
            return future.result(timeout=max(0.0, deadline - self._clock()))
        except TimeoutError:
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the first call with this id is still running"
            ) from None

    def _price(self, request: Any) -> float:
        """The request's cost in reference requests; INVALID_ARGUMENT above ``max_cost``."""

        def given(name: str) -> int | None:
            return getattr(request, name) if request.HasField(name) else None

        ref = self.profiles.reference
        cost = request_cost(given("width"), given("height"), given("steps"), ref)
        cap = self.config.max_cost
        if cap is not None and cost > cap:
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"width, height, steps: {_size(request)} costs {cost:.3g} reference requests "
                f"({ref.width}×{ref.height}, {ref.steps} steps); this deployment accepts at "
                f"most {cap:.3g}",
            )
        return cost

    def _serve(
        self, request: Any, arrived: float, deadline: float, cost: float, call: _Call
    ) -> Any:
        if not self._in_flight.acquire(blocking=False):
            self._rejected("busy")
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router busy: {self.config.max_in_flight} requests in flight",
                0.1,
            )
        with self._lock:
            self._serving += 1
        try:
            return self._classify_route_forward(request, arrived, deadline, cost, call)
        finally:
            with self._lock:
                self._serving -= 1
            self._in_flight.release()

    def _classify(self, prompt: str, deadline: float) -> Mapping[Strategy, int]:
        """The prompt's levels; classifier failures become statuses (never UNKNOWN)."""
        try:
            return self.classifier.classify(prompt, timeout=max(0.001, deadline - self._clock()))
        except InvalidPromptError as err:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {err}") from None
        except TimeoutError:
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while classifying"
            ) from None
        except BatcherFull as err:
            self._rejected("busy")
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), 0.1) from None
        except BatcherClosed:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "router shutting down", 1.0) from None

    def _admit_early(self, request: Any, arrived: float, deadline: float, cost: float) -> None:
        """Refuse, before the classifier sees the prompt, a request that cannot finish by
        ``deadline`` on any live worker at the cheapest level it may be served at; otherwise
        count it among the requests being classified (the caller uncounts it)."""
        backlog = getattr(self.classifier, "backlog_s", None)
        classifier_s = backlog() if backlog is not None else 0.0
        with self._lock:
            self._arrivals.append(arrived)  # refused or not, it is load the allocator plans for
            plan = self._router.plan
            if plan is None:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no plan yet", 1.0)
            cap = self._level_cap(plan.strategy, request)
            now = self._clock()
            loads = self._loads(cap, cost, now)
            if not loads:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no live worker left", 1.0)
            loaded, idle = earliest_completion_s(self.config.admission, loads, self._classifying)
            budget = deadline - now
            if idle > budget:
                self._rejected("deadline")
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"width, height, steps, deadline_ms: {_size(request)} ({cost:.3g} reference "
                    f"requests) takes {idle * 1e3:.0f} ms on an idle worker, more than the "
                    f"{budget * 1e3:.0f} ms left",
                )
            verdict = admit(loaded + classifier_s, budget)
            if not verdict.admitted:
                self._rejected("deadline")
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"deadline: the earliest completion is {verdict.predicted_s * 1e3:.0f} ms "
                    f"away (classifier backlog {classifier_s * 1e3:.0f} ms), more than the "
                    f"{verdict.budget_s * 1e3:.0f} ms left",
                    verdict.retry_after_s,
                )
            self._classifying += 1

    def _loads(self, cap: int | None, cost: float, now: float) -> list[WorkerLoad]:
        """The live workers that may serve a request capped at level ``cap``, each with the
        request's service time at the cheapest level it can serve it at. Under the lock."""
        down = self._down(now)
        loads = []
        for worker, (index, worker_class) in self._worker_levels.items():
            if worker in down:
                continue
            if cap is not None and index > cap:
                if self._model_of(index) != self._model_of(cap):
                    continue
                index = cap  # it runs the capped level on the same model (see _route_capped)
            latency = self.profiles.profile(worker_class, self._router.level_name(index)).latency_s
            queue = self._queues.get(worker, 0)
            elapsed = now - self._head_started.get(worker, now)
            loads.append(WorkerLoad(queue, latency * cost, elapsed))
        return loads

    def _level_cap(self, strategy: Strategy, request: Any) -> int | None:
        """The highest level index ``request`` may be served at: its ``max_level_index`` and
        the levels that skip fewer steps than it runs; None when any level may serve it."""
        max_level = request.max_level_index if request.HasField("max_level_index") else None
        if request.HasField("steps"):
            steps = request.steps
        elif self.config.default_steps is not None:  # what the workers will run
            steps = self.config.default_steps
        else:
            return max_level
        runnable = self._runnable[strategy](steps)
        if runnable < 0:
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"steps: {steps} leaves no level of {strategy.value} runnable",
            )
        return runnable if max_level is None else min(max_level, runnable)

    def _classify_route_forward(
        self, request: Any, arrived: float, deadline: float, cost: float, call: _Call
    ) -> Any:
        self._admit_early(request, arrived, deadline, cost)
        try:
            levels = self._classify(request.prompt, deadline)
        finally:
            with self._lock:
                self._classifying -= 1
        classified_at = self._clock()
        if self.metrics is not None:
            self.metrics.classify.observe(classified_at - arrived)
        with self._lock:
            self._classified.append(Classified(classified_at, dict(levels)))
        tried: set[str] = set()
        admitted = False
        try:
            for attempt in range(1, self.config.max_attempts + 1):
                decision, strategy, address = self._route(levels, deadline, tried, request, cost)
                admitted = True
                routed_at = self._clock()
                call.routed(decision, self._router.level_name, routed_at - arrived)
                try:
                    reply = self._forward(request, decision, address, deadline, call)
                except RouterError as err:
                    if err.code is not grpc.StatusCode.UNAVAILABLE:
                        raise
                    if attempt == self.config.max_attempts:
                        raise
                    tried.add(decision.worker_id)
                    if self.metrics is not None:
                        self.metrics.retries.inc()
                    continue
                done = self._clock()
                return self._response(
                    request, reply, decision, strategy, attempt,
                    (arrived, classified_at, routed_at, done),
                )  # fmt: skip
        except RouterError as err:
            if admitted and err.code not in CALLER_ERRORS and self.metrics is not None:
                self.metrics.slo_violations.inc()  # admitted, then not served
            raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _route(
        self,
        levels: Mapping[Strategy, int],
        deadline: float,
        tried: set[str],
        request: Any,
        cost: float,
    ) -> tuple[RouteDecision, Strategy, str]:
        """Route and admit under the lock; the chosen worker's queue counts this request.

        Levels that skip as many steps as the request runs (K ≥ N) are never chosen; the
        chosen level's latency is scaled by the request's ``cost``."""
        with self._lock:
            plan = self._router.plan
            if plan is None:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no plan yet", 1.0)
            max_level = self._level_cap(plan.strategy, request)
            now = self._clock()
            down = self._down(now) | tried
            decision = self._route_capped(levels.get(plan.strategy, 0), down, max_level)
            if decision.worker_id in down:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no live worker left", 1.0)
            worker = decision.worker_id
            queue = self._queues.get(worker, 0)
            t_proc = cost * decision.score / (queue + 1)  # the score is (queue + 1) × t_proc
            elapsed = now - self._head_started.get(worker, now)
            predicted = self.config.admission.completion_s(queue, t_proc, elapsed)
            verdict = admit(predicted, deadline - now)
            if not verdict.admitted:
                if not tried:
                    self._rejected("deadline")
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"deadline: predicted {verdict.predicted_s * 1e3:.0f} ms exceeds the "
                    f"{verdict.budget_s * 1e3:.0f} ms left",
                    verdict.retry_after_s,
                )
            if queue == 0:
                self._head_started[worker] = now
            self._queues[worker] = queue + 1
            return decision, plan.strategy, self._addresses[worker]

    def _forward(
        self,
        request: Any,
        decision: RouteDecision,
        address: str,
        deadline: float,
        call: _Call,
    ) -> Any:
        message = worker_request(request, self._router.level_name(decision.served_level))
        if call.progress is not None:
            message.previews = request.previews
        with self._lock:
            self.worker_calls += 1
        try:
            call.cancel.check()  # the client left while the request was classified or routed
            stub = self._channels.stub(address)
            timeout = max(0.001, deadline - self._clock())
            if call.progress is None:
                future = stub.Generate.future(message, timeout=timeout)
                call.cancel.attach(future.cancel)
                reply = future.result()
            else:
                reply = _stream_reply(stub.GenerateStream(message, timeout=timeout), call)
        except grpc.RpcError as err:
            code = err.code()
            if code is grpc.StatusCode.UNAVAILABLE:
                with self._lock:
                    self._down_until[decision.worker_id] = self._clock() + self.config.down_for_s
            if code is grpc.StatusCode.CANCELLED and call.cancel.cancelled:
                raise RouterError(code, "the client cancelled the request") from None
            raise RouterError(code, f"worker {decision.worker_id}: {err.details()}") from None
        except grpc.FutureCancelledError:
            raise RouterError(
                grpc.StatusCode.CANCELLED, "the client cancelled the request"
            ) from None
        finally:
            call.cancel.attach(None)
            with self._lock:
                if self._queues.get(decision.worker_id, 0) > 0:
                    self._queues[decision.worker_id] -= 1
                    # a worker serves in order: the next request started as this one ended
                    self._head_started[decision.worker_id] = self._clock()
        check_reply_size(message, reply, decision.worker_id)
        return reply

    def _route_capped(self, optimal: int, down: set[str], cap: int | None) -> RouteDecision:
        """Route with no level above ``cap``. When no live worker serves such a level, a worker
        whose model also runs the capped level serves it there (AC levels share one model:
        an ac-k25 worker runs ac-k0 for a request of 4 steps); otherwise UNAVAILABLE."""
        try:
            return self._router.route(optimal, self._queues, down, cap)
        except NoLiveWorkerError as err:
            if cap is None:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, str(err), 1.0) from None
            try:
                decision = self._router.route(optimal, self._queues, down)
            except NoLiveWorkerError:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, str(err), 1.0) from None
        if decision.served_level <= cap:
            return decision
        model = self._model_of
        if model(decision.served_level) == model(cap):
            return replace(decision, served_level=cap, fallback=True)
        raise RouterError(
            grpc.StatusCode.UNAVAILABLE,
            f"no live worker can serve level index {cap} or slower now",
            1.0,
        )

    def _model_of(self, index: int) -> str:
        return self._models[self._router.level_name(index)]

    def _down(self, now: float) -> set[str]:
        return {w for w, until in self._down_until.items() if until > now}

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def _response(
        self,
        request: Any,
        reply: Any,
        decision: RouteDecision,
        strategy: Strategy,
        attempts: int,
        marks: tuple[float, float, float, float],
    ) -> Any:
        arrived, classified_at, routed_at, done = marks
        names = self._router.level_name
        worker = worker_pb2.GenerateResponse()
        worker.CopyFrom(reply)
        worker.ClearField("png")
        worker.ClearField("scores")  # other requests' prompts: for the drift monitor only
        if self.drift is not None and reply.scores:
            self.drift.observe(reply.scores)
        if self.metrics is not None:
            self.metrics.observe_served(
                reply.level or names(decision.served_level),
                strategy,
                names(decision.optimal_level),
                done - arrived,
                reply.timing.total_ms / 1e3,
                late=done - arrived > self.slo_s,
            )
        return router_pb2.RouterGenerateResponse(
            request_id=request.request_id,
            png=reply.png,
            level=reply.level or names(decision.served_level),
            level_index=decision.served_level,
            strategy=_STRATEGY_TO_PB[strategy],
            worker_id=reply.worker_id or decision.worker_id,
            classified_level=names(decision.optimal_level),
            target_level=names(decision.target_level),
            plan_version=self._plan_version,
            timing=router_pb2.RouterTiming(
                classify_ms=(classified_at - arrived) * 1e3,
                route_ms=(routed_at - classified_at) * 1e3,
                forward_ms=(done - routed_at) * 1e3,
                total_ms=(done - arrived) * 1e3,
                worker=reply.timing,
                attempts=attempts,
            ),
            worker_response=worker,
        )


@dataclass
class _Call:
    """What one caller of :meth:`RouterCore.generate` listens with."""

    progress: ProgressSink | None
    cancel: CallCancel

    def routed(
        self, decision: RouteDecision, names: Callable[[int], str], elapsed_s: float
    ) -> None:
        if self.progress is not None:
            self.progress(
                worker_pb2.Progress(
                    stage=worker_pb2.Progress.ROUTED,
                    level=names(decision.served_level),
                    worker_id=decision.worker_id,
                    elapsed_ms=elapsed_s * 1e3,
                )
            )


def _stream_reply(events: Any, call: _Call) -> Any:
    """The worker's response at the end of its GenerateStream, its progress passed on."""
    call.cancel.attach(events.cancel)
    assert call.progress is not None
    for event in events:
        if event.WhichOneof("event") == "response":
            return event.response
        call.progress(event.progress)
    raise RouterError(grpc.StatusCode.INTERNAL, "the worker's stream ended without an image")


def _size(request: Any) -> str:
    """The request's size for messages, "W×H, N steps" ("default" for a field it left to the
    worker)."""

    def given(name: str) -> str:
        return str(getattr(request, name)) if request.HasField(name) else "default"

    return f"{given('width')}×{given('height')}, {given('steps')} steps"


def _runnable_levels(profiles: ProfileSet, strategy: Strategy) -> Callable[[int], int]:
    """For N steps, the highest index of ``strategy``'s levels that skips fewer than N (K < N);
    -1 when none does. Levels are slowest first, so K grows with the index."""
    skips = [level.skip_steps for level in profiles.levels_for(strategy)]

    def highest(steps: int) -> int:
        return max((i for i, k in enumerate(skips) if k < steps), default=-1)

    return highest


def check_reply_size(call: Any, reply: Any, worker_id: str) -> None:
    """RouterError (INTERNAL) when the worker's PNG is not the width × height the request
    asked for: a faulty or rogue worker's bytes are not passed on. A size the request left to
    the worker's default is not checked."""
    asked = tuple(getattr(call, n) if call.HasField(n) else None for n in ("width", "height"))
    if asked == (None, None):
        return
    png = bytes(reply.png)
    got: tuple[int, int] | None = None  # PNG: signature, then IHDR's big-endian width, height
    if png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and len(png) >= 24:
        got = (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big"))
    if got is None or any(a not in (None, g) for a, g in zip(asked, got, strict=True)):
        shown = "x".join("*" if v is None else str(v) for v in asked)
        found = "no PNG" if got is None else f"{got[0]}x{got[1]}"
        log.warning("worker %s returned %s for a %s request", worker_id, found, shown)
        raise RouterError(
            grpc.StatusCode.INTERNAL,
            f"worker {worker_id}: returned {found}, not the {shown} image asked for; refused",
        )


def worker_request(request: Any, level: str) -> Any:
    """The worker's GenerateRequest for a router request served at ``level``."""
    call = worker_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=request.seed,
        level=level,
        adapters=request.adapters,
    )
    for name in ("width", "height", "steps", "guidance_scale"):
        if request.HasField(name):
            setattr(call, name, getattr(request, name))
    return call


# -- the servicer --------------------------------------------------------------------------


class RouterServicer(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    """Converts and delegates to :class:`RouterCore`; failures become statuses."""

    def __init__(self, core: RouterCore, health_servicer: Any = None) -> None:
        self.core = core
        self._health = health_servicer

    def plan_installed(self, published: PublishedPlan) -> None:
        """Install ``published`` in the core; health says SERVING while the plan has workers."""
        if self.core.install(published) and self._health is not None:
            set_serving(self._health, SERVICE_NAME, self.core.can_serve())

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        deadline, cancel = self._call(context)
        try:
            return self.core.generate(request, deadline, cancel=cancel)
        except RouterError as err:
            _abort(err, context)

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The core runs on a thread of its own and this call's thread streams its progress
        out (a streaming handler yields from the thread gRPC gave it); the server's bound on
        concurrent calls bounds those threads too."""
        deadline, cancel = self._call(context)
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def run() -> None:
            try:
                events.put(
                    self.core.generate(request, deadline, progress=events.put, cancel=cancel)
                )
            except BaseException as err:  # handed to the call's thread, which answers it
                events.put(err)

        threading.Thread(target=run, name="grpc-stream", daemon=True).start()
        while True:
            event = events.get()
            if isinstance(event, RouterError):
                _abort(event, context)
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, worker_pb2.Progress):
                yield router_pb2.RouterGenerateEvent(progress=event)
            else:
                yield router_pb2.RouterGenerateEvent(response=event)
                return

    def _call(self, context: grpc.ServicerContext) -> tuple[float | None, CallCancel]:
        """The call's deadline on the core's clock, and a cancel its ending early sets."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else self.core.now() + remaining
        cancel = CallCancel()
        context.add_callback(cancel.cancel)  # also runs after a normal end: nothing to cancel
        return deadline, cancel


def _abort(err: RouterError, context: grpc.ServicerContext) -> NoReturn:
    if err.retry_after_s is not None:
        hint = str(max(1, round(err.retry_after_s * 1e3)))
        context.set_trailing_metadata(((RETRY_AFTER_KEY, hint),))
    context.abort(err.code, err.details)
