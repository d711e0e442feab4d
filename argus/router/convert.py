"""Each :class:`~argus.router.values.Refusal` ↔ its gRPC status code, with the
``retry-after-ms`` trailer of a refusal that has a retry hint: what only the gRPC side of the
router speaks. The router API's requests and replies convert in
:mod:`argus.contracts.router_api`, what it exchanges with workers in
:mod:`argus.contracts.generate`.
"""

from __future__ import annotations

import grpc

from argus.router.values import Refusal

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
