"""The plan as routers receive it (``Allocator/WatchPlan``, ``Allocator/GetPlan``).

The allocator publishes a :class:`PublishedPlan` with every plan it makes: the
:class:`~argus.types.Plan` (strategy, workers per level, load shares F, and the PASM), where
each live worker is reached and why the plan was made. :func:`plan_to_pb` writes it as a
``PlanUpdate`` and :func:`plan_from_pb` reads it back exactly, so a router installs the very
values the allocator computed.

The PASM has one owner, the allocator: routers sample the published rows as they are and never
re-align them between plans (see ``argus.router.routing``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from argus.contracts.wire import (
    STRATEGY_TO_PB,
    FieldError,
    allocator_pb2,
    pb_numbers,
    strategy_from_pb,
)
from argus.types import Allocation, LoadForecast, Plan, ShiftMap


class ReplanReason(enum.StrEnum):
    """Why a plan was made (a bounded label for metrics)."""

    STARTUP = "startup"
    PERIODIC = "periodic"
    WORKER_JOINED = "worker_joined"
    WORKER_LEFT = "worker_left"
    WORKER_DEAD = "worker_dead"
    STRATEGY_SWITCH = "strategy_switch"
    BACKLOG = "backlog"
    LOAD_SURGE = "load_surge"


REASON_TO_PB = pb_numbers(ReplanReason, allocator_pb2.PlanReason, lambda r: f"PLAN_REASON_{r.name}")
REASON_FROM_PB = {v: k for k, v in REASON_TO_PB.items()}


@dataclass(frozen=True)
class PlannedWorker:
    """A live worker in a published plan: where routers reach it and what it serves."""

    worker_id: str
    address: str  # HOST:PORT of its argus.v1.Worker service
    worker_class: str
    level: str  # the level the plan gives it
    queue_length: int  # as last reported


@dataclass(frozen=True)
class PublishedPlan:
    """A plan as routers receive it: the allocator's :class:`~argus.types.Plan` plus where
    its workers are and why it was made. Round-trips through ``PlanUpdate`` exactly."""

    epoch: str  # the allocator process's incarnation; versions restart with a new one
    plan: Plan
    reason: ReplanReason
    detail: str  # human-readable cause, e.g. "worker w3 joined"
    workers: tuple[PlannedWorker, ...]  # every live worker, sorted by id
    load_margin: float  # factor on the forecast beyond the allocator's headroom
    retrieval_healthy: bool  # False: AC is not allowed (SM by force)

    @property
    def version(self) -> int:
        return self.plan.version

    def worker_classes(self) -> dict[str, str]:
        """worker id → worker class, what ``PlanRouter.install`` takes with the plan."""
        return {w.worker_id: w.worker_class for w in self.workers}


def plan_to_pb(published: PublishedPlan) -> Any:
    """The ``PlanUpdate`` routers receive; :func:`plan_from_pb` reverses it exactly."""
    plan = published.plan
    a = plan.allocation
    levels = [
        allocator_pb2.LevelPlan(
            name=name,
            workers=a.workers_per_level[i],
            load_share_qpm=a.load_share_qpm[i],
            affinity=plan.histogram[i],
            pasm_row=plan.shift_map.row(i),
        )
        for i, name in enumerate(a.levels)
    ]
    workers = [
        allocator_pb2.WorkerAssignment(
            worker_id=w.worker_id,
            address=w.address,
            worker_class=w.worker_class,
            level=w.level,
            queue_length=w.queue_length,
        )
        for w in published.workers
    ]
    f = plan.forecast
    return allocator_pb2.PlanUpdate(
        epoch=published.epoch,
        version=plan.version,
        strategy=STRATEGY_TO_PB[plan.strategy],
        reason=REASON_TO_PB[published.reason],
        reason_detail=published.detail,
        created_at_s=plan.created_at_s,
        levels=levels,
        workers=workers,
        forecast=allocator_pb2.LoadForecast(
            qpm=f.qpm, ewma_qpm=f.ewma_qpm, peak_qpm=f.peak_qpm, at_s=f.at_s
        ),
        allocation=allocator_pb2.AllocationSummary(
            objective=a.objective,
            switch_cost=a.switch_cost,
            served_qpm=a.served_qpm,
            shortfall_qpm=a.shortfall_qpm,
            moved_workers=a.moved_workers,
            solve_ms=a.solve_ms,
            load_margin=published.load_margin,
        ),
        retrieval_healthy=published.retrieval_healthy,
    )


def plan_from_pb(message: Any) -> PublishedPlan:
    """Rebuild the published plan from a ``PlanUpdate`` (the router's side).

    Raises :class:`~argus.contracts.wire.FieldError` on an update that cannot be a plan (an
    unknown strategy, a PASM row of the wrong length), so a router can refuse it and keep its
    last plan.
    """
    strategy = strategy_from_pb(message.strategy, "strategy")
    names = tuple(level.name for level in message.levels)
    for i, level in enumerate(message.levels):
        if len(level.pasm_row) != len(names):
            raise FieldError(
                f"levels[{i}].pasm_row: expected {len(names)} values, got {len(level.pasm_row)}"
            )
    workers = tuple(
        PlannedWorker(w.worker_id, w.address, w.worker_class, w.level, w.queue_length)
        for w in message.workers
    )
    s = message.allocation
    allocation = Allocation(
        strategy=strategy,
        levels=names,
        workers_per_level=tuple(level.workers for level in message.levels),
        load_share_qpm=tuple(level.load_share_qpm for level in message.levels),
        assignment={w.worker_id: w.level for w in workers},
        objective=s.objective,
        switch_cost=s.switch_cost,
        served_qpm=s.served_qpm,
        shortfall_qpm=s.shortfall_qpm,
        moved_workers=s.moved_workers,
        solve_ms=s.solve_ms,
    )
    f = message.forecast
    plan = Plan(
        version=message.version,
        strategy=strategy,
        allocation=allocation,
        shift_map=ShiftMap(names, tuple(_floats(level.pasm_row) for level in message.levels)),
        forecast=LoadForecast(qpm=f.qpm, ewma_qpm=f.ewma_qpm, peak_qpm=f.peak_qpm, at_s=f.at_s),
        histogram=tuple(level.affinity for level in message.levels),
        created_at_s=message.created_at_s,
    )
    return PublishedPlan(
        epoch=message.epoch,
        plan=plan,
        reason=REASON_FROM_PB.get(message.reason, ReplanReason.PERIODIC),
        detail=message.reason_detail,
        workers=workers,
        load_margin=s.load_margin,
        retrieval_healthy=message.retrieval_healthy,
    )


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)
