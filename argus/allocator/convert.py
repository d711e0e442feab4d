"""``argus.v1.Allocator`` messages ↔ the control plane's values, and the checks on the way in.

The one place that knows both the protobuf messages and the dataclasses (STYLE 7): the
servicer calls the readers of requests (``heartbeat_from_pb``, ``router_report_from_pb``),
which only raise :class:`FieldError` (message ``"<field path>: <what is wrong>"``, mapped to
INVALID_ARGUMENT) and never fix input up, and the writers of replies. The clients' halves
live here too (``heartbeat_to_pb``, ``router_report_to_pb``, ``*_answer_from_pb``): routers
use :func:`plan_from_pb` to turn a ``PlanUpdate`` back into the
:class:`~argus.allocator.control.PublishedPlan` the allocator published, whose ``plan``
``PlanRouter.install`` takes as it is (together with ``worker_classes()``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from argus import rpc
from argus.allocator.control import (
    HeartbeatAnswer,
    PlannedWorker,
    PublishedPlan,
    ReplanReason,
    RouterAnswer,
    RouterReport,
)
from argus.allocator.membership import RetrievalReport, WorkerReport
from argus.types import (
    Allocation,
    ClassQuality,
    LoadForecast,
    Plan,
    ProfileSet,
    ShiftMap,
    Strategy,
)

allocator_pb2: Any = rpc.load("allocator_pb2")

MAX_ID_CHARS = 256
MAX_ARRIVALS = 100_000  # per router report: 1 s of 100k requests/s
MAX_CLASSIFIED = 100_000  # level names per strategy per router report
MAX_SAMPLES = 4096  # retrieval samples per heartbeat
MAX_COUNT = 100_000  # retrievals (summarised or failed) per heartbeat

STRATEGY_TO_PB = {Strategy.AC: 1, Strategy.SM: 2}
STRATEGY_FROM_PB = {v: k for k, v in STRATEGY_TO_PB.items()}
REASON_TO_PB = {
    ReplanReason.STARTUP: 1,
    ReplanReason.PERIODIC: 2,
    ReplanReason.WORKER_JOINED: 3,
    ReplanReason.WORKER_LEFT: 4,
    ReplanReason.WORKER_DEAD: 5,
    ReplanReason.STRATEGY_SWITCH: 6,
    ReplanReason.BACKLOG: 7,
    ReplanReason.LOAD_SURGE: 8,
}
REASON_FROM_PB = {v: k for k, v in REASON_TO_PB.items()}


class FieldError(ValueError):
    """Bad input; the message starts with the field's path."""


# -- checks --------------------------------------------------------------------------------


def _identifier(value: str, where: str) -> str:
    if not value.strip():
        raise FieldError(f"{where}: must not be empty")
    return _at_most_chars(value, where)


def _at_most_chars(value: str, where: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise FieldError(f"{where}: at most {MAX_ID_CHARS} characters, got {len(value)}")
    return value


def _address(value: str, where: str) -> str:
    host, sep, port = _identifier(value, where).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FieldError(f"{where}: expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


def _seconds(value: float, where: str) -> float:
    if not (math.isfinite(value) and value >= 0.0):
        raise FieldError(f"{where}: must be a finite number >= 0, got {value}")
    return float(value)


def _at_most(value: int, limit: int, where: str) -> int:
    if value > limit:
        raise FieldError(f"{where}: at most {limit}, got {value}")
    return int(value)


def _strategy(value: int, where: str, *, optional: bool = False) -> Strategy | None:
    if value == 0 and optional:
        return None
    try:
        return STRATEGY_FROM_PB[value]
    except KeyError:
        raise FieldError(f"{where}: expected AC or SM, got {value}") from None


def _level_name(value: str, profiles: ProfileSet, where: str) -> str:
    if all(level.name != value for level in profiles.levels):
        names = ", ".join(level.name for level in profiles.levels)
        raise FieldError(f"{where}: {value!r} is not a level of the profile ({names})")
    return value


# -- workers -------------------------------------------------------------------------------


def retrieval_from_pb(message: Any, where: str = "retrieval") -> RetrievalReport:
    samples = message.samples_s
    _at_most(len(samples), MAX_SAMPLES, f"{where}.samples_s")
    return RetrievalReport(
        samples_s=tuple(_seconds(s, f"{where}.samples_s[{i}]") for i, s in enumerate(samples)),
        count=_at_most(message.count, MAX_COUNT, f"{where}.count"),
        p50_s=_seconds(message.p50_s, f"{where}.p50_s"),
        p99_s=_seconds(message.p99_s, f"{where}.p99_s"),
        failures=_at_most(message.failures, MAX_COUNT, f"{where}.failures"),
    )


def heartbeat_from_pb(message: Any, profiles: ProfileSet) -> WorkerReport:
    """A validated heartbeat; an empty ``worker_class`` is the profile's first class."""
    worker_id = _identifier(message.worker_id, "worker_id")
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
        address=_address(message.address, "address"),
        worker_class=worker_class,
        queue_length=message.queue_length,
        strategy=_strategy(message.strategy, "strategy", optional=True),
        level=_level_name(message.level, profiles, "level") if message.level else None,
        model=message.model,
        loaded_models=tuple(message.loaded_models),
        retrieval=retrieval_from_pb(message.retrieval),
        leaving=False,
    )


def heartbeat_to_pb(report: WorkerReport) -> Any:
    """The worker's side: a ``WorkerHeartbeat`` from its report."""
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
    )


def heartbeat_answer_from_pb(message: Any) -> HeartbeatAnswer:
    """The worker's side: what the allocator answered."""
    strategy = _strategy(message.strategy, "strategy")
    assert strategy is not None
    return HeartbeatAnswer(
        plan_version=message.plan_version,
        strategy=strategy,
        assigned_level=message.assigned_level,
        probe_retrieval=message.probe_retrieval,
        probe_interval_s=message.probe_interval_s,
        heartbeat_interval_s=message.heartbeat_interval_s,
        epoch=message.epoch,
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


# -- routers -------------------------------------------------------------------------------


def router_report_from_pb(message: Any, profiles: ProfileSet) -> RouterReport:
    """A validated router report with level names resolved to indices (slowest first)."""
    arrivals = _at_most(message.arrivals, MAX_ARRIVALS, "arrivals")
    ages = message.arrival_ages_s
    if ages and len(ages) != arrivals:
        raise FieldError(
            f"arrival_ages_s: expected one age per arrival ({arrivals}), got {len(ages)}"
        )
    classified = []
    for i, entry in enumerate(message.classified):
        where = f"classified[{i}]"
        strategy = _strategy(entry.strategy, f"{where}.strategy")
        assert strategy is not None
        classified.append((strategy, _level_indices(entry.levels, strategy, profiles, where)))
    return RouterReport(
        router_id=_identifier(message.router_id, "router_id"),
        sequence=message.sequence,
        arrivals=arrivals,
        arrival_ages_s=tuple(_seconds(a, f"arrival_ages_s[{i}]") for i, a in enumerate(ages)),
        classified=tuple(classified),
        replan_wanted=message.replan_wanted,
        classifier=_at_most_chars(message.classifier, "classifier"),
        class_quality=tuple(
            class_quality_from_pb(entry, profiles, f"class_quality[{i}]")
            for i, entry in enumerate(message.class_quality)
        ),
    )


def class_quality_from_pb(message: Any, profiles: ProfileSet, where: str) -> ClassQuality:
    """A reported Q(v | c), checked against the profile: its levels must be the strategy's
    levels in order (the planner indexes classes by them), its table n × n and its values
    finite and >= 0. FieldError names the field."""
    strategy = _strategy(message.strategy, f"{where}.strategy")
    assert strategy is not None
    expected = tuple(level.name for level in profiles.levels_for(strategy))
    levels = tuple(message.levels)
    if levels != expected:
        raise FieldError(
            f"{where}.levels: expected the profile's {strategy} levels {', '.join(expected)}, "
            f"got {', '.join(levels) or 'none'}"
        )
    n = len(levels)
    if len(message.quality) != n * n:
        raise FieldError(
            f"{where}.quality: expected {n} × {n} = {n * n} values, got {len(message.quality)}"
        )
    for name, values in (("quality", message.quality), ("prior", message.prior)):
        for j, value in enumerate(values):
            if not (math.isfinite(value) and value >= 0.0):
                raise FieldError(f"{where}.{name}[{j}]: must be finite and >= 0, got {value}")
    if len(message.prior) != n:
        raise FieldError(f"{where}.prior: expected {n} values, got {len(message.prior)}")
    rows = tuple(tuple(float(x) for x in message.quality[c * n : (c + 1) * n]) for c in range(n))
    source = _at_most_chars(message.source, f"{where}.source")
    return ClassQuality(strategy, levels, rows, tuple(float(p) for p in message.prior), source)


def class_quality_to_pb(quality: ClassQuality) -> Any:
    """The router's side of :func:`class_quality_from_pb`."""
    return allocator_pb2.ReportedClassQuality(
        strategy=STRATEGY_TO_PB[quality.strategy],
        levels=list(quality.levels),
        quality=[value for row in quality.quality for value in row],
        prior=list(quality.prior),
        source=quality.source[:MAX_ID_CHARS],
    )


def _level_indices(
    names: Sequence[str], strategy: Strategy, profiles: ProfileSet, where: str
) -> tuple[int, ...]:
    _at_most(len(names), MAX_CLASSIFIED, f"{where}.levels")
    index = {level.name: i for i, level in enumerate(profiles.levels_for(strategy))}
    result = []
    for j, name in enumerate(names):
        found = index.get(name)
        if found is None:
            known = ", ".join(index) or "none"
            raise FieldError(
                f"{where}.levels[{j}]: {name!r} is not a {strategy} level of the profile ({known})"
            )
        result.append(found)
    return tuple(result)


def router_report_to_pb(
    router_id: str,
    *,
    sequence: int = 0,
    arrival_ages_s: Sequence[float] = (),
    classified: Mapping[Strategy, Sequence[str]] | None = None,
    replan_wanted: bool = False,
    classifier: str = "",
) -> Any:
    """The router's side: a ``RouterReport`` of the arrivals since its last one (each given by
    its age, seconds before sending), the level names its classifiers chose and the identity
    of those classifiers."""
    return allocator_pb2.RouterReport(
        router_id=router_id,
        sequence=sequence,
        arrivals=len(arrival_ages_s),
        arrival_ages_s=list(arrival_ages_s),
        classified=[
            allocator_pb2.ClassifiedLevels(strategy=STRATEGY_TO_PB[s], levels=list(levels))
            for s, levels in (classified or {}).items()
        ],
        replan_wanted=replan_wanted,
        classifier=classifier,
    )


def router_answer_from_pb(message: Any) -> RouterAnswer:
    return RouterAnswer(plan_version=message.plan_version, duplicate=message.duplicate)


def router_answer_to_pb(answer: RouterAnswer) -> Any:
    return allocator_pb2.RouterReportReply(
        plan_version=answer.plan_version, duplicate=answer.duplicate
    )


# -- plans ---------------------------------------------------------------------------------


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

    Raises :class:`FieldError` on an update that cannot be a plan (an unknown strategy, a
    PASM row of the wrong length), so a router can refuse it and keep its last plan.
    """
    strategy = _strategy(message.strategy, "strategy")
    assert strategy is not None
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
