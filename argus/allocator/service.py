"""The allocator's gRPC service (``argus.v1.Allocator``), standard health checking and reflection.

The servicer only converts (:mod:`argus.contracts`) and delegates to
:class:`~argus.allocator.control.AllocatorControl`; errors become status codes and the
service keeps serving:

* a bad field, or bytes that are not the request message → ``INVALID_ARGUMENT`` whose
  details start with the field's path;
* a heartbeat whose ``worker_id`` is not the name in the caller's certificate (a worker
  speaks only for itself, :func:`check_worker_identity`), or a report for a router id that
  another identity first used → ``PERMISSION_DENIED`` naming the field;
* a join beyond ``max_workers``, a watch beyond ``max_watchers`` → ``RESOURCE_EXHAUSTED``;
* a watch while shutting down → ``UNAVAILABLE``; anything else → ``INTERNAL`` with the text.

Plans reach watchers through a :class:`~argus.allocator.feed.LatestFeed` of ready-made
``PlanUpdate`` messages (converted once per plan, not once per watcher). Each open watch
stream holds one thread of the synchronous server, so the pool has ``max_watchers`` threads
plus :data:`SPARE_THREADS` that heartbeats, reports and health checks always find free.

With ``tls`` (:class:`~argus.plumbing.internal_tls.InternalTLS`) the server takes only callers
with a certificate of the cluster, and each method only the roles
:data:`argus.plumbing.internal_tls.POLICY` names: heartbeats from workers, reports from
routers, plans to routers (and operators).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health

from argus.allocator.cache_plan import CachePlanner
from argus.allocator.config import ControlConfig
from argus.allocator.control import AllocatorControl, Clock, PlanListener, PlanStats
from argus.allocator.feed import FeedClosedError, FeedFullError, LatestFeed
from argus.allocator.membership import MembershipFullError, NotOwnerError
from argus.allocator.metrics import AllocatorMetrics
from argus.allocator.paper_eq1 import SolverFactory
from argus.contracts.plans import PublishedPlan, plan_to_pb
from argus.contracts.routers import RouterReport, router_answer_to_pb, router_report_from_pb
from argus.contracts.wire import FieldError
from argus.contracts.workers import heartbeat_answer_to_pb, heartbeat_from_pb
from argus.plumbing import rpc
from argus.plumbing.grpc_server import add_health_and_reflection, bind, new_server, set_serving
from argus.plumbing.internal_tls import Identity, InternalTLS, caller, server_security
from argus.types import ClassQuality, ProfileSet, Strategy

allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")

log = logging.getLogger(__name__)

SERVICE_NAME = "argus.v1.Allocator"
SPARE_THREADS = 8  # beside the watch streams: heartbeats, reports, GetPlan, health
WATCH_POLL_S = 1.0  # a watch stream checks this often whether its client is still there


class AllocatorServicer(allocator_pb2_grpc.AllocatorServicer):  # type: ignore[misc]
    def __init__(
        self,
        control: AllocatorControl,
        feed: LatestFeed[Any],
        health_servicer: health.HealthServicer,
        metrics: AllocatorMetrics | None = None,
    ) -> None:
        self.control = control
        self.feed = feed
        self.health = health_servicer
        self.metrics = metrics

    def ReportRouter(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            report = router_report_from_pb(request, self.control.profiles)
            who = caller(context)
            answer = self.control.report_router(report, "" if who is None else str(who))
        except Exception as err:
            self._fail(context, "ReportRouter", err)
        if report.cache_lookups.levels and not answer.duplicate:
            self._report_cache(report)
        return router_answer_to_pb(answer)

    def _report_cache(self, report: RouterReport) -> None:
        """The router's cache probes to the evidence AC levels are priced with; probes binned
        by other rules than the allocator's (a router on another profile) are dropped with a
        warning, the rest of its report counted."""
        try:
            self.control.report_cache(report.cache_lookups)
        except ValueError as err:
            log.warning("router %s: cache probes dropped: %s", report.router_id, err)

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            report = heartbeat_from_pb(request, self.control.profiles)
            who = caller(context)
            check_worker_identity(report.worker_id, who)
            answer = self.control.heartbeat(report, "" if who is None else str(who))
        except Exception as err:
            self._fail(context, "Heartbeat", err)
        return heartbeat_answer_to_pb(answer)

    def GetPlan(self, request: Any, context: grpc.ServicerContext) -> Any:
        latest = self.feed.latest()
        return plan_to_pb(self.control.current) if latest is None else latest

    def WatchPlan(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The current plan at once, then each newer one, until the client cancels; when the
        allocator shuts down the stream ends with UNAVAILABLE (reconnect to the next one)."""
        try:
            reader = self.feed.reader()
        except Exception as err:
            self._fail(context, "WatchPlan", err)
        context.add_callback(reader.close)  # a cancelled stream frees its thread at once
        try:
            while True:
                update = reader.next(WATCH_POLL_S)
                if update is not None:
                    yield update
                elif not context.is_active():
                    return
        except FeedClosedError:
            if context.is_active():  # shutting down: UNAVAILABLE tells the client to retry
                self._fail(context, "WatchPlan", FeedClosedError())
        finally:
            reader.close()

    def close(self) -> None:
        """Report NOT_SERVING and end every watch stream (before the server stops)."""
        set_serving(self.health, SERVICE_NAME, False)
        self.feed.close()

    def _fail(self, context: grpc.ServicerContext, method: str, err: Exception) -> NoReturn:
        code, details = status_of(err)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
        if self.metrics is not None:
            self.metrics.observe_rejected(method, code.name)
        context.abort(code, details)
        raise AssertionError("context.abort returned")  # pragma: no cover


def check_worker_identity(worker_id: str, who: Identity | None) -> None:
    """A heartbeat (a join, a move, a leave) speaks for the worker whose certificate sent it:
    ``worker_id`` must be the name of the caller's identity (``argus://worker/NAME``, issued
    by ``argus issue-cert --identity worker/NAME``; ``argus up`` and the Helm chart give a
    worker the same name as its ``--worker-id``). Otherwise :class:`NotOwnerError` naming
    ``worker_id``: a stolen worker certificate registers no made-up workers and speaks for no
    other worker. None (a plaintext plane, ``--insecure-internal``) checks nothing."""
    if who is not None and who.name != worker_id:
        raise NotOwnerError(
            f"worker_id: {worker_id!r} is not the caller's own id; the certificate of {who} "
            f"may heartbeat only as {who.name!r}"
        )


def status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details a failed call is answered with."""
    if isinstance(err, FieldError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, NotOwnerError):
        return grpc.StatusCode.PERMISSION_DENIED, str(err)
    if isinstance(err, (MembershipFullError, FeedFullError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, FeedClosedError):
        return grpc.StatusCode.UNAVAILABLE, "the allocator is shutting down"
    return grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"


class _Publisher:
    """The control's plan listener that feeds watchers: one conversion per plan."""

    def __init__(self, feed: LatestFeed[Any]) -> None:
        self.feed = feed

    def __call__(self, published: PublishedPlan, stats: PlanStats) -> None:
        self.feed.publish(plan_to_pb(published))


def create_server(
    profiles: ProfileSet,
    address: str = "127.0.0.1:0",
    *,
    config: ControlConfig | None = None,
    clock: Clock | None = None,
    max_watchers: int = 64,
    metrics: AllocatorMetrics | None = None,
    epoch: str | None = None,
    backend: SolverFactory | None = None,
    class_quality: Mapping[Strategy, ClassQuality] | None = None,
    classifier_key: str = "",
    tls: InternalTLS | None = None,
    cache: CachePlanner | None = None,
) -> tuple[grpc.Server, int, AllocatorServicer]:
    """A not-yet-started server bound to ``address``; returns it, the port and the servicer.

    The control is built here (it makes its first plan at once, with ``class_quality`` and
    ``classifier_key`` as :class:`~argus.allocator.control.AllocatorControl` takes them) and
    reachable as ``servicer.control``; nothing calls its ``tick`` until a
    :class:`~argus.allocator.control.ControlLoop` is started (``argus.allocator.app`` does;
    tests with a fake ``clock`` call ``tick`` themselves). ``tls``: mutual TLS and the role
    check; None serves plaintext to anyone (tests, ``--insecure-internal``). ``cache``: the
    planner that prices AC levels by the routers' cache reports (None: as hits at their K).
    """
    feed: LatestFeed[Any] = LatestFeed(max_watchers)
    listeners: list[PlanListener] = [_Publisher(feed)]
    if metrics is not None:
        listeners.append(metrics.observe_plan)
    control = AllocatorControl(
        profiles,
        config,
        clock=clock,
        listeners=listeners,
        epoch=epoch,
        backend=backend,
        class_quality=class_quality,
        classifier_key=classifier_key,
        cache=cache,
    )
    if metrics is not None:
        metrics.watch(control, lambda: feed.readers)
    credentials, interceptors = server_security(tls)
    server = new_server(
        threads=max_watchers + SPARE_THREADS,
        thread_prefix="allocator-grpc",
        max_receive_bytes=4 * 1024 * 1024,
        max_send_bytes=16 * 1024 * 1024,
        interceptors=interceptors,
    )
    health_servicer = health.HealthServicer()
    servicer = AllocatorServicer(control, feed, health_servicer, metrics)
    allocator_pb2_grpc.add_AllocatorServicer_to_server(servicer, server)
    add_health_and_reflection(server, health_servicer, [SERVICE_NAME])
    port = bind(server, address, credentials)
    set_serving(health_servicer, SERVICE_NAME, True)  # a plan exists from the start
    return server, port, servicer
