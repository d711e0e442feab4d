"""The router process around :class:`~argus.router.core.RouterCore`: the gRPC server
(``create_server``: the public endpoint with optional TLS and bearer-token auth, sized by
:func:`grpc_sizes` so that overload is refused in Argus's words), the periodic
statistics report to the allocator (:class:`StatsReporter`, whose ``report_once`` tests call
directly with a fake clock) and the process itself (:class:`RouterSettings`, ``serve``).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from argus import defaults
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import LevelClassifier
from argus.classifier.serving import ClassifierSet
from argus.contracts.allocator_client import AllocatorClient
from argus.contracts.router_api import MAX_REQUEST_BYTES
from argus.contracts.routers import RouterReport
from argus.plumbing.grpc_server import (
    BearerTokenInterceptor,
    InFlightLimit,
    add_health_and_reflection,
    bind,
    check_address,
    check_port,
    new_server,
    set_serving,
)
from argus.router.cache_mirror import Embedder
from argus.router.cache_routing import CacheChoice
from argus.router.config import RouterServiceConfig
from argus.router.convert import retry_after_metadata
from argus.router.core import RouterCore, busy_refusal
from argus.router.drift import DriftSettings, RouterDrift
from argus.router.metrics import RouterMetrics
from argus.router.service import SERVICE_NAME, RouterServicer, router_pb2_grpc
from argus.router.stats import NO_STATS, RouterStats, Served
from argus.router.values import Refusal
from argus.types import ClassQuality, ProfileSet, Strategy

log = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 4 * MAX_REQUEST_BYTES
"""The gRPC transport's bound on a request message, above the API's :data:`MAX_REQUEST_BYTES`
on purpose: gRPC refuses a message over its bound before any handler sees it, with
RESOURCE_EXHAUSTED ("Received message larger than max"), which clients read as overload and
retry. Between the two bounds the servicer refuses the request itself, INVALID_ARGUMENT naming
its largest field and the limit (:func:`argus.router.service.check_size`), as HTTP answers 413.
Four times the API's bound covers the oversized requests clients make by mistake (a prompt or
image of tens of MB) while keeping what one handler thread may hold at 32 MiB; beyond it
gRPC's own refusal stands (no bound would let a client make the router read any size)."""
MAX_REPLY_BYTES = 64 * 1024 * 1024  # an image and its worker's answer
REFUSAL_THREADS = 64
"""Handler threads beside the ``max_in_flight`` that Generate calls may hold: refusals and
health checks run on these, so they never wait behind a call being served. A refusal holds
its thread for well under a millisecond; 64 keep answering a burst of 1,000 calls at once
(benchmarks/bench_concurrency.py)."""
MIN_REFUSAL_THREADS = 16
"""The fewest such threads: an explicit ``threads`` below ``max_in_flight`` + this lowers the
gRPC in-flight bound instead."""
REFUSAL_BACKLOG = 1024
"""Calls gRPC takes beyond the pool's threads, queued for a thread: only refusals and health
checks run on a free one (the in-flight bound holds the rest), so the queue drains in
refusals, a fraction of a millisecond each, and each queued call ends with Argus's
RESOURCE_EXHAUSTED and its retry hint. Beyond threads + this many calls at once gRPC refuses
in its own words, with no hint. A queued call holds no thread and its request is not read
until it runs (flow control keeps what its client sent in the transport's window)."""
GENERATE_METHODS = (f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/GenerateStream")


@dataclass(frozen=True)
class ServerSecurity:
    """The public endpoint's protection; the default is none (loopback development)."""

    credentials: grpc.ServerCredentials | None = None  # TLS
    token: str | None = None  # bearer token every call but health checks must carry


@dataclass(frozen=True)
class GrpcSizes:
    """The bounds of the router's gRPC server, from the innermost out (:func:`grpc_sizes`)."""

    in_flight: int
    """Generate and GenerateStream calls served at once; one more is refused at once by
    Argus (RESOURCE_EXHAUSTED, "router busy", ``retry-after-ms``)."""

    threads: int
    """Handler threads: ``in_flight`` for served calls and the rest for refusals and health
    checks."""

    max_concurrent_rpcs: int
    """Calls gRPC takes at once, those queued for a thread included; one more is refused by
    gRPC itself ("Concurrent RPC limit exceeded!", no retry hint)."""


def grpc_sizes(max_in_flight: int, threads: int | None = None) -> GrpcSizes:
    """The sizes for a core serving ``max_in_flight`` requests at once: by default
    ``max_in_flight`` calls in flight, :data:`REFUSAL_THREADS` more threads and
    :data:`REFUSAL_BACKLOG` more calls (256, 320 and 1,344 with the default 256). With
    ``threads`` given, the pool has that many and the in-flight bound is lowered to keep at
    least :data:`MIN_REFUSAL_THREADS` of them for refusals; ValueError names ``threads`` when
    fewer than that plus one are given."""
    if threads is None:
        threads = max_in_flight + REFUSAL_THREADS
    if threads <= MIN_REFUSAL_THREADS:
        raise ValueError(f"threads: must be > {MIN_REFUSAL_THREADS}, got {threads}")
    in_flight = min(max_in_flight, threads - MIN_REFUSAL_THREADS)
    return GrpcSizes(in_flight, threads, threads + REFUSAL_BACKLOG)


def router_server(
    threads: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    prefix: str = "router",
    backlog: int = REFUSAL_BACKLOG,
) -> grpc.Server:
    """The router's gRPC server, not started and bound to nothing: ``threads`` handler
    threads, gRPC's own bound at ``threads + backlog`` calls at once (see
    :data:`REFUSAL_BACKLOG`), the router's message limits and request parsing. The in-flight
    bound is one of the ``interceptors`` (:func:`create_server` adds it)."""
    return new_server(
        threads=threads,
        thread_prefix=prefix,
        max_receive_bytes=MAX_RECEIVE_BYTES,
        max_send_bytes=MAX_REPLY_BYTES,
        interceptors=interceptors,
        max_concurrent_rpcs=threads + backlog,
    )


class PrometheusStats(RouterStats):
    """The core's events as the ``argus_router_*`` series of ``metrics``."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def watch_in_flight(self, read: Callable[[], int]) -> None:
        self.metrics.in_flight.set_function(read)

    def plan_installed(self, version: int, strategy: Strategy, queues: Mapping[str, int]) -> None:
        self.metrics.observe_plan(version, strategy, queues)

    def served(self, served: Served) -> None:
        self.metrics.observe_served(
            served.level,
            served.strategy,
            served.classified,
            served.total_s,
            served.worker_s,
            late=served.late,
        )

    def failed(self, kind: Refusal, refusal_s: float | None) -> None:
        self.metrics.requests.labels(kind.status_name).inc()
        if refusal_s is not None:
            self.metrics.refusal.observe(refusal_s)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    def classified(self, seconds: float) -> None:
        self.metrics.classify.observe(seconds)

    def edit_placed(self, balancer: str, *, held: bool) -> None:
        self.metrics.observe_edit_placed(balancer, held=held)

    def spilled(self, target: str, served: str) -> None:
        self.metrics.spills.labels(target, served).inc()

    def retried(self) -> None:
        self.metrics.retries.inc()

    def admitted_unserved(self) -> None:
        self.metrics.slo_violations.inc()

    def id_evicted(self) -> None:
        self.metrics.ids_evicted.inc()

    def http_answered(self, route: str, status: int) -> None:
        self.metrics.observe_http(route, status)

    def watch_cache_entries(self, read: Callable[[], int]) -> None:
        self.metrics.cache_entries.set_function(read)

    def cache_embedded(self, seconds: float) -> None:
        self.metrics.cache_embed.observe(seconds)

    def cache_routed(self, choice: CacheChoice) -> None:
        self.metrics.observe_cache_routed(choice.step, choice.similarity, moved=choice.moved)

    def cache_event_skipped(self, reason: str) -> None:
        self.metrics.cache_skipped.labels(reason).inc()

    def cache_forgotten(self, reason: str) -> None:
        self.metrics.cache_forgotten.labels(reason).inc()


def busy_limit(in_flight: int, stats: RouterStats = NO_STATS) -> InFlightLimit:
    """The router's in-flight bound on Generate and GenerateStream, refusing in the core's
    words for the same refusal (RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailer), and
    told to ``stats`` as the core tells it (a RESOURCE_EXHAUSTED answer, rejected as
    "busy"; not the core's own refusal, so not timed as one)."""

    def count() -> None:
        stats.failed(Refusal.OVERLOADED, None)
        stats.rejected("busy")

    refusal = busy_refusal(in_flight)
    assert refusal.retry_after_s is not None
    return InFlightLimit(
        in_flight,
        GENERATE_METHODS,
        refusal.details,
        retry_after_metadata(refusal.retry_after_s),
        on_refuse=count,
    )


def create_server(
    core: RouterCore,
    address: str = "127.0.0.1:0",
    *,
    threads: int | None = None,
    security: ServerSecurity = ServerSecurity(),
) -> tuple[grpc.Server, int, RouterServicer]:
    """A not-yet-started server bound to ``address``; returns it with the bound port.

    Sized by :func:`grpc_sizes` from the core's ``max_in_flight`` (``threads``: the pool's
    size instead of the default): a Generate call beyond the in-flight bound is refused at
    once by Argus with RESOURCE_EXHAUSTED and a ``retry-after-ms`` trailer, from a thread
    kept free for refusals, and gRPC's own bound sits far above it. The bound counts gRPC
    calls only; the core's own ``max_in_flight`` still bounds gRPC and HTTP together.

    Health reports NOT_SERVING until the core has a plan with at least one worker
    (``servicer.plan_installed`` follows plans); requests whose bytes are not a
    RouterGenerateRequest get INVALID_ARGUMENT instead of gRPC's INTERNAL.
    """
    sizes = grpc_sizes(core.config.max_in_flight, threads)
    interceptors: list[grpc.ServerInterceptor] = []
    if security.token is not None:  # an unauthenticated call is refused as such, not as busy
        interceptors.append(BearerTokenInterceptor(security.token))
    interceptors.append(busy_limit(sizes.in_flight, core.stats))
    server = router_server(sizes.threads, interceptors)
    health_servicer = health.HealthServicer()
    servicer = RouterServicer(core, health_servicer)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    add_health_and_reflection(server, health_servicer, [SERVICE_NAME])
    port = bind(server, address, security.credentials)
    set_serving(health_servicer, SERVICE_NAME, core.can_serve())
    return server, port, servicer


class StatsReporter:
    """Sends the router's arrivals and classes to the allocator every period, with the
    ``classifier_key`` of the artifacts they come from (the allocator checks it against the
    classifier whose Q(v | c) it plans with)."""

    def __init__(
        self,
        core: RouterCore,
        client: AllocatorClient,
        clock: Callable[[], float],
        *,
        period_s: float = 1.0,
        classifier_key: str = "",
        drift: RouterDrift | None = None,
    ) -> None:
        self.core = core
        self.drift = drift  # after a retrain, its identity and Q(v | c) go in the report
        self.client = client
        self._clock = clock
        self.period_s = period_s
        self.classifier_key = classifier_key
        # reports are numbered from the wall clock in microseconds, so a restarted router (same
        # id) numbers above its last life's reports and the allocator does not drop them
        self._sequence = time.time_ns() // 1000
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-report", daemon=True)

    def report_once(self) -> None:
        """Send what happened since the last report. Lost on failure (the load is sampled)."""
        taken = self.core.take_report()
        now = self._clock()
        by_strategy: dict[Strategy, list[int]] = {}
        for item in taken.classified:
            for strategy, index in item.levels.items():
                by_strategy.setdefault(strategy, []).append(index)
        key, quality = self.classifier_key, list[ClassQuality]()
        if self.drift is not None:
            key, quality = self.drift.report(self.classifier_key)
        self._sequence += 1
        report = RouterReport(
            self.core.config.router_id,
            sequence=self._sequence,
            arrivals=len(taken.arrivals),
            arrival_ages_s=tuple(max(0.0, now - t) for t in taken.arrivals),
            classified=tuple((s, tuple(indices)) for s, indices in by_strategy.items()),
            replan_wanted=taken.replan_wanted,
            classifier=key,
            class_quality=tuple(quality),
            measured=self.core.measured_latencies(),
            arrival_costs=taken.arrival_costs,
            cache_lookups=taken.cache,
        )
        self.client.report(report, self.core.profiles)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stopping.wait(self.period_s):
            try:
                self.report_once()
            except grpc.RpcError as err:
                log.warning("router report failed: %s", err.code())


@dataclass(frozen=True)
class RouterSettings:
    """The router process's one config type; every ``argus router`` flag maps to a field."""

    allocator: str  # HOST:PORT of the allocator whose plans the router follows
    host: str = defaults.LOOPBACK  # public endpoint; a deployment binds 0.0.0.0 behind TLS and auth
    port: int = 0  # 0: any free port, printed at start
    profile: str | None = None  # a profile file; None: the embedded default
    classifier: str | None = None  # classifier directory; None: the committed default
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    metrics_host: str = defaults.LOOPBACK  # internal: loopback unless told otherwise
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None
    internal_tls_dir: str | None = None  # ca.crt, router.crt/.key for internal calls; None: plain
    report_period_s: float = defaults.REPORT_PERIOD_S
    threads: int | None = None  # gRPC handler threads; None: max_in_flight + REFUSAL_THREADS
    # how requests are served: deadlines, in-flight bound, ledger, pricing, routing
    service: RouterServiceConfig = field(default_factory=RouterServiceConfig)
    http_port: int | None = None  # OpenAI-compatible HTTP API; 0: any free port; None: off
    http_host: str = defaults.LOOPBACK  # public like ``host``
    # drift retraining on the workers' quality scores (argus.router.drift); None: off
    drift: DriftSettings | None = None
    # the workers' prompt encoder (their --encoder-dir), loaded when service.routing.cache_aware
    # to look prompts up in the mirrored caches; None: all-MiniLM-L6-v2, as the workers'
    cache_encoder: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert, tls_key: give both or neither")
        if not (math.isfinite(self.report_period_s) and self.report_period_s > 0.0):
            raise ValueError(f"report_period_s: must be > 0, got {self.report_period_s}")
        for name in ("port", "metrics_port", "http_port"):
            check_port(getattr(self, name), name)
        check_address(self.allocator, "allocator")

    def security(self) -> ServerSecurity:
        """TLS and token read from their files; OSError names a missing or bad file."""
        from argus.plumbing.grpc_server import read_token, tls_credentials

        credentials = None
        if self.tls_cert is not None and self.tls_key is not None:
            credentials = tls_credentials(self.tls_cert, self.tls_key)
        token = None if self.auth_token_file is None else read_token(self.auth_token_file)
        return ServerSecurity(credentials, token)


def build_drift(
    settings: DriftSettings | None,
    classifiers: ClassifierSet,
    profiles: ProfileSet,
    metrics: RouterMetrics,
    train: Callable[[LabelledPrompts], LevelClassifier] | None = None,
) -> RouterDrift | None:
    """The router's drift monitor on ``classifiers``, retraining with ``train`` (default: the
    logistic backbone on MiniLM); each swap counts in ``argus_router_classifier_retrains``.
    None when ``settings`` is None."""
    if settings is None:
        return None
    if train is None:
        from argus.classifier.drift import logistic_retrain

        train = logistic_retrain()
    return RouterDrift(
        classifiers,
        profiles,
        train,
        settings,
        on_retrain=lambda _strategy, _version: metrics.classifier_retrains.inc(),
    )


def load_cache_encoder(directory: str | None) -> Embedder:
    """The workers' prompt encoder for the cache mirror's lookups: their float32 BERT run as
    ONNX on one thread (the same vectors to float32 rounding, about half torch's time per
    prompt here), or with torch where it cannot be exported."""
    from argus.embedding import PromptEmbedder

    try:
        encoder = PromptEmbedder(directory, runtime="onnx", threads=1)
    except (ImportError, RuntimeError) as err:
        log.warning("cache encoder: ONNX unavailable (%s), running it with torch", err)
        encoder = PromptEmbedder(directory)
    log.info(
        "cache-aware routing: prompts embedded by %s (%s, vectors %s, sent to the workers)",
        encoder.model_dir,
        encoder.runtime,
        encoder.vectors_id,
    )
    return encoder


def serve(settings: RouterSettings, *, ready: threading.Event | None = None) -> int:
    """Run the router until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound,
    and ``http on http(s)://HOST:PORT/v1`` when the HTTP API is on. A taken HTTP port raises
    OSError naming it before anything starts serving."""
    from argus.classifier.serving import (
        classifier_key,
        default_classifier_dir,
        load_prompt_classifier,
    )
    from argus.contracts.allocator_client import PlanWatcher
    from argus.plumbing.grpc_server import reconnect_options, start_metrics, wait_for_shutdown
    from argus.plumbing.internal_tls import InternalTLS, channel
    from argus.profiles import default_profiles, load_profiles
    from argus.router.worker_calls import GrpcWorkers, WorkerChannels

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    profiles = load_profiles(settings.profile) if settings.profile else default_profiles()
    config = settings.service
    security = settings.security()
    tls = None
    if settings.internal_tls_dir is not None:
        tls = InternalTLS.load(settings.internal_tls_dir, "router")
    classifier = load_prompt_classifier(settings.classifier)
    # torch, transformers and the encoder leave ~400k objects that never die; out of the
    # collector's reach, a full collection no longer stops the process for ~0.3 s
    gc.collect()
    gc.freeze()
    key = classifier_key(settings.classifier)
    log.info("classifier %s (%s)", key, settings.classifier or default_classifier_dir())
    metrics = RouterMetrics(profiles)
    channels = WorkerChannels(lambda address: channel(address, tls, reconnect_options()))
    drift = build_drift(settings.drift, classifier.classifiers, profiles, metrics)
    workers = GrpcWorkers(channels)
    embedder, rules = None, None
    if config.routing.cache_aware:
        from argus.profiles import load_cache_rules

        embedder = load_cache_encoder(settings.cache_encoder)
        rules = load_cache_rules(settings.profile or "default")
    core = RouterCore(
        profiles,
        classifier,
        config,
        workers=workers,
        stats=PrometheusStats(metrics),
        drift=drift,
        embedder=embedder,
        cache_rules=rules,
    )
    server, port, servicer = create_server(
        core,
        f"{settings.host}:{settings.port}",
        threads=settings.threads,
        security=security,
    )
    http = None
    if settings.http_port is not None:
        from argus.router.http_app import create_app
        from argus.router.http_server import HttpServer

        app = create_app(core, token=security.token)
        public_tls = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            public_tls = (settings.tls_cert, settings.tls_key)  # HTTPS: the gRPC endpoint's pair
        http = HttpServer(app, settings.http_host, settings.http_port, tls=public_tls)
    if settings.metrics_port is not None:
        start_metrics(settings.metrics_host, settings.metrics_port)
    watcher = PlanWatcher(
        settings.allocator,
        on_plan=servicer.plan_installed,
        watcher_id=config.router_id,
        tls=tls,
    )
    client = AllocatorClient(settings.allocator, tls=tls)
    reporter = StatsReporter(
        core,
        client,
        time.monotonic,
        period_s=settings.report_period_s,
        classifier_key=key,
        drift=drift,
    )
    server.start()
    watcher.start()
    reporter.start()
    print(f"argus router listening on {settings.host}:{port}", flush=True)
    try:
        if http is not None:
            http.start()
            print(f"argus router http on {http.base_url}", flush=True)
        wait_for_shutdown(ready)
    finally:
        if http is not None:
            http.stop()
        reporter.stop()
        watcher.stop()
        server.stop(grace=2).wait()
        client.close()
        core.close()
        classifier.close()
    return 0
