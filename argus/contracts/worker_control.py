"""The Worker service's Stats and Configure calls (``argus.v1.Worker/Stats``, ``Configure``):
their values and both halves of their conversion.

The allocator configures a worker (:class:`ConfigureCall`: a level, a strategy, a model
variant to load) and reads back what it holds (:class:`ModelInfo` per model, in a
``ConfigureResponse``); anyone may ask a worker for its counters (:class:`WorkerStats`, a
``StatsResponse``). The worker's engine produces these values and its servicer only converts
them here; Generate has its own contract (:mod:`argus.contracts.generate`).

A worker's cache is its own business: the stats carry its snapshot as it is
(:class:`CacheCounters` names what the message reads of it), so this module imports nothing of
``argus.worker``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from argus.contracts.wire import STRATEGY_FROM_PB, STRATEGY_TO_PB, pb_numbers
from argus.plumbing import rpc
from argus.types import Strategy

worker_pb2: Any = rpc.load("worker_pb2")


class LoadState(enum.Enum):
    """Where a model stands on a worker (``argus.v1.ModelState.State``)."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


_STATE_TO_PB = pb_numbers(LoadState, worker_pb2.ModelState.State)


@dataclass(frozen=True)
class ModelInfo:
    """One model a worker holds or is loading (``argus.v1.ModelState``)."""

    name: str
    source: str  # a tiny model's catalog name or a diffusers-format directory
    state: LoadState
    load_s: float  # how long its load took (0 until it is loaded)
    bytes: int  # its parameters' bytes: estimated while it loads, measured once loaded
    active: bool  # the model that serves the worker's level
    error: str = ""  # why its load failed (FAILED)
    # the parts its load loaded, and the load time of each (seconds); the parts it shares with
    # a model already resident are not among them
    loaded_parts: dict[str, float] = field(default_factory=dict)
    compile_s: float = 0.0  # torch.compile and its warm-up run (--compile), part of load_s


@dataclass(frozen=True)
class ComponentInfo:
    """One part resident on a worker (a text encoder, tokenizer, UNet or VAE), shared by every
    model whose part has the same weights (``argus.worker.models.components``)."""

    digest: str  # SHA-256 of its weights (a tokenizer's: of its vocabulary)
    part: str  # the part name it was first loaded as
    bytes: int  # its parameters' bytes, counted once however many models use it
    load_s: float  # how long its load took
    models: tuple[str, ...]  # the models that use it


class CacheCounters(Protocol):
    """What the Stats message reads of a worker's approximate-cache snapshot
    (:class:`argus.worker.approx_cache.cache.CacheStats`); seconds, counts since the cache
    started."""

    @property
    def entries(self) -> int: ...
    @property
    def bytes(self) -> int: ...  # latent bytes of all entries
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> dict[str, int]: ...  # by reason
    @property
    def search_p50_s(self) -> float: ...
    @property
    def search_p99_s(self) -> float: ...
    @property
    def fetch_p50_s(self) -> float: ...
    @property
    def fetch_p99_s(self) -> float: ...


@dataclass(frozen=True)
class WorkerStats:
    """A worker's counters since it started, and what it serves now (``StatsResponse``)."""

    worker_id: str
    strategy: Strategy
    level: str
    queue_length: int
    completed: int
    failed: int
    substituted: int
    models: list[ModelInfo]
    cache: CacheCounters | None  # the cache's own snapshot; None without a cache
    memory_budget_bytes: int
    memory_used_bytes: int
    dropped_inserts: int
    # requests stopped by their token: reason ("cancelled", "expired") → stage → count, where
    # "queued" ones never ran and "running" ones stopped at a step boundary
    stopped: dict[str, dict[str, int]] = field(default_factory=dict)
    denoise_runs: int = 0  # denoising loops started (warm-up included)
    denoise_steps: int = 0  # denoising steps run (warm-up included)
    decodes: int = 0  # images decoded (warm-up included)
    # requests stopped because their decode could not finish before their deadline (on
    # arrival, in the queue, or after denoising); also counted in stopped
    decodes_skipped: int = 0
    components: list[ComponentInfo] = field(default_factory=list)  # resident parts

    @property
    def cancelled(self) -> int:
        return sum(self.stopped.get("cancelled", {}).values())

    @property
    def expired(self) -> int:
        return sum(self.stopped.get("expired", {}).values())


@dataclass(frozen=True)
class ConfigureCall:
    """What the allocator asks of a worker (``ConfigureRequest``); "" and None leave the
    worker's current choice."""

    strategy: Strategy | None = None  # None: the level's strategy
    level: str = ""  # the worker's default level from now on
    variant: str = ""  # the model to load and activate; "": the level's model
    wait: bool = False  # answer after the load, not when it starts


# -- Configure -----------------------------------------------------------------------------


def configure_from_pb(message: Any) -> ConfigureCall:
    """A ``ConfigureRequest``; an unset or unknown strategy is None (the level's applies)."""
    return ConfigureCall(
        strategy=STRATEGY_FROM_PB.get(message.strategy),
        level=message.level,
        variant=message.variant,
        wait=message.wait,
    )


def configured_to_pb(stats: WorkerStats) -> Any:
    """The ``ConfigureResponse``: what the worker serves once configured, and its models."""
    return worker_pb2.ConfigureResponse(
        strategy=STRATEGY_TO_PB[stats.strategy],
        level=stats.level,
        models=[model_to_pb(m) for m in stats.models],
    )


def model_to_pb(info: ModelInfo) -> Any:
    return worker_pb2.ModelState(
        name=info.name,
        source=info.source,
        state=_STATE_TO_PB[info.state],
        load_s=info.load_s,
        bytes=info.bytes,
        active=info.active,
        error=info.error,
        compile_s=info.compile_s,
    )


# -- Stats ---------------------------------------------------------------------------------


def stats_to_pb(stats: WorkerStats) -> Any:
    cache = stats.cache
    message = worker_pb2.StatsResponse(
        worker_id=stats.worker_id,
        strategy=STRATEGY_TO_PB[stats.strategy],
        level=stats.level,
        queue_length=stats.queue_length,
        completed=stats.completed,
        failed=stats.failed,
        substituted=stats.substituted,
        models=[model_to_pb(m) for m in stats.models],
        memory_budget_bytes=stats.memory_budget_bytes,
        memory_used_bytes=stats.memory_used_bytes,
        cancelled_queued=stats.stopped.get("cancelled", {}).get("queued", 0),
        cancelled_running=stats.stopped.get("cancelled", {}).get("running", 0),
        expired_queued=stats.stopped.get("expired", {}).get("queued", 0),
        expired_running=stats.stopped.get("expired", {}).get("running", 0),
        denoise_steps=stats.denoise_steps,
    )
    if cache is not None:
        message.search_p50_ms = cache.search_p50_s * 1e3
        message.search_p99_ms = cache.search_p99_s * 1e3
        message.fetch_p50_ms = cache.fetch_p50_s * 1e3
        message.fetch_p99_ms = cache.fetch_p99_s * 1e3
        message.cache_entries = cache.entries
        message.cache_bytes = cache.bytes
        message.cache_hits = cache.hits
        message.cache_misses = sum(cache.misses.values())
    return message
