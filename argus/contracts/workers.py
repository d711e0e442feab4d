"""A worker's heartbeat to the allocator and the allocator's answer (``Allocator/Heartbeat``).

The worker sends :class:`WorkerReport` (:func:`heartbeat_to_pb`) every interval; the allocator
reads it with :func:`heartbeat_from_pb`, which checks every field against the profile, and
answers :class:`HeartbeatAnswer` (:func:`heartbeat_answer_to_pb`), the level the plan gives the
worker among it, which the worker reads back with :func:`heartbeat_answer_from_pb`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from argus.contracts.wire import (
    MAX_COUNT,
    MAX_SAMPLES,
    STRATEGY_TO_PB,
    FieldError,
    address,
    allocator_pb2,
    at_most,
    at_most_chars,
    identifier,
    level_name,
    optional_strategy_from_pb,
    seconds,
    strategy_from_pb,
)
from argus.contracts.worker_control import ComponentInfo
from argus.types import ProfileSet, Strategy

MAX_PART_LOADS = 64  # parts of one load at most (SDXL has seven)
MAX_RESIDENT_PARTS = 256  # parts resident on one worker at most
MAX_PART_USERS = 64  # models sharing one part at most


@dataclass(frozen=True)
class RetrievalReport:
    """Cache retrievals a worker saw since its previous heartbeat (input of the AC↔SM switch)."""

    samples_s: tuple[float, ...] = ()  # latencies of successful retrievals, seconds
    count: int = 0  # successful retrievals when only a summary is sent (samples_s empty)
    p50_s: float = 0.0  # their median, seconds
    p99_s: float = 0.0  # their 99th percentile, seconds
    failures: int = 0  # retrievals that failed outright

    def observations(self) -> list[float | None]:
        """What :class:`~argus.allocator.strategy.StrategyMonitor` observes, failures as None.

        Samples are used as they are. A summary becomes ``count`` observations: ``ceil(1%)``
        of them at p99 and the rest at p50, so a window of summaries has about the p99 of the
        retrievals behind it.
        """
        values: list[float | None] = list(self.samples_s)
        if not values and self.count > 0:
            slow = max(1, math.ceil(0.01 * self.count))
            values = [self.p99_s] * slow
            values += [self.p50_s] * (self.count - slow)
        values.extend([None] * self.failures)
        return values


@dataclass(frozen=True)
class WorkerReport:
    """One heartbeat, already validated (:func:`heartbeat_from_pb` checks the fields)."""

    worker_id: str
    address: str  # HOST:PORT of the worker's gRPC service
    worker_class: str  # a worker class of the profile
    queue_length: int = 0  # requests waiting or running
    strategy: Strategy | None = None  # strategy served now; None: nothing loaded yet
    level: str | None = None  # level served now; None: nothing loaded yet
    model: str = ""  # active model, informational
    loaded_models: tuple[str, ...] = ()  # informational
    retrieval: RetrievalReport = field(default_factory=RetrievalReport)
    leaving: bool = False  # shutting down: remove now
    # the last model load: its model ("": none yet) and each part it loaded with its seconds
    # (a switch within a family loads the UNet only); informational, kept by the allocator
    last_load_model: str = ""
    last_load_parts: tuple[tuple[str, float], ...] = ()
    resident_parts: tuple[ComponentInfo, ...] = ()  # the parts in memory, each once


@dataclass(frozen=True)
class HeartbeatAnswer:
    """What a worker is told in reply to its heartbeat."""

    plan_version: int
    strategy: Strategy
    assigned_level: str  # "" when the worker is not in the plan
    probe_retrieval: bool  # retrieval was slow or down: send probes
    probe_interval_s: float
    heartbeat_interval_s: float
    epoch: str


# -- the allocator's side ------------------------------------------------------------------


def retrieval_from_pb(message: Any, where: str = "retrieval") -> RetrievalReport:
    samples = message.samples_s
    at_most(len(samples), MAX_SAMPLES, f"{where}.samples_s")
    return RetrievalReport(
        samples_s=tuple(seconds(s, f"{where}.samples_s[{i}]") for i, s in enumerate(samples)),
        count=at_most(message.count, MAX_COUNT, f"{where}.count"),
        p50_s=seconds(message.p50_s, f"{where}.p50_s"),
        p99_s=seconds(message.p99_s, f"{where}.p99_s"),
        failures=at_most(message.failures, MAX_COUNT, f"{where}.failures"),
    )


def part_loads_from_pb(messages: Any, where: str) -> tuple[tuple[str, float], ...]:
    at_most(len(messages), MAX_PART_LOADS, where)
    return tuple(
        (
            identifier(m.part, f"{where}[{i}].part"),
            seconds(m.seconds, f"{where}[{i}].seconds"),
        )
        for i, m in enumerate(messages)
    )


def resident_parts_from_pb(messages: Any, where: str) -> tuple[ComponentInfo, ...]:
    at_most(len(messages), MAX_RESIDENT_PARTS, where)
    parts = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        at_most(len(m.models), MAX_PART_USERS, f"{at}.models")
        parts.append(
            ComponentInfo(
                digest=identifier(m.digest, f"{at}.digest"),
                part=identifier(m.part, f"{at}.part"),
                bytes=m.bytes,
                load_s=seconds(m.load_s, f"{at}.load_s"),
                models=tuple(
                    identifier(name, f"{at}.models[{j}]") for j, name in enumerate(m.models)
                ),
            )
        )
    return tuple(parts)


def heartbeat_from_pb(message: Any, profiles: ProfileSet) -> WorkerReport:
    """A validated heartbeat; an empty ``worker_class`` is the profile's first class."""
    worker_id = identifier(message.worker_id, "worker_id")
    if message.leaving:  # a worker on its way out need not describe itself
        return WorkerReport(worker_id, message.address, "", leaving=True)
    worker_class = message.worker_class or profiles.worker_classes[0]
    if worker_class not in profiles.worker_classes:
        classes = ", ".join(profiles.worker_classes)
        raise FieldError(
            f"worker_class: {worker_class!r} is not a worker class of the profile ({classes})"
        )
    if message.queue_length < 0:
        raise FieldError(f"queue_length: must be >= 0, got {message.queue_length}")
    return WorkerReport(
        worker_id=worker_id,
        address=address(message.address, "address"),
        worker_class=worker_class,
        queue_length=message.queue_length,
        strategy=optional_strategy_from_pb(message.strategy, "strategy"),
        level=level_name(message.level, profiles, "level") if message.level else None,
        model=message.model,
        loaded_models=tuple(message.loaded_models),
        retrieval=retrieval_from_pb(message.retrieval),
        leaving=False,
        last_load_model=at_most_chars(message.last_load_model, "last_load_model"),
        last_load_parts=part_loads_from_pb(message.last_load_parts, "last_load_parts"),
        resident_parts=resident_parts_from_pb(message.resident_parts, "resident_parts"),
    )


def heartbeat_answer_to_pb(answer: HeartbeatAnswer) -> Any:
    return allocator_pb2.HeartbeatReply(
        plan_version=answer.plan_version,
        strategy=STRATEGY_TO_PB[answer.strategy],
        assigned_level=answer.assigned_level,
        probe_retrieval=answer.probe_retrieval,
        probe_interval_s=answer.probe_interval_s,
        heartbeat_interval_s=answer.heartbeat_interval_s,
        epoch=answer.epoch,
    )


# -- the worker's side ---------------------------------------------------------------------


def heartbeat_to_pb(report: WorkerReport) -> Any:
    """A ``WorkerHeartbeat`` from the worker's report."""
    r = report.retrieval
    return allocator_pb2.WorkerHeartbeat(
        worker_id=report.worker_id,
        address=report.address,
        worker_class=report.worker_class,
        queue_length=report.queue_length,
        strategy=STRATEGY_TO_PB[report.strategy] if report.strategy is not None else 0,
        level=report.level or "",
        model=report.model,
        loaded_models=list(report.loaded_models),
        retrieval=allocator_pb2.RetrievalReport(
            samples_s=list(r.samples_s),
            count=r.count,
            p50_s=r.p50_s,
            p99_s=r.p99_s,
            failures=r.failures,
        ),
        leaving=report.leaving,
        last_load_model=report.last_load_model,
        last_load_parts=[
            allocator_pb2.PartLoad(part=part, seconds=s) for part, s in report.last_load_parts
        ],
        resident_parts=[
            allocator_pb2.ResidentPart(
                digest=c.digest, part=c.part, bytes=c.bytes, load_s=c.load_s, models=c.models
            )
            for c in report.resident_parts
        ],
    )


def heartbeat_answer_from_pb(message: Any) -> HeartbeatAnswer:
    """What the allocator answered."""
    return HeartbeatAnswer(
        plan_version=message.plan_version,
        strategy=strategy_from_pb(message.strategy, "strategy"),
        assigned_level=message.assigned_level,
        probe_retrieval=message.probe_retrieval,
        probe_interval_s=message.probe_interval_s,
        heartbeat_interval_s=message.heartbeat_interval_s,
        epoch=message.epoch,
    )
