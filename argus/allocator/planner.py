"""One planning step of the allocator: forecast and class histogram in, a Plan out.

Two planners (:class:`PlannerMode`):

* ``joint`` (the default): one program over (prompt class × level)
  (:mod:`argus.allocator.joint`), maximising Σ_c H_c Σ_v y[c][v]·Q(v | c) with Q measured
  per class on a calibration split; the PASM is y. Given level averages for Q (every class
  alike) it is Eq. 1, which is how the prompt-agnostic baselines plan.
* ``paper``: the paper's two steps, Eq. 1 with each level's average quality
  (:mod:`argus.allocator.paper_eq1`), then ODA (Algorithm 1) for the PASM; kept for the ablation.

Both plan each level's utilisation with headroom from queueing
(:mod:`argus.allocator.queueing`) when a queue model is given: the expected wait at the
forecast load must fit in the SLO minus the service time. The pool size that the wait
depends on comes from the previous plan; when the new plan's pools differ the caps are
recomputed from them and the program solved once more (the joint program from where its
first solve ended, :class:`~argus.allocator.joint.JointSolver`).

Pure: it takes the forecast and the histogram as values and returns a new
:class:`~argus.types.Plan`. The allocator service and the simulator call it every period and
when a worker dies or joins.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from argus import defaults
from argus.allocator.highs_session import HighsOptions
from argus.allocator.joint import JointPlan, JointSolver
from argus.allocator.oda import align
from argus.allocator.paper_eq1 import SolverFactory, solve
from argus.allocator.queueing import QueueModel
from argus.types import (
    Allocation,
    ClassQuality,
    ClusterView,
    LoadForecast,
    Plan,
    ProfileSet,
    ShiftMap,
    Strategy,
)


class PlannerMode(enum.StrEnum):
    """How a plan is made (see the module docstring)."""

    JOINT = "joint"
    PAPER = "paper"

    @classmethod
    def parse(cls, value: str) -> PlannerMode:
        try:
            return cls(value.strip().lower())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown planner {value!r}: expected one of {known}") from None


@dataclass(frozen=True)
class PlannerConfig:
    """How a plan is made from a forecast. The planning period is not here: it is the
    allocator's (:attr:`~argus.allocator.config.ControlConfig.period_s`), passed to
    :func:`make_plan`, so the planner and the forecast cannot count different periods."""

    switch_cost_weight: float = 1.0
    """Weight of the model-load switching cost in the objective; 0 turns it off."""

    load_margin: float = 1.0
    """Factor on the forecast the solver plans for; the AC→SM switch uses 1.5 (§4.6)."""

    mode: PlannerMode = PlannerMode.JOINT
    """``joint`` (one program over class × level) or ``paper`` (Eq. 1, then ODA)."""

    queue: QueueModel | None = None
    """Headroom from queueing: caps each level's utilisation so the expected wait fits in
    the SLO; None plans every level up to its peak throughput."""

    def __post_init__(self) -> None:
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
    period_s: float = defaults.PLANNING_PERIOD_S,
    previous: Plan | None = None,
    backend: SolverFactory | None = None,
    class_quality: ClassQuality | None = None,
) -> Plan:
    """Plan the live ``workers`` for ``forecast`` given the class ``histogram`` H.

    The histogram has one non-negative entry per class (as many as ``strategy`` has levels);
    an all-zero one (nothing classified yet) is taken as uniform. ``class_quality`` is
    Q(v | c) for the joint planner; without it every class sees the level averages (Eq. 1).
    ``period_s`` is the planning period the switching cost is amortised over (the
    allocator's, :attr:`~argus.allocator.config.ControlConfig.period_s`).
    """
    if not period_s > 0.0:
        raise ValueError(f"period_s: must be > 0, got {period_s}")
    config = config or PlannerConfig()
    levels = profiles.levels_for(strategy)
    weights = _normalised_histogram(histogram, len(levels))
    load = forecast.qpm * config.load_margin
    caps_of = UtilisationCaps(profiles, strategy, workers, config.queue)
    joint = None
    if config.mode is PlannerMode.JOINT:
        joint = JointSolver(
            profiles,
            strategy,
            workers,
            load,
            class_quality or ClassQuality.from_levels(levels),
            weights,
            switch_cost_weight=config.switch_cost_weight,
            period_s=period_s,
            options=HighsOptions(),
        )

    def solved(
        pools: Mapping[str, int], beat: Allocation | None
    ) -> tuple[Allocation, ShiftMap] | None:
        """The plan with the caps of ``pools``. With ``beat`` (joint mode): None when the
        joint program's relaxation under those caps shows no plan beats it."""
        if beat is not None and joint is not None:
            found = joint.solve_to_beat(caps_of(pools), beat.served_qpm, beat.objective)
            return None if found is None else _joint_answer(found, weights, profiles, workers)
        return _solve(
            profiles,
            strategy,
            workers,
            load,
            weights,
            config,
            period_s,
            caps_of(pools),
            backend,
            joint,
        )

    def settled(
        pools: Mapping[str, int], beat: Allocation | None = None
    ) -> tuple[Allocation, ShiftMap] | None:
        """The plan with the caps of ``pools``, solved again with the caps of its own pools
        when they differ (the caps depend on the pools the plan chooses). With ``beat``:
        None when a relaxation, of either solve, shows that no plan beats it."""
        found = solved(pools, beat)
        if found is not None and config.queue is not None and _pools_of(found[0]) != pools:
            return solved(_pools_of(found[0]), beat)
        return found

    pools = _pools(previous, strategy, workers)
    settled_first = settled(pools)
    assert settled_first is not None  # nothing to beat
    allocation, shift_map = settled_first
    if config.queue is not None:
        # Starting from the previous pools alone is path-dependent: a level no worker runs
        # gets the caps of a one-worker pool, which are low, so new splits are never tried and
        # the plan stays in whatever mix it first fell into. The second start prices every
        # level as if it had every live worker; its own pools can only lower those caps, so
        # when its relaxation cannot beat the first start's plan it stops there.
        everyone = len(workers.alive())
        open_start = {level.name: everyone for level in profiles.levels_for(strategy)}
        if open_start != pools:
            second = settled(open_start, beat=allocation)
            if second is not None and (second[0].served_qpm, second[0].objective) > (
                allocation.served_qpm,
                allocation.objective,
            ):
                allocation, shift_map = second
    return Plan(
        version=previous.version + 1 if previous else 1,
        strategy=strategy,
        allocation=allocation,
        shift_map=shift_map,
        forecast=forecast,
        histogram=weights,
        created_at_s=forecast.at_s,
    )


def _solve(
    profiles: ProfileSet,
    strategy: Strategy,
    workers: ClusterView,
    load: float,
    weights: tuple[float, ...],
    config: PlannerConfig,
    period_s: float,
    caps: Mapping[tuple[str, str], float],
    backend: SolverFactory | None,
    joint: JointSolver | None,
) -> tuple[Allocation, ShiftMap]:
    """One solve under ``caps``: the joint program when ``joint`` is given, else Eq. 1 and
    ODA."""
    if joint is not None:
        return _joint_answer(joint.solve(caps), weights, profiles, workers)
    allocation = solve(
        profiles,
        strategy,
        workers,
        load,
        switch_cost_weight=config.switch_cost_weight,
        period_s=period_s,
        backend=backend,
        caps=caps,
    )
    share = _routing_share(allocation, profiles, workers)
    return allocation, align(weights, share, allocation.levels)


def _joint_answer(
    plan: JointPlan, weights: tuple[float, ...], profiles: ProfileSet, workers: ClusterView
) -> tuple[Allocation, ShiftMap]:
    """The joint program's allocation and PASM; with nothing served (no capacity), the
    PASM that routes by the workers' share."""
    if plan.allocation.served_qpm > 0.0:
        return plan.allocation, plan.shift_map
    share = _routing_share(plan.allocation, profiles, workers)
    return plan.allocation, align(weights, share, plan.allocation.levels)


class UtilisationCaps:
    """(worker class, level) → the utilisation at which a level of ``pools[level]`` workers
    keeps the expected wait within the SLO, for the live workers of one planning step (empty
    without a queue model). A plan asks for up to four sets of pools; the worker classes and
    the latencies are looked up once."""

    def __init__(
        self,
        profiles: ProfileSet,
        strategy: Strategy,
        workers: ClusterView,
        queue: QueueModel | None,
    ) -> None:
        self._queue = queue
        alive = workers.alive()
        classes = sorted({w.worker_class for w in alive}) if queue else []
        self._latency = [
            (g, level.name, profiles.profile(g, level.name).latency_s)
            for g in classes
            for level in profiles.levels_for(strategy)
        ]
        if queue is not None and alive:  # measured caps: every cell in one run
            queue.prepare([(g, level) for g, level, _ in self._latency], len(alive))

    def __call__(self, pools: Mapping[str, int]) -> dict[tuple[str, str], float]:
        queue = self._queue
        if queue is None:
            return {}
        return {
            (g, level): queue.cap(g, level, latency_s, max(1, pools.get(level, 1)))
            for g, level, latency_s in self._latency
        }


def _pools(previous: Plan | None, strategy: Strategy, workers: ClusterView) -> dict[str, int]:
    """Workers per loaded level in the previous plan of this strategy (the queue model's c)."""
    if previous is None or previous.strategy is not strategy:
        return {}
    return _pools_of(previous.allocation)


def _pools_of(allocation: Allocation) -> dict[str, int]:
    return {
        name: count
        for name, count, load in zip(
            allocation.levels, allocation.workers_per_level, allocation.load_share_qpm, strict=True
        )
        if load > 0.0
    }


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
