"""A router's statistics for the allocator and their acknowledgement (``Allocator/ReportRouter``).

Every report period a router sends the arrivals since its last report (each by its age and,
optionally, by its weight in full requests: :attr:`RouterReport.arrival_costs`), the classes
its classifiers chose, whether its queues call for an early re-plan and which classifier it
runs: one :class:`RouterReport`, sent with :func:`router_report_to_pb`, which names each class
by its level's name. The allocator reads it with :func:`router_report_from_pb`, which resolves
the names to indices of its profile, and answers :class:`RouterAnswer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from argus.contracts.cache_outlook import BinCounts, CacheOutlook
from argus.contracts.wire import (
    MAX_ARRIVALS,
    MAX_CLASSIFIED,
    MAX_ID_CHARS,
    STRATEGY_TO_PB,
    FieldError,
    allocator_pb2,
    at_most,
    at_most_chars,
    identifier,
    seconds,
    strategy_from_pb,
)
from argus.types import ClassQuality, MeasuredLatency, ProfileSet, Strategy

MAX_MEASURED = 4096  # measured latencies per report: every (class, level) of a large profile
MAX_BINS = 64  # similarity bins of one level's cache lookups (a rule's floors plus one)
# an arrival's weight is a share of one full request (an edit's share of a batched step)
MAX_ARRIVAL_COST = 1.0


@dataclass(frozen=True)
class RouterReport:
    """A router's statistics, validated (level names already turned into indices)."""

    router_id: str
    sequence: int = 0  # 0: no de-duplication
    arrivals: int = 0
    arrival_ages_s: tuple[float, ...] = ()  # empty, or one age per arrival
    classified: tuple[tuple[Strategy, tuple[int, ...]], ...] = ()  # class indices, oldest first
    replan_wanted: bool = False
    classifier: str = ""  # classifier_key of the router's classifier; "": not said
    # Q(v | c) of strategies the router retrained since it started (drift retraining)
    class_quality: tuple[ClassQuality, ...] = ()
    # level latencies measured on the router's workers (argus.router.service_times)
    measured: tuple[MeasuredLatency, ...] = ()
    # empty (every arrival weighs 1), or one weight per arrival in the order of
    # arrival_ages_s: what it costs in full requests, in (0, MAX_ARRIVAL_COST]. An inpainting
    # edit on workers that batch edits with the mask-aware activation cache weighs its share
    # of a batched step by the edit cost model (InstGenIE §4.4; argus.router.edit_loads.
    # arrival_cost); the allocator's demand is the sum of the weights (AllocatorControl).
    arrival_costs: tuple[float, ...] = ()
    # the router's probes of its workers' caches, per AC level and similarity bin
    # (argus.router.cache_mirror): what AC would find; empty: none probed
    cache_lookups: CacheOutlook = field(default_factory=CacheOutlook)

    def arrival_weights(self) -> tuple[float, ...]:
        """One weight per arrival, in the order of :attr:`arrival_ages_s` (1 each when the
        router sent none)."""
        return self.arrival_costs or (1.0,) * self.arrivals


@dataclass(frozen=True)
class RouterAnswer:
    plan_version: int  # the plan in force when the report was counted
    duplicate: bool  # a retried report, counted before


# -- the allocator's side ------------------------------------------------------------------


def router_report_from_pb(message: Any, profiles: ProfileSet) -> RouterReport:
    """A validated router report with level names resolved to indices (slowest first)."""
    arrivals = at_most(message.arrivals, MAX_ARRIVALS, "arrivals")
    ages = message.arrival_ages_s
    if ages and len(ages) != arrivals:
        raise FieldError(
            f"arrival_ages_s: expected one age per arrival ({arrivals}), got {len(ages)}"
        )
    costs = message.arrival_costs
    if costs and len(costs) != arrivals:
        raise FieldError(
            f"arrival_costs: expected one weight per arrival ({arrivals}), got {len(costs)}"
        )
    classified = []
    for i, entry in enumerate(message.classified):
        where = f"classified[{i}]"
        strategy = strategy_from_pb(entry.strategy, f"{where}.strategy")
        classified.append((strategy, _level_indices(entry.levels, strategy, profiles, where)))
    return RouterReport(
        router_id=identifier(message.router_id, "router_id"),
        sequence=message.sequence,
        arrivals=arrivals,
        arrival_ages_s=tuple(seconds(a, f"arrival_ages_s[{i}]") for i, a in enumerate(ages)),
        classified=tuple(classified),
        replan_wanted=message.replan_wanted,
        classifier=at_most_chars(message.classifier, "classifier"),
        class_quality=tuple(
            class_quality_from_pb(entry, profiles, f"class_quality[{i}]")
            for i, entry in enumerate(message.class_quality)
        ),
        measured=tuple(
            measured_from_pb(entry, profiles, f"measured[{i}]")
            for i, entry in enumerate(message.measured[: _measured_count(message)])
        ),
        arrival_costs=tuple(_cost(c, f"arrival_costs[{i}]") for i, c in enumerate(costs)),
        cache_lookups=cache_lookups_from_pb(message.cache_lookups, profiles),
    )


def cache_lookups_from_pb(entries: Sequence[Any], profiles: ProfileSet) -> CacheOutlook:
    """A report's cache probes, checked: each entry an AC level of the profile, once; 1 to
    :data:`MAX_BINS` bins, as many sums as counts, all finite, counts >= 0. FieldError names
    the field."""
    ac = {level.name for level in profiles.levels_for(Strategy.AC)}
    levels: dict[str, BinCounts] = {}
    for i, entry in enumerate(entries):
        where = f"cache_lookups[{i}]"
        if entry.level not in ac:
            raise FieldError(
                f"{where}.level: {entry.level[:MAX_ID_CHARS]!r} is not an AC level of the profile"
            )
        if entry.level in levels:
            raise FieldError(f"{where}.level: {entry.level!r} appears twice")
        counts, sums = tuple(entry.counts), tuple(entry.similarity_sums)
        if not 1 <= len(counts) <= MAX_BINS or len(sums) != len(counts):
            raise FieldError(
                f"{where}: expected 1 to {MAX_BINS} counts and as many similarity_sums, got "
                f"{len(counts)} and {len(sums)}"
            )
        for name, values, least in (("counts", counts, 0.0), ("similarity_sums", sums, -math.inf)):
            for j, value in enumerate(values):
                if not (math.isfinite(value) and value >= least):
                    rule = "finite and >= 0" if least == 0.0 else "finite"
                    raise FieldError(f"{where}.{name}[{j}]: must be {rule}, got {value}")
        levels[entry.level] = BinCounts(counts, sums)
    return CacheOutlook(levels)


def cache_lookups_to_pb(outlook: CacheOutlook) -> list[Any]:
    """The router's side of :func:`cache_lookups_from_pb`."""
    return [
        allocator_pb2.CacheLookups(
            level=level, counts=list(row.counts), similarity_sums=list(row.similarity_sums)
        )
        for level, row in sorted(outlook.levels.items())
    ]


def _cost(value: float, where: str) -> float:
    """An arrival's weight: finite, > 0 and at most :data:`MAX_ARRIVAL_COST`; FieldError
    names the field."""
    if not (math.isfinite(value) and 0.0 < value <= MAX_ARRIVAL_COST):
        raise FieldError(f"{where}: must be finite, > 0 and <= {MAX_ARRIVAL_COST:g}, got {value}")
    return float(value)


def _measured_count(message: Any) -> int:
    return at_most(len(message.measured), MAX_MEASURED, "measured")


def measured_from_pb(message: Any, profiles: ProfileSet, where: str) -> MeasuredLatency:
    """A measured latency, checked against the profile: a known class and level, a finite
    latency > 0. FieldError names the field."""
    if message.worker_class not in profiles.worker_classes:
        raise FieldError(
            f"{where}.worker_class: {message.worker_class[:MAX_ID_CHARS]!r} is not a class of "
            f"the profile ({', '.join(profiles.worker_classes)})"
        )
    if (message.worker_class, message.level) not in profiles.table:
        raise FieldError(f"{where}.level: {message.level[:MAX_ID_CHARS]!r} is not in the profile")
    if not (math.isfinite(message.latency_s) and message.latency_s > 0.0):
        raise FieldError(f"{where}.latency_s: must be finite and > 0, got {message.latency_s}")
    return MeasuredLatency(message.worker_class, message.level, message.latency_s, message.samples)


def measured_to_pb(measured: MeasuredLatency) -> Any:
    """The router's side of :func:`measured_from_pb`."""
    return allocator_pb2.MeasuredLatency(
        worker_class=measured.worker_class,
        level=measured.level,
        latency_s=measured.latency_s,
        samples=min(measured.samples, 2**32 - 1),
    )


def class_quality_from_pb(message: Any, profiles: ProfileSet, where: str) -> ClassQuality:
    """A reported Q(v | c), checked against the profile: its levels must be the strategy's
    levels in order (the planner indexes classes by them), its table n × n and its values
    finite and >= 0. FieldError names the field."""
    strategy = strategy_from_pb(message.strategy, f"{where}.strategy")
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
    source = at_most_chars(message.source, f"{where}.source")
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
    at_most(len(names), MAX_CLASSIFIED, f"{where}.levels")
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


def router_answer_to_pb(answer: RouterAnswer) -> Any:
    return allocator_pb2.RouterReportReply(
        plan_version=answer.plan_version, duplicate=answer.duplicate
    )


# -- the router's side ---------------------------------------------------------------------


def router_report_to_pb(report: RouterReport, profiles: ProfileSet) -> Any:
    """The ``RouterReport`` message of ``report``; :func:`router_report_from_pb` reverses it.
    Its class indices become the level names of ``profiles`` (the router's profile), which the
    allocator resolves against its own."""
    return allocator_pb2.RouterReport(
        router_id=report.router_id,
        sequence=report.sequence,
        arrivals=report.arrivals,
        arrival_ages_s=list(report.arrival_ages_s),
        classified=[
            allocator_pb2.ClassifiedLevels(
                strategy=STRATEGY_TO_PB[strategy],
                levels=[profiles.levels_for(strategy)[i].name for i in indices],
            )
            for strategy, indices in report.classified
        ],
        replan_wanted=report.replan_wanted,
        classifier=report.classifier,
        class_quality=[class_quality_to_pb(quality) for quality in report.class_quality],
        measured=[measured_to_pb(measured) for measured in report.measured],
        arrival_costs=list(report.arrival_costs),
        cache_lookups=cache_lookups_to_pb(report.cache_lookups),
    )


def router_answer_from_pb(message: Any) -> RouterAnswer:
    return RouterAnswer(plan_version=message.plan_version, duplicate=message.duplicate)
