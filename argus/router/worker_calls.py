"""The router's calls to workers over gRPC: :class:`GrpcWorkers`, the core's
:class:`~argus.router.core.WorkerTransport`.

It keeps one channel per worker address (:class:`WorkerChannels`), each with the worker's
health ``Watch`` stream held open (see there), converts the core's
:class:`~argus.contracts.generate.GenerateCall` to a ``GenerateRequest`` and the worker's answer
and progress back (:mod:`argus.contracts.generate`), passes the call's cancel on to the gRPC call,
turns a failed call's status into a :class:`~argus.router.core.WorkerError`, and refuses an
image of another size than the call asked for (:func:`check_reply_size`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from argus.contracts import generate
from argus.contracts.generate import GenerateCall, GenerateResult
from argus.contracts.progress import ProgressSink
from argus.plumbing import rpc
from argus.plumbing.grpc_server import reconnect_options
from argus.router import convert
from argus.router.core import CallCancel, WorkerError
from argus.router.values import Refusal

worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

log = logging.getLogger(__name__)


def _worker_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=reconnect_options())


class _Worker:
    """A worker address's channel, its stub and its health watch."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.stub = worker_pb2_grpc.WorkerStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.watch: Any = None  # the open Watch call (a future and an iterator), or None
        self.watch_at = -math.inf  # when it was last opened
        self.watchable = True  # False once the worker answered UNIMPLEMENTED


class WorkerChannels:
    """One gRPC channel per worker address, reused across requests.

    A channel dropped from the plan is closed only ``grace_s`` later: closing a gRPC channel
    cancels the calls on it, and a worker that left a plan (or was restarted at the same
    address and rejoins) may still be serving requests the router sent it, which would
    otherwise fail as CANCELLED although nobody cancelled them.

    On each channel the worker's ``grpc.health.v1.Health/Watch`` stream is held open (nobody
    reads it). Python gRPC completes a channel's calls on a thread that runs while the channel
    has a call in flight and exits when it has none; at a few requests a second each
    ``Generate`` found the channel idle, so its client call started a thread and waited for it
    to run, which the router paid in CPU and latency (benchmarks/bench_router.py with
    ``--classifier stub``). The open stream keeps that thread for the channel's life. A watch
    that ends (the worker restarted, the connection dropped) is opened again on the channel's
    next use, at most once every ``rewatch_s``; a worker without the health service
    (UNIMPLEMENTED) is not asked again.
    """

    def __init__(
        self,
        factory: Callable[[str], grpc.Channel] | None = None,
        *,
        grace_s: float = 120.0,
        rewatch_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory or _worker_channel
        self._grace_s = grace_s
        self._rewatch_s = rewatch_s
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._retired: list[tuple[float, grpc.Channel]] = []  # (close at, channel)

    def stub(self, address: str) -> Any:
        with self._lock:
            worker = self._workers.get(address)
            if worker is None:
                worker = self._workers[address] = _Worker(self._factory(address))
            self._keep_watching(address, worker)
            return worker.stub

    def _keep_watching(self, address: str, worker: _Worker) -> None:
        """Open ``worker``'s health watch when it has none running (under the lock)."""
        watch = worker.watch
        if watch is not None and not watch.done():
            return
        if watch is not None and watch.code() is grpc.StatusCode.UNIMPLEMENTED:
            log.info("worker at %s serves no health service: its channel is not watched", address)
            worker.watchable, worker.watch = False, None
        if not worker.watchable:
            return
        now = self._clock()
        if now - worker.watch_at < self._rewatch_s:
            return
        worker.watch_at = now
        worker.watch = worker.health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))

    def keep_only(self, addresses: set[str]) -> None:
        """Retire the channels of addresses not in ``addresses``; close retired channels
        whose grace has passed."""
        now = self._clock()
        with self._lock:
            gone = [a for a in self._workers if a not in addresses]
            self._retired += [(now + self._grace_s, self._workers.pop(a).channel) for a in gone]
            due = [channel for at, channel in self._retired if at <= now]
            self._retired = [(at, channel) for at, channel in self._retired if at > now]
        for channel in due:
            channel.close()

    def close(self) -> None:
        """Close every channel now (the router is stopping); their watches end with them."""
        with self._lock:
            channels = [worker.channel for worker in self._workers.values()]
            channels += [channel for _, channel in self._retired]
            self._workers.clear()
            self._retired.clear()
        for channel in channels:
            channel.close()


class GrpcWorkers:
    """Calls workers' ``Generate`` (``GenerateStream`` when progress is wanted) on
    ``channels`` (default: plaintext channels)."""

    def __init__(self, channels: WorkerChannels | None = None) -> None:
        self.channels = channels or WorkerChannels()

    def generate(
        self,
        address: str,
        call: GenerateCall,
        *,
        timeout_s: float,
        cancel: CallCancel,
        progress: ProgressSink | None,
    ) -> GenerateResult:
        message = generate.call_to_pb(call)
        stub = self.channels.stub(address)
        try:
            if progress is None:
                future = stub.Generate.future(message, timeout=timeout_s)
                cancel.attach(future.cancel)
                reply = future.result()
            else:
                events = stub.GenerateStream(message, timeout=timeout_s)
                cancel.attach(events.cancel)
                reply = _stream_reply(events, progress)
        except grpc.RpcError as err:
            raise WorkerError(convert.refusal_of(err.code()), err.details() or "") from None
        except grpc.FutureCancelledError:
            raise WorkerError(Refusal.CANCELLED, "the client cancelled the request") from None
        finally:
            cancel.attach(None)
        answer = generate.result_from_pb(reply)
        check_reply_size(call, answer, address)
        return answer

    def keep_only(self, addresses: set[str]) -> None:
        self.channels.keep_only(addresses)

    def close(self) -> None:
        self.channels.close()


def _stream_reply(events: Any, progress: ProgressSink) -> Any:
    """The worker's response at the end of its GenerateStream, its progress passed on."""
    for event in events:
        if event.WhichOneof("event") == "response":
            return event.response
        progress(generate.progress_from_pb(event.progress))
    raise WorkerError(Refusal.FAILED, "its stream ended without an image")


def check_reply_size(call: GenerateCall, reply: GenerateResult, address: str) -> None:
    """WorkerError (FAILED) when the worker's PNG is not the width × height the call asked
    for: a faulty or rogue worker's bytes are not passed on. A size the call left to the
    worker's default is not checked."""
    asked = (call.width, call.height)
    if asked == (None, None):
        return
    png = reply.png
    got: tuple[int, int] | None = None  # PNG: signature, then IHDR's big-endian width, height
    if png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and len(png) >= 24:
        got = (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big"))
    if got is None or any(a not in (None, g) for a, g in zip(asked, got, strict=True)):
        shown = "x".join("*" if v is None else str(v) for v in asked)
        found = "no PNG" if got is None else f"{got[0]}x{got[1]}"
        log.warning("worker at %s returned %s for a %s request", address, found, shown)
        raise WorkerError(
            Refusal.FAILED, f"returned {found}, not the {shown} image asked for; refused"
        )
