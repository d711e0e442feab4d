"""The ControlNet service (``argus.v1.ControlNet``): gRPC in front of a local executor.

The servicer converts messages (the contract :mod:`argus.contracts.controlnet`, the tensor
codec :mod:`.transport`) and maps errors to status codes; the work, validation included, is
:class:`~argus.worker.adapters.controlnet.executor.LocalControlNetExecutor`'s, the same code a
worker
runs when it keeps its ControlNets in process.

``Run`` is one request's stream: an ``open``, then one ``step`` per denoising step, each
answered in order. A step is computed on the stream's gRPC thread, so the number of requests
the service computes at once is bounded by its thread pool and by ``max_sessions`` (a full
service answers ``RESOURCE_EXHAUSTED`` at open, and the worker can go to another replica).

Errors end the stream with a status and leave the service serving:

* unknown ControlNet → ``NOT_FOUND`` naming it;
* wrong base family, bad PNG, malformed or mis-shaped tensor, missing field, a message out of
  order, bytes that are not a message → ``INVALID_ARGUMENT``, the details starting with the
  field;
* too many sessions → ``RESOURCE_EXHAUSTED``; a ControlNet that fails to load → ``INTERNAL``.

Health (``grpc.health.v1``) is answered by the thread pool, never behind a ControlNet; the
process reports ``SERVING`` once its preloads (if any) are resident.

With ``tls`` the service takes only workers of the cluster (mutual TLS, then the role check of
:data:`argus.plumbing.internal_tls.POLICY`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health

from argus.contracts.controlnet import opened_to_pb, stats_to_pb
from argus.plumbing import rpc
from argus.plumbing.grpc_server import (
    InvalidMessageError,
    add_health_and_reflection,
    bind,
    new_server,
    set_serving,
)
from argus.plumbing.internal_tls import InternalTLS, server_security
from argus.worker.adapters.controlnet.errors import (
    ControlNetBusyError,
    ControlNetError,
    ControlNetUnavailableError,
    InvalidControlNetRequest,
    UnknownControlNetError,
)
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor, LocalSession
from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
from argus.worker.adapters.controlnet.transport import open_from_pb, residuals_to_pb, step_from_pb

controlnet_pb2: Any = rpc.load("controlnet_pb2")
controlnet_pb2_grpc: Any = rpc.load("controlnet_pb2_grpc")

SERVICE_NAME = "argus.v1.ControlNet"
# an SDXL step at 1024 px returns ~108 MiB of fp16 residuals (Katz §5); leave room for 2x
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a failed stream ends with."""
    if isinstance(err, UnknownControlNetError):
        return grpc.StatusCode.NOT_FOUND, str(err)
    if isinstance(err, (InvalidControlNetRequest, InvalidMessageError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, ControlNetBusyError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, ControlNetUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    if isinstance(err, ControlNetError):
        return grpc.StatusCode.INTERNAL, str(err)
    return grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"


class ControlNetServicer(controlnet_pb2_grpc.ControlNetServicer):  # type: ignore[misc]
    def __init__(
        self,
        executor: LocalControlNetExecutor,
        health_servicer: health.HealthServicer,
        metrics: ControlNetMetrics | None = None,
    ) -> None:
        self.executor = executor
        self.health = health_servicer
        self.metrics = metrics

    def Run(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        began = time.perf_counter()
        session: LocalSession | None = None
        code = grpc.StatusCode.OK
        try:
            session = self._open(request_iterator)
            yield opened_to_pb(session.info)
            for message in request_iterator:
                if message.WhichOneof("kind") != "step":
                    raise InvalidControlNetRequest("open", "sent twice: a session opens once")
                step, sample, timestep = step_from_pb(message.step)
                started = time.perf_counter()
                residuals = session.compute(sample, timestep)
                compute_s = time.perf_counter() - started
                if self.metrics is not None:
                    self.metrics.observe_step(compute_s)
                yield residuals_to_pb(step, residuals, compute_s)
        except GeneratorExit:  # the client went away mid-stream
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as err:  # every failure becomes a status; the service keeps serving
            code, details = status_of(err)
            if not context.is_active():
                code = grpc.StatusCode.CANCELLED
            context.abort(code, details)
        finally:
            if session is not None:
                session.close()
            if self.metrics is not None:
                self.metrics.observe_session(code.name, time.perf_counter() - began)

    def _open(self, request_iterator: Iterator[Any]) -> LocalSession:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidControlNetRequest(
                "open", "missing: the first message must open the session"
            )
        return self.executor.open(open_from_pb(first.open))

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return stats_to_pb(self.executor.stats())

    def set_serving(self, serving: bool) -> None:
        set_serving(self.health, SERVICE_NAME, serving)


def create_server(
    executor: LocalControlNetExecutor,
    address: str = "127.0.0.1:0",
    *,
    threads: int = 16,
    metrics: ControlNetMetrics | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    serving: bool = True,
    tls: InternalTLS | None = None,
) -> tuple[grpc.Server, int, ControlNetServicer]:
    """A gRPC server (not started) bound to ``address``; returns it with the bound port.
    ``tls``: mutual TLS and the role check; None serves plaintext to anyone."""
    credentials, interceptors = server_security(tls)
    server = new_server(
        threads=threads,
        thread_prefix="grpc-controlnet",
        max_receive_bytes=max_message_bytes,
        max_send_bytes=max_message_bytes,
        interceptors=interceptors,
    )
    health_servicer = health.HealthServicer()
    servicer = ControlNetServicer(executor, health_servicer, metrics)
    controlnet_pb2_grpc.add_ControlNetServicer_to_server(servicer, server)
    add_health_and_reflection(server, health_servicer, [SERVICE_NAME])
    port = bind(server, address, credentials)
    servicer.set_serving(serving)
    return server, port, servicer
