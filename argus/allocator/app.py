"""Assemble the allocator process from its settings: profile, control, gRPC server, loop.

:class:`AllocatorSettings` is the allocator's one config type; every ``argus allocator`` flag
(and, later, every Helm value) maps to one field.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from argus.allocator.control import ControlConfig, ControlLoop
from argus.allocator.strategy import StrategyConfig
from argus.grpc_server import wait_for_shutdown
from argus.profiles import default_profiles, load_profiles


@dataclass(frozen=True)
class AllocatorSettings:
    host: str = "127.0.0.1"  # internal endpoint: loopback unless told otherwise
    port: int = 0  # 0: any free port, printed at start
    profile: str | None = None  # a profile file; None: the embedded default
    period_s: float = 60.0  # re-plan at least this often (the paper: every minute)
    heartbeat_s: float = 1.0  # workers' heartbeat interval; 3 missed ones mean dead
    max_workers: int = 1024
    max_watchers: int = 64  # open WatchPlan streams (each holds a server thread)
    retrieval_threshold_s: float = 0.5  # retrieval p99 above this forces SM
    retrieval_window_s: float = 30.0  # ... over this window; healthy probes this long: AC
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None: off

    def control_config(self) -> ControlConfig:
        """The control's config; ValueError names a bad field."""
        return ControlConfig(
            period_s=self.period_s,
            heartbeat_s=self.heartbeat_s,
            max_workers=self.max_workers,
            retrieval=StrategyConfig(
                threshold_s=self.retrieval_threshold_s, window_s=self.retrieval_window_s
            ),
        )


def tick_interval_s(heartbeat_s: float) -> float:
    """How often the loop looks for dead workers and due plans: four times per heartbeat
    interval, so a dead worker is dropped within 3¼ intervals of its last heartbeat."""
    return min(1.0, max(0.01, heartbeat_s / 4))


def serve(settings: AllocatorSettings, *, ready: threading.Event | None = None) -> int:
    """Run the allocator until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound."""
    from argus.allocator.metrics import AllocatorMetrics
    from argus.allocator.service import create_server

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    profiles = load_profiles(settings.profile) if settings.profile else default_profiles()
    config = settings.control_config()
    metrics = AllocatorMetrics(profiles)
    server, port, servicer = create_server(
        profiles,
        f"{settings.host}:{settings.port}",
        config=config,
        max_watchers=settings.max_watchers,
        metrics=metrics,
    )
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host)
    loop = ControlLoop(servicer.control, tick_interval_s(config.heartbeat_s))
    server.start()
    loop.start()
    print(f"argus allocator listening on {settings.host}:{port}", flush=True)
    try:
        wait_for_shutdown(ready)
    finally:
        loop.stop()
        servicer.close()  # NOT_SERVING, and every watch stream ends
        server.stop(grace=2).wait()
    return 0
