"""``argus.v1`` messages ↔ the router's own typed values (:mod:`argus.router.values`).

Both halves for the router's API (``RouterGenerateRequest``, ``RouterGenerateResponse``), and
each :class:`~argus.router.values.Refusal` ↔ its gRPC status code, with the
``retry-after-ms`` trailer of a refusal that has a retry hint. What the router exchanges with
workers (the call, the result, progress events, adapters) converts in
:mod:`argus.contracts.generate`, whose halves these reuse. Unset optional fields are None and
back; a value converted from a message converts back to an equal message. Reading never
refuses: an unknown adapter kind becomes None, which the core's check refuses naming the
adapter, so every request check stays in one place (:func:`~argus.router.core.check_request`).
"""

from __future__ import annotations

from typing import Any

import grpc

from argus.contracts.generate import (
    request_from_message,
    request_to_message,
    result_to_pb,
    timing_to_pb,
)
from argus.contracts.wire import STRATEGY_TO_PB
from argus.plumbing import rpc
from argus.router.values import Refusal, RouterReply, RouterRequest

router_pb2: Any = rpc.load("router_pb2")

RETRY_AFTER_KEY = "retry-after-ms"

STATUS_CODES: dict[Refusal, grpc.StatusCode] = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Refusal.ID_CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.ANSWER_DROPPED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Refusal.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.CANCELLED: grpc.StatusCode.CANCELLED,
    Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.FAILED: grpc.StatusCode.INTERNAL,
}
_REFUSALS = {code: refusal for refusal, code in STATUS_CODES.items()}

_OPTIONAL = (
    "width",
    "height",
    "steps",
    "guidance_scale",
    "deadline_ms",
    "max_level_index",
    "strength",
)


# -- refusals ------------------------------------------------------------------------------


def status_code(refusal: Refusal) -> grpc.StatusCode:
    """The status a refusal is answered with."""
    return STATUS_CODES[refusal]


def refusal_of(code: grpc.StatusCode) -> Refusal:
    """What a worker's status means to the router; a status no refusal answers with (UNKNOWN,
    UNIMPLEMENTED, ...) is the worker failing."""
    return _REFUSALS.get(code, Refusal.FAILED)


def retry_after_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a refusal with a retry hint: whole milliseconds, at least 1."""
    return ((RETRY_AFTER_KEY, str(max(1, round(retry_after_s * 1e3)))),)


# -- the router's API ------------------------------------------------------------------------


def request_from_pb(message: Any) -> RouterRequest:
    """A client's ``RouterGenerateRequest``, unchecked."""
    return RouterRequest(**request_from_message(message, _OPTIONAL))


def request_to_pb(request: RouterRequest) -> Any:
    return request_to_message(request, router_pb2.RouterGenerateRequest(), _OPTIONAL)


def reply_to_pb(reply: RouterReply) -> Any:
    t = reply.timing
    return router_pb2.RouterGenerateResponse(
        request_id=reply.request_id,
        png=reply.png,
        level=reply.level,
        level_index=reply.level_index,
        strategy=STRATEGY_TO_PB[reply.strategy],
        worker_id=reply.worker_id,
        classified_level=reply.classified_level,
        target_level=reply.target_level,
        plan_version=reply.plan_version,
        timing=router_pb2.RouterTiming(
            classify_ms=t.classify_ms,
            route_ms=t.route_ms,
            forward_ms=t.forward_ms,
            total_ms=t.total_ms,
            worker=timing_to_pb(t.worker),
            attempts=t.attempts,
        ),
        worker_response=result_to_pb(reply.worker_response),
    )
