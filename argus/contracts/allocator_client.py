"""Clients of the allocator service, for the processes that talk to it: routers and workers.

They live with the contracts, not in ``argus.allocator``: a router or a worker reaches the
allocator through these and the contract values alone, never through the allocator's package.

* :class:`AllocatorClient`: the unary calls with typed values in and out: a worker's
  ``heartbeat``, a router's ``report``, ``get_plan``.
* :class:`PlanWatcher`: a router's view of the plan. A daemon thread keeps a ``WatchPlan``
  stream open, hands every newer plan to ``on_plan`` (a
  :class:`~argus.contracts.plans.PublishedPlan`, whose ``plan`` and ``worker_classes()``
  go straight into ``PlanRouter.install``) and reconnects with exponential backoff whenever
  the stream ends: the allocator restarted, moved or is not up yet. Plans are ordered by
  (epoch, version): any plan of a new epoch (a restarted allocator) replaces the old one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from argus.contracts.plans import PublishedPlan, plan_from_pb
from argus.contracts.routers import (
    RouterAnswer,
    RouterReport,
    router_answer_from_pb,
    router_report_to_pb,
)
from argus.contracts.wire import FieldError
from argus.contracts.workers import (
    HeartbeatAnswer,
    WorkerReport,
    heartbeat_answer_from_pb,
    heartbeat_to_pb,
)
from argus.plumbing import rpc
from argus.plumbing.grpc_server import reconnect_options
from argus.plumbing.internal_tls import InternalTLS, channel
from argus.types import ProfileSet

allocator_pb2: Any = rpc.load("allocator_pb2")
allocator_pb2_grpc: Any = rpc.load("allocator_pb2_grpc")

log = logging.getLogger(__name__)


class AllocatorClient:
    """Unary calls to one allocator (mutual TLS with ``tls``, plaintext with None); errors are
    ``grpc.RpcError`` with the service's codes."""

    def __init__(
        self, address: str, *, timeout_s: float = 5.0, tls: InternalTLS | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, tls, reconnect_options())
        self._stub = allocator_pb2_grpc.AllocatorStub(self._channel)

    def heartbeat(self, report: WorkerReport) -> HeartbeatAnswer:
        """Send a worker's heartbeat; the answer carries its assigned level."""
        reply = self._stub.Heartbeat(heartbeat_to_pb(report), timeout=self.timeout_s)
        return heartbeat_answer_from_pb(reply)

    def report(self, report: RouterReport, profiles: ProfileSet) -> RouterAnswer:
        """Send a router's statistics since its last report; its class indices are level
        indices of ``profiles`` (the router's profile), sent as the levels' names."""
        request = router_report_to_pb(report, profiles)
        return router_answer_from_pb(self._stub.ReportRouter(request, timeout=self.timeout_s))

    def get_plan(self) -> PublishedPlan:
        reply = self._stub.GetPlan(allocator_pb2.GetPlanRequest(), timeout=self.timeout_s)
        return plan_from_pb(reply)

    def close(self) -> None:
        self._channel.close()


class PlanWatcher:
    """Follows the allocator's plans in a daemon thread; ``start`` it, ``stop`` it."""

    def __init__(
        self,
        address: str,
        on_plan: Callable[[PublishedPlan], None] | None = None,
        *,
        watcher_id: str = "",
        tls: InternalTLS | None = None,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        if not 0.0 < min_backoff_s <= max_backoff_s:
            raise ValueError(
                f"backoff: need 0 < min_backoff_s <= max_backoff_s, got {min_backoff_s}, "
                f"{max_backoff_s}"
            )
        self.address = address
        self.watcher_id = watcher_id
        self._tls = tls
        self._on_plan = on_plan
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._latest: PublishedPlan | None = None
        self._call: Any = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plan-watcher", daemon=True)

    @property
    def latest(self) -> PublishedPlan | None:
        """The newest plan received, or None before the first."""
        with self._cond:
            return self._latest

    def wait_for(
        self, predicate: Callable[[PublishedPlan], bool], timeout_s: float
    ) -> PublishedPlan | None:
        """Wait until the latest plan satisfies ``predicate``; None if it did not in time."""
        with self._cond:
            found = self._cond.wait_for(
                lambda: self._latest is not None and predicate(self._latest), timeout_s
            )
            return self._latest if found else None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel the stream and end the thread."""
        self._stopping.set()
        with self._cond:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay = self._min_backoff_s
        request = allocator_pb2.WatchPlanRequest(watcher_id=self.watcher_id)
        with channel(self.address, self._tls, reconnect_options()) as plan_channel:
            stub = allocator_pb2_grpc.AllocatorStub(plan_channel)
            while not self._stopping.is_set():
                call = stub.WatchPlan(request)
                with self._cond:
                    self._call = call
                if self._stopping.is_set():  # stop() may have missed this call
                    call.cancel()
                try:
                    for update in call:
                        delay = self._min_backoff_s  # connected: start the backoff over
                        self._offer(update)
                except grpc.RpcError as err:
                    if not self._stopping.is_set():
                        log.info("plan stream from %s ended: %s", self.address, err.code())
                self._stopping.wait(delay)
                delay = min(2 * delay, self._max_backoff_s)

    def _offer(self, update: Any) -> None:
        """Keep ``update`` if it is newer than the latest plan, and hand it on."""
        try:
            published = plan_from_pb(update)
        except FieldError as err:  # keep following the last good plan
            log.error("plan update refused: %s", err)
            return
        with self._cond:
            last = self._latest
            stale = last is not None and last.epoch == published.epoch
            if stale and last is not None and published.version <= last.version:
                return
            self._latest = published
            self._cond.notify_all()
        if self._on_plan is not None:
            try:
                self._on_plan(published)
            except Exception:
                log.exception("on_plan failed for plan %d", published.version)
