"""The router process's parts around :class:`~argus.router.service.RouterCore`: the gRPC
server (``create_server``) and the periodic statistics report to the allocator
(:class:`StatsReporter`, whose ``report_once`` tests call directly with a fake clock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

from argus.allocator.client import AllocatorClient
from argus.grpc_server import add_health_and_reflection, bind, new_server, set_serving
from argus.router.service import SERVICE_NAME, RouterCore, RouterServicer, router_pb2_grpc
from argus.types import Strategy

log = logging.getLogger(__name__)


def create_server(
    core: RouterCore, address: str = "127.0.0.1:0", *, threads: int = 32
) -> tuple[grpc.Server, int, RouterServicer]:
    """A not-yet-started server bound to ``address``; returns it with the bound port."""
    server = new_server(
        threads=threads,
        thread_prefix="router",
        max_receive_bytes=8 * 1024 * 1024,
        max_send_bytes=64 * 1024 * 1024,
    )
    health_servicer = health.HealthServicer()
    servicer = RouterServicer(core)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    add_health_and_reflection(server, health_servicer, [SERVICE_NAME])
    port = bind(server, address)
    set_serving(health_servicer, SERVICE_NAME, True)
    return server, port, servicer


class StatsReporter:
    """Sends the router's arrivals and classified levels to the allocator every period."""

    def __init__(
        self,
        core: RouterCore,
        client: AllocatorClient,
        clock: Callable[[], float],
        *,
        period_s: float = 1.0,
    ) -> None:
        self.core = core
        self.client = client
        self._clock = clock
        self.period_s = period_s
        self._sequence = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-report", daemon=True)

    def report_once(self) -> None:
        """Send what happened since the last report. Lost on failure (the load is sampled)."""
        arrivals, classified, wants = self.core.take_statistics()
        now = self._clock()
        by_strategy: dict[Strategy, list[str]] = {}
        for item in classified:
            for strategy, index in item.levels.items():
                names = self.core.profiles.levels_for(strategy)
                by_strategy.setdefault(strategy, []).append(names[index].name)
        self._sequence += 1
        self.client.report(
            self.core.config.router_id,
            sequence=self._sequence,
            arrival_ages_s=[max(0.0, now - t) for t in arrivals],
            classified=by_strategy,
            replan_wanted=wants,
        )

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
