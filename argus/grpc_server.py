"""What every Argus gRPC server has: a bounded thread pool, message size limits, standard health
checking, server reflection, a bind that fails loudly, and a clean stop on SIGINT/SIGTERM.

The worker and the ControlNet service build on these (the router and allocator will too), so
a probe, ``grpcurl`` or a Kubernetes gRPC health check sees the same things on each.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def new_server(
    *, threads: int, thread_prefix: str, max_receive_bytes: int, max_send_bytes: int
) -> grpc.Server:
    """A server (not started) on a pool of ``threads`` threads with the given message limits."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
        options=[
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
        ],
    )


def add_health_and_reflection(
    server: grpc.Server, health_servicer: health.HealthServicer, services: Sequence[str]
) -> None:
    """Serve ``grpc.health.v1`` and reflection for ``services`` (full names) on ``server``."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)


def set_serving(health_servicer: health.HealthServicer, service: str, serving: bool) -> None:
    """Report ``service`` (and the server as a whole, name "") SERVING or NOT_SERVING."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", service):
        health_servicer.set(name, status)


def bind(server: grpc.Server, address: str) -> int:
    """Bind ``address`` without TLS; returns the port (useful with port 0), OSError if it fails."""
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return int(port)


@contextlib.contextmanager
def shutdown_signals() -> Iterator[threading.Event]:
    """For the block, SIGINT and SIGTERM set the yielded event (a service waits on it, then
    shuts down in order); the previous handlers come back afterwards."""
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
