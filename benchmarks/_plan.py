"""A plan for a set of stub workers, made by a real allocator (what the router benchmarks
install in a router they build in-process)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from argus.types import ProfileSet


def allocator_plan(profiles: Any, workers: list[tuple[str, str]], epoch: str) -> Any:
    """The plan an allocator publishes once ``workers`` ((id, address) pairs, all of the
    profile's first GPU class) have each sent a heartbeat."""
    from argus.allocator.control import ControlConfig
    from argus.allocator.service import create_server as create_allocator
    from argus.contracts.allocator_client import AllocatorClient
    from argus.contracts.workers import WorkerReport

    server, port, allocator = create_allocator(
        profiles, "127.0.0.1:0", config=ControlConfig(), clock=lambda: 0.0, epoch=epoch
    )
    server.start()
    client = AllocatorClient(f"127.0.0.1:{port}")
    try:
        for worker_id, address in workers:
            client.heartbeat(WorkerReport(worker_id, address, profiles.worker_classes[0]))
        return client.get_plan()
    finally:
        client.close()
        allocator.close()
        server.stop(grace=None)


def serve_router(core: Any, threads: int) -> tuple[int, Callable[[], None]]:
    """Start a router server on ``core`` with the report drain ``StatsReporter`` would do
    each second (without the RPC); returns its port and a function that stops both."""
    from argus.router.app import create_server

    router, port, _ = create_server(core, threads=threads)
    router.start()
    draining = threading.Event()

    def drain() -> None:
        while not draining.wait(1.0):
            core.take_report()

    threading.Thread(target=drain, name="bench-drain", daemon=True).start()

    def stop() -> None:
        draining.set()
        router.stop(grace=None)

    return port, stop


def scaled_profiles(time_scale: float) -> ProfileSet:
    """The default profile with every latency × ``time_scale`` (and throughput ÷ it)."""
    from argus.profiles import default_profiles

    profiles = default_profiles()
    table = {
        key: replace(
            p, latency_s=p.latency_s * time_scale, throughput_qpm=p.throughput_qpm / time_scale
        )
        for key, p in profiles.table.items()
    }
    return replace(profiles, table=table, source=f"default × {time_scale:g}")
