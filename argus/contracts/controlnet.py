"""The ControlNet service's plain values (``argus.v1.ControlNet``) and their conversions.

A worker opens one stream per request to the shared ControlNet service
(:mod:`argus.worker.adapters.controlnet`); what crosses it without a tensor is defined here, once,
for
the service and the client alike: a request's ControlNets (:class:`ControlUnit`, carried as
``argus.v1.Adapter`` entries of kind CONTROLNET), what opening the session cost
(:class:`OpenInfo`), and the service's counters (:class:`ExecutorStats` with its model
cache's :class:`CacheStats`).

The messages that carry tensors (the session's text conditioning, each step's UNet input,
the residuals) convert in the ControlNet package's tensor codec,
:mod:`argus.worker.adapters.controlnet.transport`, which builds them around the conversions here.
This
module imports neither torch nor that package, so the values read without either.

Readers raise :class:`~argus.contracts.wire.FieldError` naming the field
(``controlnets[1].kind``); the codec turns it into the ControlNet path's own
``InvalidControlNetRequest`` (INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from argus.contracts.wire import FieldError
from argus.plumbing import rpc

common_pb2: Any = rpc.load("common_pb2")
controlnet_pb2: Any = rpc.load("controlnet_pb2")

# the kinds a ControlNet entry may have, by name: CONTROLNET, or unset (the service runs
# ControlNets only, so an entry that names no kind is one)
_CONTROLNET_KINDS = (common_pb2.Adapter.CONTROLNET, common_pb2.Adapter.KIND_UNSPECIFIED)


@dataclass(frozen=True)
class ControlUnit:
    """One ControlNet of a request: its name, conditioning scale and control image (PNG)."""

    name: str
    scale: float = 1.0
    image: bytes = b""


@dataclass(frozen=True)
class OpenInfo:
    """What opening a session cost: which ControlNets were resident, how long loads took."""

    cache_hits: tuple[bool, ...]
    load_s: float


@dataclass(frozen=True)
class CacheStats:
    """The service's model cache: counters since it started, and what is resident now."""

    policy: str
    hits: int  # acquires that found the key resident
    misses: int  # acquires that did not (including those that joined a load in flight)
    loads: int  # loads started (one per cold key and burst of requests for it)
    load_failures: int
    evictions: int
    load_seconds: float  # total time spent in loads
    resident: tuple[str, ...]  # keys, most recently used last
    resident_bytes: int
    leased: int  # resident entries in use by a request now (not sent over the wire)


@dataclass(frozen=True)
class ExecutorStats:
    """An executor's model cache and its sessions, since it started."""

    cache: CacheStats
    sessions_open: int
    sessions_total: int
    steps_total: int


# -- a request's ControlNets ---------------------------------------------------------------


def units_to_pb(units: Iterable[ControlUnit]) -> list[Any]:
    return [
        common_pb2.Adapter(
            kind=common_pb2.Adapter.CONTROLNET, name=u.name, scale=u.scale, control_image=u.image
        )
        for u in units
    ]


def units_from_pb(adapters: Sequence[Any]) -> tuple[ControlUnit, ...]:
    """The ControlNets of a ``ControlNetOpen``; an entry of another kind raises naming it."""
    units = []
    for i, adapter in enumerate(adapters):
        if adapter.kind not in _CONTROLNET_KINDS:
            raise FieldError(
                f"controlnets[{i}].kind: not a ControlNet (this service runs ControlNets only)"
            )
        # proto3 cannot tell an unset scale from 0; unset means diffusers' default, 1
        units.append(ControlUnit(adapter.name, adapter.scale or 1.0, bytes(adapter.control_image)))
    return tuple(units)


# -- replies -------------------------------------------------------------------------------


def opened_to_pb(info: OpenInfo) -> Any:
    return controlnet_pb2.ControlNetReply(
        opened=controlnet_pb2.ControlNetOpened(
            cache_hits=list(info.cache_hits), load_ms=info.load_s * 1e3
        )
    )


def opened_from_pb(message: Any) -> OpenInfo:
    return OpenInfo(tuple(message.cache_hits), message.load_ms / 1e3)


def stats_to_pb(stats: ExecutorStats) -> Any:
    cache = stats.cache
    return controlnet_pb2.ControlNetStatsResponse(
        policy=cache.policy,
        resident=list(cache.resident),
        resident_bytes=cache.resident_bytes,
        hits=cache.hits,
        misses=cache.misses,
        loads=cache.loads,
        load_failures=cache.load_failures,
        evictions=cache.evictions,
        sessions_open=stats.sessions_open,
        sessions_total=stats.sessions_total,
        steps_total=stats.steps_total,
        load_seconds_total=cache.load_seconds,
    )


def stats_from_pb(message: Any) -> ExecutorStats:
    cache = CacheStats(
        policy=message.policy,
        hits=message.hits,
        misses=message.misses,
        loads=message.loads,
        load_failures=message.load_failures,
        evictions=message.evictions,
        load_seconds=message.load_seconds_total,
        resident=tuple(message.resident),
        resident_bytes=message.resident_bytes,
        leased=0,  # not reported over the wire
    )
    return ExecutorStats(cache, message.sessions_open, message.sessions_total, message.steps_total)
