"""The router's gRPC servicer (``argus.v1.Router``): converts and delegates.

Each call's request becomes a :class:`~argus.contracts.router_api.RouterRequest`
(:mod:`argus.contracts.router_api`), :class:`~argus.router.core.RouterCore` serves it, and its reply
or progress events become messages again; a :class:`~argus.router.values.RouterError` becomes
the refusal's status, with the ``retry-after-ms`` trailer when it carries a hint. A request
over the API's byte bound is refused here, before the core, naming its largest field
(:func:`check_size`; the transport lets such requests in for that). The call's
gRPC deadline is the core's ``deadline_s`` and its ending early (a client that cancels or goes
away) sets the core's cancel, which cancels the worker's call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import grpc

from argus.contracts import generate, router_api
from argus.contracts.generate import Progress
from argus.contracts.plans import PublishedPlan
from argus.contracts.router_api import MAX_REQUEST_BYTES, RouterReply
from argus.plumbing import rpc
from argus.plumbing.grpc_server import set_serving
from argus.router import convert
from argus.router.core import CallCancel, RouterCore
from argus.router.values import Refusal, RouterError

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

SERVICE_NAME = "argus.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    """Converts and delegates to :class:`RouterCore`; refusals become statuses."""

    def __init__(self, core: RouterCore, health_servicer: Any = None) -> None:
        self.core = core
        self._health = health_servicer

    def plan_installed(self, published: PublishedPlan) -> None:
        """Install ``published`` in the core; health says SERVING while the plan has workers."""
        if self.core.install(published) and self._health is not None:
            set_serving(self._health, SERVICE_NAME, self.core.can_serve())

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        deadline, cancel = self._call(context)
        try:
            check_size(request)
            reply = self.core.generate(router_api.request_from_pb(request), deadline, cancel=cancel)
        except RouterError as err:
            _abort(err, context)
        return router_api.reply_to_pb(reply)

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The core runs on a thread of its own and this call's thread streams its progress
        out (a streaming handler yields from the thread gRPC gave it); the server's in-flight
        bound (:func:`argus.router.app.busy_limit`) bounds those threads too, and the core's
        ``max_in_flight`` bounds them after their call was cancelled."""
        deadline, cancel = self._call(context)
        try:
            check_size(request)
        except RouterError as err:
            _abort(err, context)
        typed = router_api.request_from_pb(request)
        events: queue.SimpleQueue[Progress | RouterReply | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                events.put(self.core.generate(typed, deadline, progress=events.put, cancel=cancel))
            except BaseException as err:  # handed to the call's thread, which answers it
                events.put(err)

        threading.Thread(target=run, name="grpc-stream", daemon=True).start()
        while True:
            event = events.get()
            if isinstance(event, RouterError):
                _abort(event, context)
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, Progress):
                yield router_pb2.RouterGenerateEvent(progress=generate.progress_to_pb(event))
            else:
                yield router_pb2.RouterGenerateEvent(response=router_api.reply_to_pb(event))
                return

    def _call(self, context: grpc.ServicerContext) -> tuple[float | None, CallCancel]:
        """The call's deadline on the core's clock, and a cancel its ending early sets."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else self.core.now() + remaining
        cancel = CallCancel()
        context.add_callback(cancel.cancel)  # also runs after a normal end: nothing to cancel
        return deadline, cancel


def check_size(request: Any, limit: int = MAX_REQUEST_BYTES) -> None:
    """Raise RouterError(INVALID) when the ``RouterGenerateRequest`` message ``request`` has
    more than ``limit`` bytes, naming its largest field (a prompt or an image, as a rule) and
    the limit: the HTTP API's 413 for a body over the same bound, in gRPC's words."""
    size = request.ByteSize()
    if size <= limit:
        return
    sizes = {field.name: _bytes_of(value) for field, value in request.ListFields()}
    largest = max(sizes, key=sizes.__getitem__)
    raise RouterError(
        Refusal.INVALID,
        f"{largest}: {sizes[largest]} bytes of a {size}-byte request; a request has at most "
        f"{limit} bytes",
    )


def _bytes_of(value: Any) -> int:
    """About the bytes a field's value takes in its message."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    if hasattr(value, "ByteSize"):
        return int(value.ByteSize())
    try:  # a repeated field
        return sum(_bytes_of(item) for item in value)
    except TypeError:
        return 8  # a number


def _abort(err: RouterError, context: grpc.ServicerContext) -> NoReturn:
    if err.retry_after_s is not None:
        context.set_trailing_metadata(convert.retry_after_metadata(err.retry_after_s))
    context.abort(convert.status_code(err.kind), err.details)
