"""The worker's client of the ControlNet service: a ``ControlNetExecutor`` over gRPC.

:class:`RemoteControlNetExecutor` holds one channel to a service address for the worker's
lifetime; :meth:`RemoteControlNetExecutor.open` starts one ``Run`` stream per request and
returns a :class:`RemoteSession` once the service has answered ``opened`` (so a bad request
fails at open, with the service's error, before the first step).

A session feeds the stream from a queue (the caller's thread serializes the step's input
and enqueues it) and reads it on a thread of its own, which decodes each step's residuals as
soon as they arrive and resolves that step's future. Replies come in the order of the steps,
so futures are resolved first-in, first-out. In the pipelined asynchronous mode the reply
for step t−1 is therefore received and decoded while step t's UNet runs.

gRPC status codes come back as the same error classes the local executor raises
(:func:`error_from_rpc`), so the worker handles one set of errors for both.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import torch

from argus.contracts.controlnet import ExecutorStats, OpenInfo, opened_from_pb, stats_from_pb
from argus.plumbing import rpc
from argus.plumbing.internal_tls import InternalTLS, channel
from argus.worker.adapters.controlnet.errors import (
    ControlNetBusyError,
    ControlNetError,
    ControlNetUnavailableError,
    InvalidControlNetRequest,
    UnknownControlNetError,
)
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor, SessionSpec
from argus.worker.adapters.controlnet.models import ControlNetCatalog
from argus.worker.adapters.controlnet.service import DEFAULT_MAX_MESSAGE_BYTES
from argus.worker.adapters.controlnet.transport import (
    open_to_pb,
    residuals_from_pb,
    step_to_pb,
)
from argus.worker.adapters.controlnet.unet_split import Residuals

controlnet_pb2: Any = rpc.load("controlnet_pb2")
controlnet_pb2_grpc: Any = rpc.load("controlnet_pb2_grpc")

_ERRORS: dict[grpc.StatusCode, type[ControlNetError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownControlNetError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidControlNetRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ControlNetBusyError,
    grpc.StatusCode.UNAVAILABLE: ControlNetUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ControlNetUnavailableError,
}


def error_from_rpc(err: grpc.RpcError) -> ControlNetError:
    """The error class the local executor would have raised for the same status."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else "") or code.name
    field, sep, message = details.partition(": ")
    if not sep or " " in field:  # the details do not start with a field name
        field, message = "", details
    cls = _ERRORS.get(code, ControlNetError)
    if cls is ControlNetError:
        message = f"{code.name}: {message}"
    return cls(field, message)


class RemoteSession:
    """One request's stream to the service; residuals resolve in the order steps were sent."""

    def __init__(self, stub: Any, spec: SessionSpec, *, timeout_s: float | None) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: deque[Future[Any]] = deque()
        self._lock = threading.Lock()
        self._failure: ControlNetError | None = None
        self._closed = False
        opened: Future[Any] = Future()
        self._pending.append(opened)
        self._requests.put(open_to_pb(spec))
        self._call = stub.Run(self._stream(), timeout=timeout_s)
        self._reader = threading.Thread(target=self._read, name="controlnet-client", daemon=True)
        self._reader.start()
        try:
            self.info: OpenInfo = opened.result()
        except BaseException:
            self.close()
            raise

    def _stream(self) -> Iterator[Any]:
        while True:
            message = self._requests.get()
            if message is None:
                return
            yield message

    def _read(self) -> None:
        error: ControlNetError
        try:
            for reply in self._call:
                with self._lock:
                    future = self._pending.popleft() if self._pending else None
                if future is None:
                    break
                if reply.WhichOneof("kind") == "opened":
                    future.set_result(opened_from_pb(reply.opened))
                else:
                    future.set_result(residuals_from_pb(reply.residuals))
            error = ControlNetUnavailableError("", "the ControlNet service ended the session")
        except grpc.RpcError as err:
            error = error_from_rpc(err)
        except ControlNetError as err:  # a reply the codec refuses
            error = err
            self._call.cancel()
        with self._lock:
            self._failure = error
            pending = list(self._pending)
            self._pending.clear()
        for future in pending:
            future.set_exception(error)

    def submit(self, step: int, sample: torch.Tensor, timestep: torch.Tensor) -> Future[Residuals]:
        """Send one step's input; the future resolves when its residuals have arrived."""
        message = step_to_pb(step, sample, timestep)
        future: Future[Residuals] = Future()
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise ControlNetError("step", "the session is closed")
            self._pending.append(future)
            self._requests.put(message)
        return future

    def close(self) -> None:
        """End the stream; a step still in flight is cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = bool(self._pending)
        self._requests.put(None)
        if in_flight:
            self._call.cancel()


class RemoteControlNetExecutor:
    """Sessions on a ControlNet service at ``address`` (``host:port``)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float | None = 600.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: InternalTLS | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s  # the deadline of one request's whole stream
        self.channel = channel(
            address,
            tls,
            [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self.stub = controlnet_pb2_grpc.ControlNetStub(self.channel)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects; :class:`ControlNetUnavailableError` if it does not."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ControlNetUnavailableError(
                "", f"no ControlNet service at {self.address} after {timeout_s:g} s"
            ) from None

    def open(self, spec: SessionSpec) -> RemoteSession:
        return RemoteSession(self.stub, spec, timeout_s=self.timeout_s)

    def stats(self) -> ExecutorStats:
        try:
            reply = self.stub.Stats(controlnet_pb2.ControlNetStatsRequest(), timeout=30)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return stats_from_pb(reply)

    def close(self) -> None:
        self.channel.close()


def executor_for(
    target: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tls: InternalTLS | None = None,
    **local: Any,
) -> LocalControlNetExecutor | RemoteControlNetExecutor:
    """The executor a worker setting names, built once at worker start.

    ``host:port`` is a ControlNet service (:class:`RemoteControlNetExecutor`); ``local`` runs
    the tiny catalog in process and ``local:DIR`` a catalog directory, on ``device`` in
    ``dtype``, with ``local`` keyword arguments for :class:`LocalControlNetExecutor` (cache
    policy and bounds). ``tls``: the worker's certificate for the service (None: plaintext).
    """
    if target == "local" or target.startswith("local:"):
        source = target.partition(":")[2] or "tiny"
        catalog = ControlNetCatalog.from_source(source)
        return LocalControlNetExecutor(catalog, device=device, dtype=dtype, **local)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ControlNet target {target!r}: expected host:port, local or local:DIR")
    return RemoteControlNetExecutor(target, tls=tls)
