"""The router's API as typed values: what a client asks for and what it gets back.

A client reaches the router over gRPC (``argus.v1.Router``) or HTTP (the OpenAI-compatible
API, :mod:`argus.router.http_app`); both become a :class:`RouterRequest`, which
:class:`~argus.router.core.RouterCore` serves into a :class:`RouterReply`. The values and both
halves of their ``argus.v1`` conversion live here, as the Generate contract's do
(:mod:`argus.contracts.generate`, whose field copies these reuse): a request and a worker
call carry the same prompt, sampling, adapter and edit fields. Optional request fields are
None where the message leaves them unset (the worker's default applies). Durations are
milliseconds, as the messages carry them, so a value converts to its message and back
unchanged. Reading never refuses: every request check stays in one place
(:func:`~argus.router.core.check_request`). The generated code loads with the first
conversion, so the router's core imports these values without protobuf.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from argus.contracts.generate import (
    Adapter,
    GenerateResult,
    Timing,
    codec,
    request_from_message,
    request_to_message,
    result_to_pb,
    timing_to_pb,
)
from argus.types import Strategy

MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""The most bytes one request may have, on either API: the gRPC message, or the HTTP body (JSON,
or an edit's form). Both prompts and an edit's image and mask at their limits fit in it
(:mod:`argus.request_limits`); a larger request is the client's error
(INVALID_ARGUMENT, or 413 over HTTP), not an overload to retry."""

# the request's fields a message may leave unset
_OPTIONAL = (
    "width",
    "height",
    "steps",
    "guidance_scale",
    "deadline_ms",
    "max_level_index",
    "strength",
)


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


@functools.cache
def _router_pb2() -> Any:
    from argus.plumbing import rpc

    return rpc.load("router_pb2")


def request_from_pb(message: Any) -> RouterRequest:
    """A client's ``RouterGenerateRequest``, unchecked."""
    return RouterRequest(**request_from_message(message, _OPTIONAL))


def request_to_pb(request: RouterRequest) -> Any:
    return request_to_message(request, _router_pb2().RouterGenerateRequest(), _OPTIONAL)


def reply_to_pb(reply: RouterReply) -> Any:
    t = reply.timing
    return _router_pb2().RouterGenerateResponse(
        request_id=reply.request_id,
        png=reply.png,
        level=reply.level,
        level_index=reply.level_index,
        strategy=codec().strategy_to_pb[reply.strategy],
        worker_id=reply.worker_id,
        classified_level=reply.classified_level,
        target_level=reply.target_level,
        plan_version=reply.plan_version,
        timing=_router_pb2().RouterTiming(
            classify_ms=t.classify_ms,
            route_ms=t.route_ms,
            forward_ms=t.forward_ms,
            total_ms=t.total_ms,
            worker=timing_to_pb(t.worker),
            attempts=t.attempts,
        ),
        worker_response=result_to_pb(reply.worker_response),
    )
