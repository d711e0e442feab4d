"""The router's own requests, replies and refusals, as typed values.

:class:`~argus.router.core.RouterCore` serves on these and on the Generate contract's values
that cross to the workers (:mod:`argus.contracts.generate`: the call, the result, progress,
adapters); :mod:`argus.router.convert` turns the router's own into and out of ``argus.v1``
messages and :mod:`argus.router.http` builds them from JSON. Nothing here imports grpc.
Optional request fields are None where the message leaves them unset (the worker's
default applies). Durations are milliseconds, as the messages carry them, so a value converts
to its message and back unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from argus.contracts.generate import Adapter, GenerateResult, Timing
from argus.types import Strategy


class Refusal(enum.Enum):
    """Why a request was not served; :mod:`argus.router.convert` answers each with one gRPC
    status and :mod:`argus.router.http` with one HTTP status."""

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


@dataclass(frozen=True)
class RouterRequest:
    """One image a client asks for (``RouterGenerateRequest``); unchecked until the core
    serves it (:func:`~argus.router.core.check_request`)."""

    prompt: str = ""
    negative_prompt: str = ""
    seed: int = 0
    width: int | None = None  # pixels; None: the worker's default
    height: int | None = None
    steps: int | None = None  # N; None: the worker's default
    guidance_scale: float | None = None  # None: the model's default
    adapters: tuple[Adapter, ...] = ()
    request_id: str = ""  # idempotency key; "": not de-duplicated
    deadline_ms: int | None = None  # from arrival; None: the router's default
    max_level_index: int | None = None  # fastest level index accepted; None: any
    previews: int = 0  # latent previews to stream (GenerateStream only)
    # an edit, as on the Generate contract (argus.request_limits.check_edit); b"": none
    image: bytes = b""  # the template: PNG, JPEG or WebP; it sets width and height
    mask: bytes = b""  # PNG, fully transparent pixels edited; b"": the image's own alpha
    strength: float | None = None  # img2img (no mask), in (0, 1]


@dataclass(frozen=True)
class RouterTiming:
    """Where a served request's time went, milliseconds."""

    classify_ms: float
    route_ms: float  # admission, PASM sampling and worker selection
    forward_ms: float  # from sending to the worker until its answer
    total_ms: float  # arrival until the answer
    worker: Timing  # the worker's own
    attempts: int  # workers tried


@dataclass(frozen=True)
class RouterReply:
    """A served request (``RouterGenerateResponse``)."""

    request_id: str
    png: bytes
    level: str  # the level served
    level_index: int  # its index among the strategy's levels, 0 = slowest
    strategy: Strategy
    worker_id: str
    classified_level: str  # the classifier's optimal level for the prompt
    target_level: str  # the level the PASM sampled
    plan_version: int
    timing: RouterTiming
    worker_response: GenerateResult  # the worker's answer without its PNG and scores

    def size_bytes(self) -> int:
        """About the bytes it takes (the request ledger bounds the answers it keeps by it):
        the PNG and the text, plus the numbers' share of the serialized message."""
        worker = self.worker_response
        text = (
            self.request_id,
            self.level,
            self.worker_id,
            self.classified_level,
            self.target_level,
            worker.request_id,
            worker.level,
            worker.model,
            worker.cache_miss_reason,
            worker.worker_id,
            worker.scheduler,
            worker.adapter_path,
        )
        return len(self.png) + len(worker.png) + sum(len(t.encode()) for t in text) + 160
