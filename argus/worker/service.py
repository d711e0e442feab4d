"""The worker's gRPC service (``argus.v1.Worker``), standard health checking and reflection.

The servicer only converts and delegates: every message converts in a contract,
Generate's in the one both sides share (:mod:`argus.contracts.generate`), Stats' and
Configure's in :mod:`argus.contracts.worker_control`; the servicer maps errors to status
codes, and the work is the engine's:

* :class:`~argus.request_limits.InvalidRequestError` → ``INVALID_ARGUMENT`` naming the field;
* :class:`~argus.worker.engine.QueueFullError` → ``RESOURCE_EXHAUSTED``;
* an unknown variant → ``INVALID_ARGUMENT`` on ``variant``; a load that does not fit →
  ``RESOURCE_EXHAUSTED``;
* :class:`~argus.worker.models.pipelines.Cancelled` → ``DEADLINE_EXCEEDED`` when the call's
  deadline passed (in the queue or during its run) or its decode could not finish before it
  (:class:`~argus.worker.decode_times.DecodeSkipped`, whose details say the predicted and the
  remaining time), ``CANCELLED`` when its client went away;
* no model loaded yet → ``UNAVAILABLE``; anything else → ``INTERNAL`` with the error's type
  (its text, which may hold server paths, is logged, not sent), and the worker keeps serving.

Each Generate call gets a :class:`~argus.worker.models.pipelines.CancelToken` with the call's gRPC
deadline, and ``context.add_callback`` sets it when the call ends early (client cancelled,
deadline), so the engine stops work nobody waits for.

The reply's ``Timing.total_ms`` runs from the moment the handler got the call until its reply
is built (after the scores are attached), so it covers the conversions and the validation as
well as the engine's work; ``queue_ms`` is the engine's wait for the GPU slot alone (see
:mod:`argus.worker.engine`). Serialising and sending the reply happen after and are not in it.

Health (``grpc.health.v1``) says ``NOT_SERVING`` until the worker is ready (``Worker.ready``:
a model is loaded and its warm-up run is done); it is answered by the gRPC thread pool, never
behind the denoising semaphore.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health

from argus.contracts.generate import (
    GenerateResult,
    Progress,
    call_from_pb,
    progress_to_pb,
    result_to_pb,
)
from argus.contracts.worker_control import configure_from_pb, configured_to_pb, stats_to_pb
from argus.plumbing import rpc
from argus.plumbing.grpc_server import add_health_and_reflection, bind, new_server, set_serving
from argus.plumbing.internal_tls import InternalTLS, server_security
from argus.request_limits import InvalidRequestError
from argus.worker.adapters.workflow import adapter_status
from argus.worker.decode_times import DecodeSkipped
from argus.worker.engine import NoModelError, QueueFullError, Worker
from argus.worker.metrics import WorkerMetrics
from argus.worker.models.pipelines import Cancelled, CancelToken
from argus.worker.models.registry import MemoryGuardError, UnknownModelError
from argus.worker.scoring import ScoreSampler

worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

log = logging.getLogger(__name__)

SERVICE_NAME = "argus.v1.Worker"


# an absolute POSIX path: a '/' not preceded by a word character, ':' (URLs), '/' or '.'
_SERVER_PATH = re.compile(r"(?<![\w:/.])/[\w.@+-]+(?:/[\w.@+-]*)*")


def public_details(details: str) -> str:
    """``details`` with every absolute filesystem path replaced by ``<server path>``: a
    status's text goes to the client, which needs the field and the adapter's name, never
    where the server keeps its files (errors name those for the log)."""
    return _SERVER_PATH.sub("<server path>", details)


def status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details a Generate failure is reported with (paths scrubbed)."""
    code, details = _status_of(err)
    return code, public_details(details)


def _status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, DecodeSkipped):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(err)
    if isinstance(err, Cancelled):
        if err.reason == "expired":
            return grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed: {err.steps_done} steps run"
        return grpc.StatusCode.CANCELLED, str(err)
    if isinstance(err, NoModelError):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    adapter = adapter_status(err)
    if adapter is not None:
        return getattr(grpc.StatusCode, adapter[0]), adapter[1]
    # an unexpected error's text can carry server paths (a file that failed to open): the
    # log keeps it, the client gets its type
    log.error("Generate failed", exc_info=err)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); see the worker's log"


def cancel_token(context: grpc.ServicerContext) -> CancelToken:
    """A token with the call's deadline, set when the call ends before the worker answered
    (its client cancelled or went away, or the deadline passed)."""
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    token = CancelToken(deadline)

    def ended() -> None:  # gRPC ends a call at its deadline too, maybe before our clock says so
        left = context.time_remaining()
        token.cancel("expired" if left is not None and left <= 0.0 else "cancelled")

    context.add_callback(ended)
    return token


class WorkerServicer(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    def __init__(
        self,
        worker: Worker,
        health_servicer: health.HealthServicer,
        metrics: WorkerMetrics | None = None,
        scores: ScoreSampler | None = None,
    ) -> None:
        self.worker = worker
        self.health = health_servicer
        self.metrics = metrics
        self.scores = scores  # samples images for the router's drift monitor; None: off

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        arrived = time.perf_counter()
        try:
            result = self.worker.generate(call_from_pb(request), cancel_token(context))
        except Exception as err:  # every failure becomes a status; the worker keeps serving
            self._abort(err, context)
        return self._answer(request.prompt, result, arrived)

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """Generate on a thread of its own, whose progress this call's thread streams out
        (a streaming handler can only yield from the thread gRPC gave it). Each stream is
        one request the worker's bounded queue admitted, so the threads are bounded too."""
        arrived = time.perf_counter()
        call = call_from_pb(request)
        token = cancel_token(context)
        events: queue.SimpleQueue[Progress | GenerateResult | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                events.put(self.worker.generate(call, token, events.put))
            except BaseException as err:  # handed to the call's thread, which answers it
                events.put(err)

        threading.Thread(target=run, name="grpc-stream", daemon=True).start()
        while True:
            event = events.get()
            if isinstance(event, Progress):
                yield worker_pb2.GenerateEvent(progress=progress_to_pb(event))
            elif isinstance(event, GenerateResult):
                reply = self._answer(call.prompt, event, arrived)
                yield worker_pb2.GenerateEvent(response=reply)
                return
            else:
                self._abort(event, context)

    def _answer(self, prompt: str, result: GenerateResult, arrived: float) -> Any:
        """The reply to a served call that reached the handler at ``arrived``; its
        ``total_ms`` is set last, when the reply is ready."""
        if self.scores is not None:  # earlier images' scores ride on this reply
            self.scores.offer(prompt, result.level, result.png, result.request_id)
            result = replace(result, scores=tuple(self.scores.take()))
        reply = result_to_pb(result)
        total_ms = (time.perf_counter() - arrived) * 1e3
        reply.timing.total_ms = total_ms
        if self.metrics is not None:
            self.metrics.observe(replace(result, timing=replace(result.timing, total_ms=total_ms)))
        return reply

    def _abort(self, err: BaseException, context: grpc.ServicerContext) -> NoReturn:
        if not isinstance(err, Exception):
            raise err  # KeyboardInterrupt and the like are not the request's failure
        code, details = status_of(err)
        if self.metrics is not None:
            self.metrics.observe_error(code.name)
            if isinstance(err, Cancelled):
                self.metrics.observe_stopped(err.reason, err.stage)
            if isinstance(err, DecodeSkipped):
                self.metrics.observe_decode_skipped()
        context.abort(code, details)

    def Configure(self, request: Any, context: grpc.ServicerContext) -> Any:
        call = configure_from_pb(request)
        try:
            future = self.worker.configure(
                strategy=call.strategy, level=call.level, variant=call.variant, wait=call.wait
            )
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except UnknownModelError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except MemoryGuardError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except Exception as err:  # a failed load reported through wait
            log.error("variant %s: load failed", call.variant, exc_info=err)
            details = public_details(f"variant: load failed: {err}")
            context.abort(grpc.StatusCode.INTERNAL, details)
        future.add_done_callback(lambda _: self.update_health())
        self.update_health()
        return configured_to_pb(self.worker.stats())

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return stats_to_pb(self.worker.stats())

    def update_health(self) -> None:
        """Report SERVING once the worker is ready (called after loads and the warm-up)."""
        set_serving(self.health, SERVICE_NAME, self.worker.ready)


def create_server(
    worker: Worker,
    address: str = "127.0.0.1:0",
    *,
    threads: int = 16,
    metrics: WorkerMetrics | None = None,
    tls: InternalTLS | None = None,
    scores: ScoreSampler | None = None,
) -> tuple[grpc.Server, int, WorkerServicer]:
    """A started-later gRPC server bound to ``address``; returns it with the bound port.
    ``tls``: mutual TLS, Generate from routers only, Configure from the allocator only (see
    :data:`argus.plumbing.internal_tls.POLICY`); None serves plaintext to anyone."""
    credentials, interceptors = server_security(tls)
    server = new_server(
        threads=threads,
        thread_prefix="grpc",
        max_receive_bytes=8 * 1024 * 1024,
        max_send_bytes=64 * 1024 * 1024,
        interceptors=interceptors,
    )
    health_servicer = health.HealthServicer()
    servicer = WorkerServicer(worker, health_servicer, metrics, scores)
    if metrics is not None:
        metrics.watch_queue(lambda: worker.queue_length)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    add_health_and_reflection(server, health_servicer, [SERVICE_NAME])
    port = bind(server, address, credentials)
    servicer.update_health()
    return server, port, servicer
