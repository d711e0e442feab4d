"""The router's requests, replies, progress events and refusals, as typed values.

:class:`~argus.router.core.RouterCore` serves on these only; :mod:`argus.router.convert` turns
them into and out of ``argus.v1`` messages (for the gRPC servicer and the calls to workers)
and :mod:`argus.router.http` builds them from JSON. Nothing here imports grpc or protobuf.
Optional request fields are None where the message leaves them unset (the worker's default
applies). Durations are milliseconds, as the messages carry them, so a value converts to its
message and back unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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


class AdapterKind(enum.Enum):
    LORA = "lora"  # merged into the UNet
    CONTROLNET = "controlnet"  # conditioned on ``control_image``


@dataclass(frozen=True)
class Adapter:
    """One adapter a request asks for (``argus.v1.Adapter``)."""

    kind: AdapterKind | None  # None: unspecified or unknown on the wire (refused)
    name: str
    scale: float
    control_image: bytes = b""  # PNG, ControlNets only


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


class Stage(enum.Enum):
    """Where a request stands (``argus.v1.Progress.Stage``)."""

    UNSPECIFIED = "stage_unspecified"  # a worker's event without a stage
    ROUTED = "routed"  # the router chose the level and the worker
    QUEUED = "queued"  # waiting for the worker's GPU slot
    RUNNING = "running"  # denoising starts at ``step``
    STEP = "step"  # ``step`` of ``total_steps`` are done
    DECODING = "decoding"  # the latent is being decoded


@dataclass(frozen=True)
class Progress:
    """One progress event of a streamed request: the router's ROUTED, then the worker's."""

    stage: Stage
    queue_position: int = 0
    step: int = 0
    total_steps: int = 0
    level: str = ""
    worker_id: str = ""
    preview_png: bytes = b""  # STEP events with a preview
    elapsed_ms: float = 0.0  # since the request arrived at the process that sent the event


class CacheOutcome(enum.Enum):
    NOT_USED = "not_used"  # a full generation by design (K = 0 or SM)
    HIT = "hit"  # resumed from a cached latent at step K
    MISS = "miss"  # wanted a cached latent, fell back to a full generation


@dataclass(frozen=True)
class WorkerTiming:
    """The worker's own breakdown of a request, milliseconds (``argus.v1.Timing``)."""

    queue_ms: float = 0.0
    search_ms: float = 0.0
    fetch_ms: float = 0.0
    encode_ms: float = 0.0
    denoise_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    lora_wait_ms: float = 0.0
    controlnet_wait_ms: float = 0.0


@dataclass(frozen=True)
class QualityScore:
    """An earlier image's score a worker sends on a reply (for the router's drift monitor)."""

    prompt: str
    level: str  # the level that served it
    score: float
    request_id: str = ""


@dataclass(frozen=True)
class WorkerCall:
    """What the router asks one worker for (``GenerateRequest``)."""

    prompt: str
    level: str  # the level the router chose
    negative_prompt: str = ""
    seed: int = 0
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    adapters: tuple[Adapter, ...] = ()
    request_id: str = ""
    previews: int = 0


@dataclass(frozen=True)
class WorkerReply:
    """A worker's answer (``GenerateResponse``); enums the worker left unset are None."""

    request_id: str = ""
    png: bytes = b""
    level: str = ""  # the level served
    strategy: Strategy | None = None
    model: str = ""
    steps_run: int = 0  # N - K on a hit, N otherwise
    start_step: int = 0  # K on a hit, 0 otherwise
    cache: CacheOutcome | None = None
    cache_miss_reason: str = ""
    similarity: float = 0.0  # of the cached prompt, on a hit
    timing: WorkerTiming = field(default_factory=WorkerTiming)
    worker_id: str = ""
    substituted: bool = False  # the worker's active model served in place of the level's
    scheduler: str = ""
    adapter_path: str = ""  # "", "controlnet" or "latent-parallel"
    scores: tuple[QualityScore, ...] = ()  # earlier requests' scores; kept in the router


@dataclass(frozen=True)
class RouterTiming:
    """Where a served request's time went, milliseconds."""

    classify_ms: float
    route_ms: float  # admission, PASM sampling and worker selection
    forward_ms: float  # from sending to the worker until its answer
    total_ms: float  # arrival until the answer
    worker: WorkerTiming
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
    worker_response: WorkerReply  # the worker's answer without its PNG and scores

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
