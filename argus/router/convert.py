"""``argus.v1`` messages ↔ the router's typed values (:mod:`argus.router.values`).

Both halves for the router's own API (``RouterGenerateRequest``, ``RouterGenerateResponse``,
``Progress``) and for its calls to workers (``GenerateRequest``, ``GenerateResponse``), and
each :class:`~argus.router.values.Refusal` ↔ its gRPC status code, with the
``retry-after-ms`` trailer of a refusal that has a retry hint. Unset optional fields are None
and back; a value converted from a message converts back to an equal message. Reading never
refuses: an unknown adapter kind becomes None, which the core's check refuses naming the
adapter, so every request check stays in one place (:func:`~argus.router.core.check_request`).
"""

from __future__ import annotations

from typing import Any

import grpc

from argus import rpc
from argus.contracts.wire import STRATEGY_FROM_PB, STRATEGY_TO_PB
from argus.router.values import (
    Adapter,
    AdapterKind,
    CacheOutcome,
    Progress,
    QualityScore,
    Refusal,
    RouterReply,
    RouterRequest,
    Stage,
    WorkerCall,
    WorkerReply,
    WorkerTiming,
)

common_pb2: Any = rpc.load("common_pb2")
router_pb2: Any = rpc.load("router_pb2")
worker_pb2: Any = rpc.load("worker_pb2")

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

_ADAPTER_TO_PB = {AdapterKind.LORA: 1, AdapterKind.CONTROLNET: 2}
_ADAPTER_FROM_PB = {v: k for k, v in _ADAPTER_TO_PB.items()}
_STAGE_TO_PB = {
    Stage.UNSPECIFIED: 0,
    Stage.ROUTED: 1,
    Stage.QUEUED: 2,
    Stage.RUNNING: 3,
    Stage.STEP: 4,
    Stage.DECODING: 5,
}
_STAGE_FROM_PB = {v: k for k, v in _STAGE_TO_PB.items()}
_CACHE_TO_PB = {CacheOutcome.NOT_USED: 1, CacheOutcome.HIT: 2, CacheOutcome.MISS: 3}
_CACHE_FROM_PB = {v: k for k, v in _CACHE_TO_PB.items()}
_OPTIONAL = ("width", "height", "steps", "guidance_scale")  # both requests' optional fields
_TIMING = tuple(WorkerTiming.__dataclass_fields__)


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


def adapters_from_pb(messages: Any) -> tuple[Adapter, ...]:
    return tuple(
        Adapter(
            kind=_ADAPTER_FROM_PB.get(m.kind),
            name=m.name,
            scale=m.scale,
            control_image=bytes(m.control_image),
        )
        for m in messages
    )


def adapters_to_pb(adapters: tuple[Adapter, ...]) -> list[Any]:
    return [
        common_pb2.Adapter(
            kind=0 if a.kind is None else _ADAPTER_TO_PB[a.kind],
            name=a.name,
            scale=a.scale,
            control_image=a.control_image,
        )
        for a in adapters
    ]


def _given(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def request_from_pb(message: Any) -> RouterRequest:
    """A client's ``RouterGenerateRequest``, unchecked."""
    return RouterRequest(
        prompt=message.prompt,
        negative_prompt=message.negative_prompt,
        seed=message.seed,
        width=_given(message, "width"),
        height=_given(message, "height"),
        steps=_given(message, "steps"),
        guidance_scale=_given(message, "guidance_scale"),
        adapters=adapters_from_pb(message.adapters),
        request_id=message.request_id,
        deadline_ms=_given(message, "deadline_ms"),
        max_level_index=_given(message, "max_level_index"),
        previews=message.previews,
    )


def request_to_pb(request: RouterRequest) -> Any:
    message = router_pb2.RouterGenerateRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=request.seed,
        adapters=adapters_to_pb(request.adapters),
        previews=request.previews,
    )
    for name in (*_OPTIONAL, "deadline_ms", "max_level_index"):
        if (value := getattr(request, name)) is not None:
            setattr(message, name, value)
    return message


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
        worker_response=worker_reply_to_pb(reply.worker_response),
    )


def progress_to_pb(progress: Progress) -> Any:
    return worker_pb2.Progress(
        stage=_STAGE_TO_PB[progress.stage],
        queue_position=progress.queue_position,
        step=progress.step,
        total_steps=progress.total_steps,
        level=progress.level,
        worker_id=progress.worker_id,
        preview_png=progress.preview_png,
        elapsed_ms=progress.elapsed_ms,
    )


def progress_from_pb(message: Any) -> Progress:
    """A progress event; a stage this router does not know is UNSPECIFIED."""
    return Progress(
        stage=_STAGE_FROM_PB.get(message.stage, Stage.UNSPECIFIED),
        queue_position=message.queue_position,
        step=message.step,
        total_steps=message.total_steps,
        level=message.level,
        worker_id=message.worker_id,
        preview_png=bytes(message.preview_png),
        elapsed_ms=message.elapsed_ms,
    )


# -- the calls to workers --------------------------------------------------------------------


def worker_call_to_pb(call: WorkerCall) -> Any:
    message = worker_pb2.GenerateRequest(
        request_id=call.request_id,
        prompt=call.prompt,
        negative_prompt=call.negative_prompt,
        seed=call.seed,
        level=call.level,
        adapters=adapters_to_pb(call.adapters),
        previews=call.previews,
    )
    for name in _OPTIONAL:
        if (value := getattr(call, name)) is not None:
            setattr(message, name, value)
    return message


def timing_to_pb(timing: WorkerTiming) -> Any:
    return worker_pb2.Timing(**{name: getattr(timing, name) for name in _TIMING})


def timing_from_pb(message: Any) -> WorkerTiming:
    return WorkerTiming(**{name: getattr(message, name) for name in _TIMING})


def worker_reply_from_pb(message: Any) -> WorkerReply:
    """A worker's ``GenerateResponse``; a strategy or cache outcome it left unset (or one
    this router does not know) is None."""
    return WorkerReply(
        request_id=message.request_id,
        png=bytes(message.png),
        level=message.level,
        strategy=STRATEGY_FROM_PB.get(message.strategy),
        model=message.model,
        steps_run=message.steps_run,
        start_step=message.start_step,
        cache=_CACHE_FROM_PB.get(message.cache),
        cache_miss_reason=message.cache_miss_reason,
        similarity=message.similarity,
        timing=timing_from_pb(message.timing),
        worker_id=message.worker_id,
        substituted=message.substituted,
        scheduler=message.scheduler,
        adapter_path=message.adapter_path,
        scores=tuple(
            QualityScore(prompt=s.prompt, level=s.level, score=s.score, request_id=s.request_id)
            for s in message.scores
        ),
    )


def worker_reply_to_pb(reply: WorkerReply) -> Any:
    return worker_pb2.GenerateResponse(
        request_id=reply.request_id,
        png=reply.png,
        level=reply.level,
        strategy=0 if reply.strategy is None else STRATEGY_TO_PB[reply.strategy],
        model=reply.model,
        steps_run=reply.steps_run,
        start_step=reply.start_step,
        cache=0 if reply.cache is None else _CACHE_TO_PB[reply.cache],
        cache_miss_reason=reply.cache_miss_reason,
        similarity=reply.similarity,
        timing=timing_to_pb(reply.timing),
        worker_id=reply.worker_id,
        substituted=reply.substituted,
        scheduler=reply.scheduler,
        adapter_path=reply.adapter_path,
        scores=[
            worker_pb2.QualityScore(
                prompt=s.prompt, level=s.level, score=s.score, request_id=s.request_id
            )
            for s in reply.scores
        ],
    )
