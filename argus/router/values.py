"""Why a request was not served: :class:`Refusal` and :class:`RouterError`.

:class:`~argus.router.core.RouterCore` raises a :class:`RouterError` for every request it
does not serve; the gRPC servicer answers it with a status code and a ``retry-after-ms``
trailer (:mod:`argus.router.convert`), the HTTP API with a status and OpenAI's error body
(:mod:`argus.router.openai_wire`). The requests and replies themselves are the router API's contract
values (:mod:`argus.contracts.router_api`). Nothing here imports grpc.
"""

from __future__ import annotations

import enum


class Refusal(enum.Enum):
    """Why a request was not served; :mod:`argus.router.convert` answers each with one gRPC
    status and :mod:`argus.router.openai_wire` with one HTTP status."""

    INVALID = "invalid"  # a bad field; the details start with its name
    NOT_FOUND = "not_found"  # the worker has no such adapter
    ID_CONFLICT = "id_conflict"  # a request id reused for another request within the window
    ANSWER_DROPPED = "answer_dropped"  # a retry whose first answer is no longer kept
    OVERLOADED = "overloaded"  # admission refused it; retry_after_s says when to retry
    UNAVAILABLE = "unavailable"  # no plan, no live worker, or the router is stopping
    DEADLINE = "deadline"  # it cannot finish, or did not finish, by its deadline
    CANCELLED = "cancelled"  # its client went away
    UNAUTHENTICATED = "unauthenticated"  # a worker refused the router's credentials
    PERMISSION_DENIED = "permission_denied"  # a worker refused the router's certificate
    FAILED = "failed"  # a worker failed, or its answer was refused

    @property
    def status_name(self) -> str:
        """The gRPC status's name it is answered with; metrics label requests with it and the
        HTTP API's error ``code`` is it in lower case (both from before refusals were typed)."""
        return _STATUS_NAMES[self]


_STATUS_NAMES = {
    Refusal.INVALID: "INVALID_ARGUMENT",
    Refusal.NOT_FOUND: "NOT_FOUND",
    Refusal.ID_CONFLICT: "ALREADY_EXISTS",
    Refusal.ANSWER_DROPPED: "FAILED_PRECONDITION",
    Refusal.OVERLOADED: "RESOURCE_EXHAUSTED",
    Refusal.UNAVAILABLE: "UNAVAILABLE",
    Refusal.DEADLINE: "DEADLINE_EXCEEDED",
    Refusal.CANCELLED: "CANCELLED",
    Refusal.UNAUTHENTICATED: "UNAUTHENTICATED",
    Refusal.PERMISSION_DENIED: "PERMISSION_DENIED",
    Refusal.FAILED: "INTERNAL",
}


class RouterError(Exception):
    """A request ends refused or failed; ``retry_after_s`` hints when a retry may be admitted
    (gRPC's ``retry-after-ms`` trailer, HTTP's ``Retry-After``)."""

    def __init__(self, kind: Refusal, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(details)
        self.kind = kind
        self.details = details
        self.retry_after_s = retry_after_s
