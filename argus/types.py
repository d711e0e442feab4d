"""Typed values shared by the control plane, the services and the simulator.

Conventions used everywhere in Argus:

* Levels of one strategy are ordered **slowest first**: index 0 is the slowest and best level
  (AC with K=0, or the largest model), the last index the fastest and most approximate. The
  paper writes v_1 … v_n with v_{i-1} slower than v_i; index ``i`` here is the paper's v_{i+1}.
* Loads and throughputs are in queries per minute (QPM); times in seconds.
* Decisions are frozen dataclasses: the control plane returns new values, services apply them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace


class Strategy(enum.StrEnum):
    """Approximation strategy (Argus §2.1, §4.6)."""

    AC = "AC"  # approximate caching: resume a similar prompt's cached latent at step K
    SM = "SM"  # smaller model variants, generated from noise

    @classmethod
    def parse(cls, value: str) -> Strategy:
        """Parse ``AC``/``SM`` (case-insensitive); raise ``ValueError`` quoting the bad value."""
        try:
            return cls(value.strip().upper())
        except ValueError:
            raise ValueError(
                f"unknown strategy {value!r}: expected one of {', '.join(s.value for s in cls)}"
            ) from None


@dataclass(frozen=True)
class Level:
    """One approximation level, independent of the GPU it runs on."""

    name: str  # unique across all strategies, e.g. "ac-k10" or "sm-tiny-sd"
    strategy: Strategy
    model: str  # the diffusion model the worker must have loaded; AC levels share one
    skip_steps: int  # AC: cached steps skipped (K); SM: always 0
    quality: float  # relative quality Q in (0, 1], 1.0 for the best level of the strategy


@dataclass(frozen=True)
class LevelProfile:
    """Profiled numbers of one level on one worker class (GPU type)."""

    latency_s: float  # mean end-to-end generation time at batch size 1, retrieval included
    throughput_qpm: float  # peak throughput P_th of one worker, queries per minute
    load_time_s: float  # time to load this level's model onto an idle GPU
    gpu_memory_gib: float  # GPU memory the loaded model needs


@dataclass(frozen=True)
class MeasuredLatency:
    """A level's latency on a worker class as a router measured it on its workers' replies: the
    mean service time of the requests served there, as they came (``argus.router.service_times``);
    the allocator, which counts load in requests, plans with the speed it shows."""

    worker_class: str
    level: str
    latency_s: float
    samples: int  # replies behind it, over the class's workers


@dataclass(frozen=True)
class ReferenceRequest:
    """The request a profile's latencies were measured with: image size and denoising steps
    (N; an AC level skips K of them). The router prices other sizes relative to it."""

    width: int = 1024
    height: int = 1024
    steps: int = 50


@dataclass(frozen=True)
class ModelPart:
    """One part of a model (a UNet, text encoder or VAE) as the profile prices its load."""

    name: str  # its place in the model: "unet", "text_encoder", "vae", ...
    id: str  # which weights: two models listing one id share the part (one copy, one load)
    share: float  # its fraction of the model's load time and memory (the model's sum to 1)


@dataclass(frozen=True)
class ProfileSet:
    """All levels of all strategies and their numbers on each worker class.

    ``levels`` keeps the file's order, which is slowest first within each strategy (validated
    when loading). ``table[(worker_class, level_name)]`` gives the numbers.
    """

    levels: tuple[Level, ...]
    worker_classes: tuple[str, ...]
    table: Mapping[tuple[str, str], LevelProfile]
    source: str = "<memory>"  # file or "default", for reports
    reference: ReferenceRequest = ReferenceRequest()  # what the latencies were measured on
    # model → its parts; a model left out, or every model when empty, loads whole
    parts: Mapping[str, tuple[ModelPart, ...]] = field(default_factory=dict)

    def levels_for(self, strategy: Strategy) -> tuple[Level, ...]:
        """Levels of one strategy, slowest first."""
        return tuple(level for level in self.levels if level.strategy is strategy)

    def ac_levels_by_model(self) -> dict[str, dict[int, Level]]:
        """Each AC model's levels by the K they resume at (0: its full generation, where a
        cache miss is served)."""
        models: dict[str, dict[int, Level]] = {}
        for level in self.levels_for(Strategy.AC):
            models.setdefault(level.model, {}).setdefault(level.skip_steps, level)
        return models

    def best_latency_s(self, worker_class: str) -> float:
        """Latency of the best (slowest) level of any strategy on ``worker_class``: the SLO's
        unit (the SLO is a multiple of it)."""
        return min(
            self.profile(worker_class, levels[0].name).latency_s
            for strategy in Strategy
            if (levels := self.levels_for(strategy))
        )

    def with_speed(self, factors: Mapping[str, float]) -> ProfileSet:
        """These profiles with each worker class in ``factors`` that many times slower (its
        latencies × the factor, its throughputs ÷ it): the speed its workers were measured at.
        Load times and memory are kept."""
        table = {
            (worker_class, level): (
                replace(
                    entry,
                    latency_s=entry.latency_s * factors[worker_class],
                    throughput_qpm=entry.throughput_qpm / factors[worker_class],
                )
                if worker_class in factors
                else entry
            )
            for (worker_class, level), entry in self.table.items()
        }
        return replace(self, table=table)

    def monolithic(self) -> ProfileSet:
        """These profiles with every model loaded whole: no part shared, whatever is held
        (the cost a worker built of monolithic pipelines pays)."""
        return replace(self, parts={})

    def load_share(self, model: str, held: str | None) -> float:
        """The fraction of ``model``'s load a worker holding ``held`` (None: nothing) pays:
        the shares of its parts whose weights ``held`` lacks. 0 for the same model, 1 for a
        model without parts or one sharing nothing with ``held``."""
        if model == held:
            return 0.0
        parts = self.parts.get(model)
        if not parts or held is None:
            return 1.0
        resident = {part.id for part in self.parts.get(held, ())}
        return sum(part.share for part in parts if part.id not in resident)

    def switch_load_s(self, worker_class: str, level: str, held: str | None) -> float:
        """Seconds a worker of ``worker_class`` holding model ``held`` spends loading what
        ``level``'s model needs: the level's ``load_time_s`` × :meth:`load_share`."""
        model = self._model_of(level)
        load = self.profile(worker_class, level).load_time_s
        return load * self.load_share(model, held)

    def family(self, model: str) -> frozenset[str]:
        """The models linked to ``model`` by shared parts, itself included (a family: SD-1.4,
        SD-1.5 and their distilled small and tiny variants share a text encoder and VAE)."""
        members = {model}
        grew = True
        while grew:
            ids = {part.id for m in members for part in self.parts.get(m, ())}
            more = {m for m, parts in self.parts.items() if any(p.id in ids for p in parts)}
            grew = not more <= members
            members |= more
        return frozenset(members)

    def _model_of(self, level: str) -> str:
        for candidate in self.levels:
            if candidate.name == level:
                return candidate.model
        raise KeyError(f"no level {level!r} in the profiles")

    def profile(self, worker_class: str, level: str) -> LevelProfile:
        """Numbers of ``level`` on ``worker_class``; ``KeyError`` names both when missing."""
        try:
            return self.table[(worker_class, level)]
        except KeyError:
            raise KeyError(
                f"no profile for level {level!r} on worker class {worker_class!r}"
            ) from None


@dataclass(frozen=True)
class WorkerState:
    """What the control plane knows about one worker at planning time."""

    worker_id: str
    worker_class: str  # GPU type, a key of ProfileSet.worker_classes
    alive: bool = True
    level: str | None = None  # level currently served (None: nothing loaded yet)
    queue_length: int = 0  # requests queued or running


@dataclass(frozen=True)
class ClusterView:
    """A snapshot of the workers, as the allocator sees it."""

    workers: tuple[WorkerState, ...]

    @classmethod
    def uniform(cls, count: int, worker_class: str = "a100") -> ClusterView:
        """``count`` live, idle workers of one class, named ``w0``, ``w1``, …"""
        return cls(tuple(WorkerState(f"w{i}", worker_class) for i in range(count)))

    @classmethod
    def by_class(cls, counts: Mapping[str, int]) -> ClusterView:
        """Live idle workers, ``counts[worker_class]`` of each, named ``<class>-<i>``."""
        return cls(
            tuple(
                WorkerState(f"{worker_class}-{i}", worker_class)
                for worker_class, count in counts.items()
                for i in range(count)
            )
        )

    def alive(self) -> tuple[WorkerState, ...]:
        return tuple(w for w in self.workers if w.alive)


@dataclass(frozen=True)
class LoadForecast:
    """Expected load W_t for the next planning period."""

    qpm: float  # the forecast the solver plans for
    ewma_qpm: float  # smoothed recent rate
    peak_qpm: float  # highest per-period rate in the recent window
    at_s: float  # time the forecast was made


@dataclass(frozen=True)
class Allocation:
    """The solver's answer (Argus Eq. 1) for one strategy."""

    strategy: Strategy
    levels: tuple[str, ...]  # level names, slowest first
    workers_per_level: tuple[int, ...]  # live workers assigned to each level, all classes
    load_share_qpm: tuple[float, ...]  # F(v): QPM the plan sends to each level
    assignment: Mapping[str, str]  # worker_id -> level name, every live worker
    objective: float  # sum_v Q_v * F(v), minus switching cost when charged
    switch_cost: float  # the switching cost charged in the objective (0 when off)
    served_qpm: float  # sum of F: min(load, capacity)
    shortfall_qpm: float  # load the cluster cannot serve even at the fastest levels (>= 0)
    moved_workers: int  # live workers whose level differs from their current one
    solve_ms: float  # wall time of the solve, milliseconds

    def level_indices(self) -> dict[str, int]:
        """Each assigned worker's level as its index in ``levels`` (what routers and their
        decisions speak)."""
        return {worker: self.levels.index(level) for worker, level in self.assignment.items()}

    @property
    def saturated(self) -> bool:
        """True when load exceeds capacity: the signal to scale out (Argus §5.3)."""
        return self.shortfall_qpm > 0.0

    def capacity_qpm(self, profiles: ProfileSet, workers: ClusterView) -> tuple[float, ...]:
        """Peak throughput the assigned workers give each level."""
        by_id = {w.worker_id: w for w in workers.workers}
        capacity = dict.fromkeys(self.levels, 0.0)
        for worker_id, level in self.assignment.items():
            worker_class = by_id[worker_id].worker_class
            capacity[level] += profiles.profile(worker_class, level).throughput_qpm
        return tuple(capacity[level] for level in self.levels)


@dataclass(frozen=True)
class ShiftMap:
    """PASM: ``matrix[i][j]`` is P(target level j | optimal level i) (Argus §4.3).

    Every row is a probability distribution; ``H @ matrix == F`` for the H and F it was built
    from.
    """

    levels: tuple[str, ...]  # slowest first
    matrix: tuple[tuple[float, ...], ...]

    @classmethod
    def identity(cls, levels: tuple[str, ...]) -> ShiftMap:
        n = len(levels)
        return cls(levels, tuple(tuple(1.0 if i == j else 0.0 for j in range(n)) for i in range(n)))

    def row(self, level: int) -> tuple[float, ...]:
        return self.matrix[level]

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{from_level: {to_level: p}}`` with zero entries left out."""
        return {
            src: {dst: p for dst, p in zip(self.levels, row, strict=True) if p > 0.0}
            for src, row in zip(self.levels, self.matrix, strict=True)
        }


@dataclass(frozen=True)
class ClassQuality:
    """Q(v | c) of one strategy: the mean quality at each level of the prompts in each class.

    A *class* is what the router's classifier outputs for a prompt: a bin of its calibrated
    tolerance (the joint planner) or its predicted optimal level (the paper's planner). There
    is one class per level, ordered least tolerant first, so class ``c`` and level ``c`` share
    an index and the PASM stays square. Measured on the calibration prompts, which the
    classifier never trained on, so its mistakes are priced into Q.
    """

    strategy: Strategy
    levels: tuple[str, ...]  # the strategy's levels, slowest first
    quality: tuple[tuple[float, ...], ...]  # [class][level]: mean score relative to the best
    # level's mean over all calibration prompts (so about 1.0 at the best level)
    prior: tuple[float, ...]  # share of the calibration prompts in each class
    source: str  # where Q came from, e.g. "calibration split of classifiers/minilm-logistic"

    def __post_init__(self) -> None:
        n = len(self.levels)
        if n == 0:
            raise ValueError("levels: at least one level is needed")
        if len(self.quality) != n or any(len(row) != n for row in self.quality):
            raise ValueError(f"quality: expected {n} classes × {n} levels (one class per level)")
        if len(self.prior) != n:
            raise ValueError(f"prior: expected {n} values, got {len(self.prior)}")
        for c, row in enumerate(self.quality):
            for v, value in enumerate(row):
                if not math.isfinite(value) or value < 0.0:
                    raise ValueError(f"quality[{c}][{v}]: must be finite and >= 0, got {value}")
        if any(not math.isfinite(p) or p < 0.0 for p in self.prior):
            raise ValueError(f"prior: values must be finite and >= 0, got {self.prior}")

    @classmethod
    def from_levels(cls, levels: tuple[Level, ...]) -> ClassQuality:
        """Every class sees each level's average quality ``Level.quality``: what a planner
        that ignores the prompt knows (PAC, the paper's Eq. 1)."""
        row = tuple(level.quality for level in levels)
        n = len(levels)
        return cls(
            levels[0].strategy,
            tuple(level.name for level in levels),
            tuple(row for _ in levels),
            tuple(1.0 / n for _ in levels),
            "level averages",
        )


@dataclass(frozen=True)
class Plan:
    """What the allocator publishes each period and routers follow."""

    version: int  # increases by one with every plan
    strategy: Strategy
    allocation: Allocation
    shift_map: ShiftMap
    forecast: LoadForecast
    histogram: tuple[float, ...]  # affinity H used, normalised, slowest first
    created_at_s: float


@dataclass(frozen=True)
class RouteDecision:
    """Where the scheduler sends one prompt (Argus §4.4)."""

    optimal_level: int  # classifier's level index
    target_level: int  # level sampled from the PASM row
    served_level: int  # level of the chosen worker (differs from target on fallback)
    worker_id: str
    fallback: bool = False  # True when no live worker served the target level
    score: float = field(default=0.0)  # (queue + 1) * t_proc of the chosen worker, seconds
    spilled: bool = False  # True when admission moved it off a worker too late for its deadline
