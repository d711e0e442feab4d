"""The Generate call between a router and a worker (``argus.v1.Worker/Generate``,
``GenerateStream``), as one set of typed values with both halves of its conversion.

The router builds a :class:`GenerateCall`, the worker's engine serves it and answers a
:class:`GenerateResult` (with its :class:`Timing` and the :class:`QualityScore` of earlier
images) after :class:`Progress` events on a stream. Both sides import these values from here,
so a field exists once: an edit's image, mask and strength (img2img and inpainting) are
:class:`GenerateCall`'s, converted by :func:`call_to_pb` / :func:`call_from_pb`, and reach
the engine without another copy.

Optional fields of the call are None where the message leaves them unset (the worker's
default applies); enums the sender left unset, or that this reader does not know, are None
(cache outcome, strategy, adapter kind) or :attr:`Stage.UNSPECIFIED`: reading never refuses,
the checks stay with the engine (:meth:`~argus.worker.engine.Worker.validate`) and the
router's core (:func:`~argus.router.core.check_request`). Durations are milliseconds, as the
messages carry them, so a value converts to its message and back unchanged. Each enum's
numbers come from the generated code by name (:func:`~argus.contracts.wire.pb_numbers`).

The approximate cache's evidence travels here too: a result says what the cache gave the
request (outcome, the neighbour's similarity, the step resumed at and the level's K, its
ceiling), and a call that sends a :class:`CacheCursor` gets the cache's changes after it
(:class:`CacheEvents`) for the router's mirror of what each worker caches; the prompt's
embedding the router made for its lookup rides on the call, so the worker need not embed it
again. The
:class:`CacheKey` whose tag those changes carry is defined here, so a router computes the same
tag for a request as the worker that cached it (:func:`adapters_digest` included).

The generated code loads with the first conversion (:func:`codec`), not with the values: the
router's core serves on these values and loads no protobuf module (its messages are its
transports' business).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from argus.types import Strategy


class AdapterKind(enum.Enum):
    """What an adapter is (``argus.v1.Adapter.Kind``); the values are the HTTP API's names."""

    LORA = "lora"  # merged into the UNet
    CONTROLNET = "controlnet"  # conditioned on ``control_image``


# The profiles' models by the base family whose ControlNets their UNet takes (the worker finds
# the same family from its UNet's config: ``argus.worker.adapters.controlnet.models.base_family``),
# or
# None for a model that runs none: SD-2.x's cross-attention is wider than SD-1.x's, and the
# distilled small and tiny UNets lack blocks a ControlNet adds residuals to. The router serves
# a request that names a ControlNet only on levels before the first whose model runs none
# (``argus.router.policy.RouterPolicy.level_cap``); a model not listed is left to its worker.
CONTROLNET_FAMILIES: dict[str, str | None] = {
    "sdxl": "sdxl",
    "sdxl-turbo": "sdxl",
    "sd-1.5": "sd15",
    "sd-1.4": "sd15",
    "sd-2.0": None,
    "sd-2.1": None,
    "small-sd": None,
    "tiny-sd": None,
}


def runs_controlnets(model: str) -> bool:
    """Whether the profile's model ``model`` (a level's ``model``) may run ControlNets: False
    only for a model :data:`CONTROLNET_FAMILIES` knows runs none."""
    return CONTROLNET_FAMILIES.get(model, "") is not None


@dataclass(frozen=True)
class Adapter:
    """One adapter a request asks for (``argus.v1.Adapter``)."""

    kind: AdapterKind | None  # None: unspecified or unknown on the wire (refused)
    name: str
    scale: float  # 0: unset, diffusers' default 1 applies
    control_image: bytes = b""  # PNG, ControlNets only


@dataclass(frozen=True)
class CacheKey:
    """What must be equal for a cached latent to be usable: entries only match requests with
    the same key. ``adapters`` is :func:`adapters_digest` of the request's LoRAs and
    ControlNets ("" without any), so a latent made under one LoRA set or control image never
    serves another."""

    model: str  # model name of the profile, e.g. "sdxl"
    scheduler: str  # scheduler name, e.g. "euler"
    height: int  # pixels
    width: int  # pixels
    steps: int  # N, total denoising steps
    adapters: str = ""  # adapters_digest(...) of the request's adapters; "": none

    def __post_init__(self) -> None:
        if not self.model or not self.scheduler:
            raise ValueError(f"cache key needs a model and a scheduler: {self}")
        if min(self.height, self.width, self.steps) <= 0:
            raise ValueError(f"cache key needs positive height, width and steps: {self}")

    @property
    def tag(self) -> str:
        """The keyword the index filters on: an unambiguous encoding of every field (a key
        without adapters keeps the five-field form the first caches were written with)."""
        fields_ = [self.model, self.scheduler, self.height, self.width, self.steps]
        return json.dumps([*fields_, self.adapters] if self.adapters else fields_)


def adapters_digest(adapters: Iterable[Adapter]) -> str:
    """A request's adapters as one hex digest, "" for none: each LoRA by name and scale, each
    ControlNet by name, scale and the SHA-256 of its control image, in no particular order
    (LoRA deltas add up and ControlNet residuals are summed, so the order does not shape the
    image). An unset scale (0) counts as diffusers' default 1, as the worker runs it."""
    entries = sorted(
        json.dumps(
            [
                "" if a.kind is None else a.kind.value,
                a.name,
                float(a.scale or 1.0),
                hashlib.sha256(a.control_image).hexdigest() if a.control_image else "",
            ]
        )
        for a in adapters
    )
    if not entries:
        return ""
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


@dataclass(frozen=True)
class CacheCursor:
    """Where a caller stands in a worker's log of cache changes: the log's id and the last
    sequence number it applied (0: none yet). A cursor of another log reads as 0."""

    log_id: str = ""
    after: int = 0


@dataclass(frozen=True)
class CacheInsert:
    """A prompt's latents were cached under ``tag`` (:attr:`CacheKey.tag`)."""

    entry_id: str
    tag: str
    embedding: tuple[float, ...]  # the prompt's unit-norm embedding (float32 values)


@dataclass(frozen=True)
class CacheEvict:
    """An entry left the cache (evicted by its bound, or purged with a bad latent file)."""

    entry_id: str


CacheEvent = CacheInsert | CacheEvict


@dataclass(frozen=True)
class CacheEvents:
    """The cache's changes after a caller's cursor, oldest first. ``last`` is the caller's
    next cursor in log ``log_id``; ``truncated``: changes after the cursor were dropped or
    are unknown, so a mirror built from earlier events is incomplete (forget it, then apply
    these)."""

    log_id: str
    last: int
    events: tuple[CacheEvent, ...] = ()
    truncated: bool = False


@dataclass(frozen=True)
class GenerateCall:
    """What a router asks one worker for (``GenerateRequest``); None: absent, the worker's
    default applies. The worker checks it (:meth:`~argus.worker.engine.Worker.validate`)."""

    prompt: str
    level: str = ""  # a level of the worker's profile; "": its configured level
    negative_prompt: str = ""
    seed: int = 0
    width: int | None = None  # pixels
    height: int | None = None
    steps: int | None = None  # N
    guidance_scale: float | None = None  # None: the model's default
    adapters: tuple[Adapter, ...] = ()
    request_id: str = ""
    previews: int = 0  # low-resolution previews of the latent to stream (0: none)
    # an edit (argus.request_limits.check_edit says what is accepted); b"": a generation
    image: bytes = b""  # the template: PNG, JPEG or WebP, of the size generated
    mask: bytes = b""  # PNG, fully transparent pixels edited; b"": the image's own alpha
    strength: float | None = None  # img2img (no mask), in (0, 1]
    # where the caller stands in the worker's log of cache changes; None: send none back
    cache_cursor: CacheCursor | None = None
    # the prompt's unit-norm embedding as the router made it for its cache lookup, and its
    # encoder's vectors_id: a worker with that encoder uses it instead of embedding again
    prompt_embedding: tuple[float, ...] = ()
    prompt_encoder: str = ""


class Stage(enum.Enum):
    """Where a request stands (``argus.v1.Progress.Stage``); the values are the protobuf
    names in lower case, which the router's HTTP stream sends as they are."""

    UNSPECIFIED = "stage_unspecified"  # an event without a stage
    ROUTED = "routed"  # the router chose the level and the worker
    QUEUED = "queued"  # waiting for the worker's GPU slot
    RUNNING = "running"  # denoising starts at ``step``
    STEP = "step"  # ``step`` of ``total_steps`` are done
    DECODING = "decoding"  # the latent is being decoded


@dataclass(frozen=True)
class Progress:
    """One progress event of a streamed request: the router's ROUTED, then the worker's.
    ``queue_position``: requests ahead of it (QUEUED); ``step`` of ``total_steps``: the step
    it starts at (RUNNING, K on a cache hit) or the steps done (STEP)."""

    stage: Stage
    queue_position: int = 0
    step: int = 0
    total_steps: int = 0
    level: str = ""  # ROUTED: the level chosen
    worker_id: str = ""  # the worker chosen (ROUTED) or sending the event
    preview_png: bytes = b""  # STEP events with a preview
    elapsed_ms: float = 0.0  # since the request arrived at the process that sent the event


class CacheOutcome(enum.Enum):
    """Whether a request resumed from a cached latent (``argus.v1.CacheOutcome``); the values
    label the worker's latency metric."""

    NOT_USED = "not-used"  # a full generation by design (K = 0 or SM)
    HIT = "hit"  # resumed from a cached latent at step K
    MISS = "miss"  # wanted a cached latent, fell back to a full generation


MISS_INDEX_ERROR = "index-error"
"""The miss reason of a lookup whose vector index failed (down, closed, too slow): the one a
router reads, to stop counting on that worker's cache for a while."""


@dataclass(frozen=True)
class Timing:
    """The worker's own breakdown of a request, milliseconds (``argus.v1.Timing``).

    ``queue_ms`` is the wait for the GPU slot; ``total_ms`` runs from the call's arrival at
    the worker until its reply is ready, so ``total_ms - queue_ms`` is the service time that
    routers learn. Inside it: ``search_ms`` and ``fetch_ms`` (the cache lookup),
    ``encode_ms`` (text encoding and the starting latents), ``denoise_ms``, ``decode_ms``
    (VAE and PNG); ``lora_wait_ms`` and ``controlnet_wait_ms``: the adapters' waits."""

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
    score: float  # PickScore (about 20 for a good SD image with the real model)
    request_id: str = ""


@dataclass(frozen=True)
class GenerateResult:
    """A worker's answer (``GenerateResponse``); enums the worker left unset are None."""

    request_id: str = ""
    png: bytes = b""
    level: str = ""  # the level served
    strategy: Strategy | None = None
    model: str = ""
    steps_run: int = 0  # N - K on a hit, N otherwise
    start_step: int = 0  # K on a hit (at most routed_step), 0 otherwise
    cache: CacheOutcome | None = None
    cache_miss_reason: str = ""
    # of the nearest cached prompt the lookup found (hit, or a miss below the floor or with a
    # bad latent file); None: it found none, or made no lookup
    similarity: float | None = None
    timing: Timing = field(default_factory=Timing)
    worker_id: str = ""
    substituted: bool = False  # the worker's active model served in place of the level's
    scheduler: str = ""
    adapter_path: str = ""  # "", "plain" (LoRAs only), "controlnet" or "latent-parallel"
    scores: tuple[QualityScore, ...] = ()  # earlier requests' scores
    routed_step: int = 0  # the level's K, the cache's ceiling (0: an SM level)
    cache_events: CacheEvents | None = None  # the cache's changes; None: the call asked none


@dataclass(frozen=True)
class Codec:
    """The generated modules and each enum's numbers, by name (:func:`codec`)."""

    common_pb2: Any
    worker_pb2: Any
    adapter_to_pb: dict[AdapterKind, int]
    stage_to_pb: dict[Stage, int]
    cache_to_pb: dict[CacheOutcome, int]
    strategy_to_pb: dict[Strategy, int]

    @functools.cached_property
    def adapter_from_pb(self) -> dict[int, AdapterKind]:
        return {v: k for k, v in self.adapter_to_pb.items()}

    @functools.cached_property
    def stage_from_pb(self) -> dict[int, Stage]:
        return {v: k for k, v in self.stage_to_pb.items()}

    @functools.cached_property
    def cache_from_pb(self) -> dict[int, CacheOutcome]:
        return {v: k for k, v in self.cache_to_pb.items()}

    @functools.cached_property
    def strategy_from_pb(self) -> dict[int, Strategy]:
        return {v: k for k, v in self.strategy_to_pb.items()}


@functools.cache
def codec() -> Codec:
    """Loads the generated code on the first conversion; raises ValueError when an enum here
    and its protobuf enum disagree on a name (see :func:`~argus.contracts.wire.pb_numbers`)."""
    from argus.contracts.wire import STRATEGY_TO_PB, pb_numbers
    from argus.plumbing import rpc

    common_pb2: Any = rpc.load("common_pb2")
    worker_pb2: Any = rpc.load("worker_pb2")
    return Codec(
        common_pb2=common_pb2,
        worker_pb2=worker_pb2,
        adapter_to_pb=pb_numbers(AdapterKind, common_pb2.Adapter.Kind),
        # a stage's value is its protobuf name in lower case (the HTTP stream's names)
        stage_to_pb=pb_numbers(Stage, worker_pb2.Progress.Stage, lambda s: s.value.upper()),
        cache_to_pb=pb_numbers(CacheOutcome, worker_pb2.CacheOutcome, lambda c: f"CACHE_{c.name}"),
        strategy_to_pb=STRATEGY_TO_PB,
    )


# the call's optional fields
_OPTIONAL = ("width", "height", "steps", "guidance_scale", "strength")
_TIMING = tuple(f.name for f in fields(Timing))


# -- the call ------------------------------------------------------------------------------


def adapters_to_pb(adapters: Iterable[Adapter]) -> list[Any]:
    c = codec()
    return [
        c.common_pb2.Adapter(
            kind=0 if a.kind is None else c.adapter_to_pb[a.kind],
            name=a.name,
            scale=a.scale,
            control_image=a.control_image,
        )
        for a in adapters
    ]


def adapters_from_pb(messages: Iterable[Any]) -> tuple[Adapter, ...]:
    """The adapters of a message; an unspecified or unknown kind is None."""
    c = codec()
    return tuple(
        Adapter(
            kind=c.adapter_from_pb.get(m.kind),
            name=m.name,
            scale=m.scale,
            control_image=bytes(m.control_image),
        )
        for m in messages
    )


def given(message: Any, name: str) -> Any:
    """An optional field's value, None when the message leaves it unset."""
    return getattr(message, name) if message.HasField(name) else None


# what a client's request to the router and the router's call to a worker carry alike
_SHARED = ("prompt", "negative_prompt", "seed", "request_id", "previews", "image", "mask")


def request_to_message(value: Any, message: Any, optional: tuple[str, ...]) -> Any:
    """``message`` with the fields a Generate call and a router request share copied from
    ``value``, and each of its ``optional`` fields that is not None."""
    for name in _SHARED:
        setattr(message, name, getattr(value, name))
    message.adapters.extend(adapters_to_pb(value.adapters))
    for name in optional:
        if (field_value := getattr(value, name)) is not None:
            setattr(message, name, field_value)
    return message


def request_from_message(message: Any, optional: tuple[str, ...]) -> dict[str, Any]:
    """The shared fields of a Generate call or a router request read from ``message`` (the
    ``optional`` ones None when unset), as keyword arguments for its value type."""
    read = {name: getattr(message, name) for name in _SHARED}
    read["image"], read["mask"] = bytes(message.image), bytes(message.mask)
    read["adapters"] = adapters_from_pb(message.adapters)
    return read | {name: given(message, name) for name in optional}


def call_to_pb(call: GenerateCall) -> Any:
    message = codec().worker_pb2.GenerateRequest(level=call.level)
    if call.cache_cursor is not None:
        message.cache_log_id = call.cache_cursor.log_id
        message.cache_events_after = call.cache_cursor.after
    if call.prompt_embedding:
        message.prompt_embedding.extend(call.prompt_embedding)
        message.prompt_encoder = call.prompt_encoder
    return request_to_message(call, message, _OPTIONAL)


def call_from_pb(message: Any) -> GenerateCall:
    """A router's ``GenerateRequest``, unchecked."""
    cursor = None
    if message.HasField("cache_events_after"):
        cursor = CacheCursor(message.cache_log_id, message.cache_events_after)
    return GenerateCall(
        level=message.level,
        cache_cursor=cursor,
        prompt_embedding=tuple(message.prompt_embedding),
        prompt_encoder=message.prompt_encoder,
        **request_from_message(message, _OPTIONAL),
    )


# -- progress ------------------------------------------------------------------------------


def progress_to_pb(progress: Progress) -> Any:
    c = codec()
    return c.worker_pb2.Progress(
        stage=c.stage_to_pb[progress.stage],
        queue_position=progress.queue_position,
        step=progress.step,
        total_steps=progress.total_steps,
        level=progress.level,
        worker_id=progress.worker_id,
        preview_png=progress.preview_png,
        elapsed_ms=progress.elapsed_ms,
    )


def progress_from_pb(message: Any) -> Progress:
    """A progress event; a stage this reader does not know is UNSPECIFIED."""
    c = codec()
    return Progress(
        stage=c.stage_from_pb.get(message.stage, Stage.UNSPECIFIED),
        queue_position=message.queue_position,
        step=message.step,
        total_steps=message.total_steps,
        level=message.level,
        worker_id=message.worker_id,
        preview_png=bytes(message.preview_png),
        elapsed_ms=message.elapsed_ms,
    )


# -- the result ----------------------------------------------------------------------------


def timing_to_pb(timing: Timing) -> Any:
    c = codec()
    return c.worker_pb2.Timing(**{name: getattr(timing, name) for name in _TIMING})


def timing_from_pb(message: Any) -> Timing:
    return Timing(**{name: getattr(message, name) for name in _TIMING})


def score_to_pb(score: QualityScore) -> Any:
    c = codec()
    return c.worker_pb2.QualityScore(
        prompt=score.prompt, level=score.level, score=score.score, request_id=score.request_id
    )


def score_from_pb(message: Any) -> QualityScore:
    return QualityScore(
        prompt=message.prompt,
        level=message.level,
        score=message.score,
        request_id=message.request_id,
    )


def cache_event_to_pb(event: CacheEvent) -> Any:
    pb = codec().worker_pb2
    if isinstance(event, CacheInsert):
        insert = pb.CacheInsert(entry_id=event.entry_id, tag=event.tag, embedding=event.embedding)
        return pb.CacheEvent(insert=insert)
    return pb.CacheEvent(evict=pb.CacheEvict(entry_id=event.entry_id))


def cache_event_from_pb(message: Any) -> CacheEvent | None:
    """An event; None for one this reader does not know (a newer kind, or none set)."""
    kind = message.WhichOneof("event")
    if kind == "insert":
        i = message.insert
        return CacheInsert(i.entry_id, i.tag, tuple(i.embedding))
    if kind == "evict":
        return CacheEvict(message.evict.entry_id)
    return None


def _cache_events_to_pb(events: CacheEvents | None, message: Any) -> None:
    if events is None:
        return
    message.cache_events.extend(cache_event_to_pb(e) for e in events.events)
    message.cache_events_truncated = events.truncated
    message.cache_log_id = events.log_id
    message.cache_events_last = events.last


def _cache_events_from_pb(message: Any) -> CacheEvents | None:
    """The reply's cache events; None when it carries no log (the call asked for none). An
    event of a kind this reader does not know makes the batch truncated: the mirror cannot
    apply it."""
    if not message.cache_log_id:
        return None
    events = [cache_event_from_pb(e) for e in message.cache_events]
    known = tuple(e for e in events if e is not None)
    return CacheEvents(
        log_id=message.cache_log_id,
        last=message.cache_events_last,
        events=known,
        truncated=message.cache_events_truncated or len(known) < len(events),
    )


def result_to_pb(result: GenerateResult) -> Any:
    c = codec()
    message = c.worker_pb2.GenerateResponse(
        request_id=result.request_id,
        png=result.png,
        level=result.level,
        strategy=0 if result.strategy is None else c.strategy_to_pb[result.strategy],
        model=result.model,
        steps_run=result.steps_run,
        start_step=result.start_step,
        cache=0 if result.cache is None else c.cache_to_pb[result.cache],
        cache_miss_reason=result.cache_miss_reason,
        similarity=result.similarity,
        timing=timing_to_pb(result.timing),
        worker_id=result.worker_id,
        substituted=result.substituted,
        scheduler=result.scheduler,
        adapter_path=result.adapter_path,
        scores=[score_to_pb(s) for s in result.scores],
        routed_step=result.routed_step,
    )
    _cache_events_to_pb(result.cache_events, message)
    return message


def result_from_pb(message: Any) -> GenerateResult:
    """A worker's ``GenerateResponse``; a strategy or cache outcome it left unset (or one
    this reader does not know) is None."""
    c = codec()
    return GenerateResult(
        request_id=message.request_id,
        png=bytes(message.png),
        level=message.level,
        strategy=c.strategy_from_pb.get(message.strategy),
        model=message.model,
        steps_run=message.steps_run,
        start_step=message.start_step,
        cache=c.cache_from_pb.get(message.cache),
        cache_miss_reason=message.cache_miss_reason,
        similarity=given(message, "similarity"),
        timing=timing_from_pb(message.timing),
        worker_id=message.worker_id,
        substituted=message.substituted,
        scheduler=message.scheduler,
        adapter_path=message.adapter_path,
        scores=tuple(score_from_pb(s) for s in message.scores),
        routed_step=message.routed_step,
        cache_events=_cache_events_from_pb(message),
    )
