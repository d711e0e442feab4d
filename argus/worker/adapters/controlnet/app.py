"""Assemble the ControlNet service process from its settings: catalog, cache, gRPC server.

:class:`ControlNetSettings` is the service's one config type; every ``argus controlnet`` flag
maps to one field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from argus.plumbing.grpc_server import check_port, shutdown_signals
from argus.worker.adapters.controlnet.cache import Policy
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
from argus.worker.adapters.controlnet.models import ControlNetCatalog

SPARE_THREADS = 4


@dataclass(frozen=True)
class ControlNetSettings:
    catalog: str = "tiny"  # "tiny", or a directory ROOT/<family>/<name>/ of diffusers ControlNets
    base_family: str | None = None  # serve only this family's ControlNets; None: every family
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, printed at start
    device: str = "auto"
    dtype: str = "auto"
    policy: str = "lru"  # cache eviction: lru or lfu
    cache_size: int | None = 8  # ControlNets kept resident (Katz §3.1: the top 5–8 suffice)
    cache_bytes: int | None = None  # or a byte budget for them
    preload: tuple[str, ...] = ()  # "family/name" or "name" (with base_family) to load at start
    max_sessions: int = 64  # requests in flight; more get RESOURCE_EXHAUSTED
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None: off
    internal_tls_dir: str | None = None  # ca.crt, controlnet.crt/.key; None: plaintext

    def __post_init__(self) -> None:
        check_port(self.port, "port")
        check_port(self.metrics_port, "metrics_port")
        for name in ("cache_size", "cache_bytes", "max_sessions"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")


def build_executor(settings: ControlNetSettings) -> LocalControlNetExecutor:
    """The executor the service runs: the catalog (restricted to one family if asked), cache."""
    from argus.worker.models.registry import resolve_device, resolve_dtype

    catalog = ControlNetCatalog.from_source(settings.catalog)
    if settings.base_family is not None:
        catalog = catalog.restrict(settings.base_family)
    device = resolve_device(settings.device)
    return LocalControlNetExecutor(
        catalog,
        device=device,
        dtype=resolve_dtype(settings.dtype, device),
        policy=Policy.parse(settings.policy),
        max_models=settings.cache_size,
        max_bytes=settings.cache_bytes,
        max_sessions=settings.max_sessions,
    )


def preload_keys(settings: ControlNetSettings, catalog: ControlNetCatalog) -> list[str]:
    """Cache keys of the ``preload`` names; unknown names fail the start, quoting them."""
    keys = []
    for item in settings.preload:
        family, sep, name = item.rpartition("/")
        if not sep:
            families = catalog.families()
            if len(families) != 1:
                raise ValueError(f"preload {item!r}: write family/name, the catalog has several")
            family = families[0]
        keys.append(catalog.resolve(name, family, field=f"preload {item!r}").key)
    return keys


def serve(settings: ControlNetSettings, *, ready: threading.Event | None = None) -> int:
    """Run the service until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound."""
    from argus.plumbing.grpc_server import start_metrics
    from argus.plumbing.internal_tls import InternalTLS
    from argus.worker.adapters.controlnet.service import create_server

    tls = None
    if settings.internal_tls_dir is not None:
        tls = InternalTLS.load(settings.internal_tls_dir, "controlnet")
    executor = build_executor(settings)
    keys = preload_keys(settings, executor.catalog)
    metrics = ControlNetMetrics(executor.stats)
    server, port, servicer = create_server(
        executor,
        f"{settings.host}:{settings.port}",
        # an open session holds a gRPC thread; the spare ones keep health checks, Stats and
        # the refusals of a full service answered while every session is busy
        threads=settings.max_sessions + SPARE_THREADS,
        metrics=metrics,
        serving=not keys,
        tls=tls,
    )
    if settings.metrics_port is not None:
        start_metrics(settings.host, settings.metrics_port)
    server.start()
    print(f"argus controlnet listening on {settings.host}:{port}", flush=True)
    try:
        with shutdown_signals() as stop:  # the default handlers are back for the shutdown
            for key in keys:  # NOT_SERVING until the popular ones are resident
                executor.cache.acquire(key).release()
            servicer.set_serving(True)
            if ready is not None:
                ready.set()
            stop.wait()
    finally:
        servicer.set_serving(False)
        server.stop(grace=5).wait()
        executor.close()
    return 0
