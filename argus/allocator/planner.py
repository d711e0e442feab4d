"""One planning step of the allocator: solve (Eq. 1), then align (Algorithm 1) into a Plan.

Pure: it takes the forecast and the affinity histogram as values and returns a new
:class:`~argus.types.Plan`. The allocator service and the simulator call it every period and
when a worker dies or joins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from argus.allocator.oda import align
from argus.allocator.solver import SolverFactory, solve
from argus.types import Allocation, ClusterView, LoadForecast, Plan, ProfileSet, Strategy


@dataclass(frozen=True)
class PlannerConfig:
    """How a plan is made from a forecast."""

    period_s: float = 60.0
    """Planning period in seconds (the paper re-plans every minute); amortises switching cost."""

    switch_cost_weight: float = 1.0
    """Weight of the model-load switching cost in the objective; 0 turns it off."""

    load_margin: float = 1.0
    """Factor on the forecast the solver plans for; the AC→SM switch uses 1.5 (§4.6)."""

    def __post_init__(self) -> None:
        if not self.period_s > 0.0:
            raise ValueError(f"period_s: must be > 0, got {self.period_s}")
        if not self.switch_cost_weight >= 0.0:
            raise ValueError(f"switch_cost_weight: must be >= 0, got {self.switch_cost_weight}")
        if not self.load_margin >= 1.0:
            raise ValueError(f"load_margin: must be >= 1, got {self.load_margin}")


def make_plan(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    forecast: LoadForecast,
    histogram: Sequence[float],
    *,
    config: PlannerConfig | None = None,
    previous: Plan | None = None,
    backend: SolverFactory | None = None,
) -> Plan:
    """Plan the live ``workers`` for ``forecast`` given the affinity ``histogram`` (slowest first).

    The histogram must have one non-negative entry per level of ``strategy``; an all-zero one
    (nothing classified yet) means no preference and is taken as uniform.
    """
    config = config or PlannerConfig()
    levels = profiles.levels_for(strategy)
    weights = _normalised_histogram(histogram, len(levels))
    allocation = solve(
        profiles,
        strategy,
        workers,
        forecast.qpm * config.load_margin,
        switch_cost_weight=config.switch_cost_weight,
        period_s=config.period_s,
        backend=backend,
    )
    shift_map = align(weights, _routing_share(allocation, profiles, workers), allocation.levels)
    return Plan(
        version=previous.version + 1 if previous else 1,
        strategy=strategy,
        allocation=allocation,
        shift_map=shift_map,
        forecast=forecast,
        histogram=weights,
        created_at_s=forecast.at_s,
    )


def _normalised_histogram(histogram: Sequence[float], count: int) -> tuple[float, ...]:
    if len(histogram) != count:
        raise ValueError(
            f"histogram: expected {count} values (one per level), got {len(histogram)}"
        )
    for index, value in enumerate(histogram):
        if not math.isfinite(value) or value < 0.0:
            raise ValueError(f"histogram[{index}]: must be a finite number >= 0, got {value}")
    total = math.fsum(histogram)
    if total == 0.0:
        return tuple(1.0 / count for _ in range(count))
    return tuple(value / total for value in histogram)


def _routing_share(
    allocation: Allocation, profiles: ProfileSet, workers: ClusterView
) -> tuple[float, ...]:
    """F for the aligner: the planned load share, or with no load the live capacity per level.

    With a forecast of zero the solver assigns no load, yet prompts may still arrive; they are
    then spread in proportion to what each level can serve.
    """
    if allocation.served_qpm > 0.0:
        return allocation.load_share_qpm
    capacity = allocation.capacity_qpm(profiles, workers)
    if sum(capacity) > 0.0:
        return capacity
    return tuple(1.0 if i == 0 else 0.0 for i in range(len(allocation.levels)))
