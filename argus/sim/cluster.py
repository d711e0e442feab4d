"""Discrete-event simulation of a fixed GPU cluster, driven by a policy.

The simulated data plane: workers take their latency, model load time and
retrieval time from the profiles, and the policy (Argus's own control plane or a baseline)
decides levels and routes exactly as it would live.

Model of a worker: one request at a time (batch size 1, Argus §3.2), first come first served.
A request's finish time is fixed when it is routed: ``max(now, worker free) + service``, where
service is the level's profiled latency on the worker's GPU class times a seeded log-normal
jitter.

Several GPU classes, model loads and admission are explained in
``docs/control-plane-internals.md`` ("The simulated cluster").

AC levels with K > 0 fetch a cached latent: the profiles' latency includes a nominal retrieval
time (``SimConfig.retrieval_s``); during a retrieval fault the extra latency is added, and
during an outage the request waits ``retrieval_timeout_s`` and is then generated in full (the
K = 0 latency and quality). Policies see every retrieval latency, or the failure, so that Argus
can switch to SM (§4.6).

What an AC request finds is ``SimConfig.cache`` (:mod:`argus.sim.cluster_cache`): ``perfect``
(the default here) makes every AC request at K > 0 a hit at its routed K; ``realistic`` gives
each worker a bounded cache of the prompts it generated in full, and the nearest one's
similarity decides the K used (a miss is a full generation, which then feeds the cache).

Requests may carry adapters (``SimConfig.adapters``, :mod:`argus.sim.adapters`): ControlNets
and LoRAs drawn from Katz's production statistics, once per simulation so every policy sees
the same ones, and the seconds they add under the chosen workflow join the service time. BAL
fetches LoRAs from the request's arrival, so time spent queued on the worker hides them.
Policies plan with profiles that include the mean adapter seconds of each level, as profiles
measured on such traffic would; the SLO stays 3 × the adapter-free best latency.

GPU failures take workers down for a window: requests still queued on them are routed again
at the failure time, and the policy re-plans at once without them; they come back idle, with
nothing loaded, when the window ends. A request routed again is admitted again against what is
left of its SLO, as the live router does on a retry; if it no longer fits it is refused.

Arrivals are not events: they come from a sorted array. Period ticks, faults and policy
timers are the only events.
"""

from __future__ import annotations

import heapq
import math
import types
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from argus import defaults
from argus.contracts.quality import QualityTable
from argus.profiles.cache_evidence import DEFAULT_RULE, KRule, ReuseQuality
from argus.router.admission import AdmissionRule
from argus.router.cache_routing import Neighbours
from argus.router.late_binding import Held, LateBinder
from argus.router.policy import Refused, admit_on
from argus.sim.adapters import (
    AdapterCost,
    AdapterDraws,
    AdapterModel,
    adapter_cost,
    draw_adapters,
    with_adapter_costs,
)
from argus.sim.cluster_cache import (
    CACHE_MODES,
    CacheMode,
    CacheSetup,
    ClusterCache,
    Embed,
    adapter_keys,
)
from argus.sim.service_times import SimServiceSpread
from argus.sim.worker_cache import Eviction
from argus.sim.workloads import Workload
from argus.slo import default_slo_s
from argus.types import ClusterView, Level, ProfileSet, Strategy, WorkerState

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class GpuFailure:
    """``count`` workers (the highest-numbered live ones) are down in [start_s, end_s)."""

    start_s: float
    end_s: float
    count: int


@dataclass(frozen=True)
class RetrievalFault:
    """Cache retrieval is slower by ``extra_s`` in [start_s, end_s); ``math.inf`` = outage."""

    start_s: float
    end_s: float
    extra_s: float = math.inf


Fault = GpuFailure | RetrievalFault


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster."""

    gpus: int = 8
    """Workers, one per GPU (with ``gpus_by_class``: their total)."""

    worker_class: str = "a100"
    """GPU type of every worker (a profile class); with ``gpus_by_class``: its first class."""

    gpus_by_class: tuple[tuple[str, int], ...] = ()
    """(GPU class, workers) pairs, in worker order: ``(("a100", 4), ("h100", 4))`` makes w0-w3
    A100s and w4-w7 H100s. Empty: ``gpus`` workers of ``worker_class``. Build it with
    :meth:`with_classes`, which sets ``gpus`` and ``worker_class`` to match."""

    period_s: float = defaults.PLANNING_PERIOD_S
    """How often policies re-plan, seconds of simulated time (the paper: every minute)."""

    jitter: float = 0.05
    """Standard deviation of the log-normal factor on every service time (0 = none)."""

    slo_factor: float = defaults.SLO_FACTOR
    """SLO = this × the best level's latency (the paper: 3 × SDXL latency)."""

    retrieval_s: float = 0.05
    """Nominal AC retrieval time already inside the profiles' AC latencies, seconds."""

    retrieval_timeout_s: float = 1.0
    """During an outage a request waits this long before generating in full."""

    faults: tuple[Fault, ...] = ()
    seed: int = 0

    adapters: AdapterModel | None = None
    """ControlNets and LoRAs on the requests and how workers serve them; None: no adapters."""

    admission: bool = True
    """Refuse a routed request whose predicted completion misses its deadline, as the router
    does (see the module docstring); False: serve every request, however late."""

    admission_rule: AdmissionRule | None = None
    """How sure the prediction must be; None: the router's rule with the spread of this
    simulation's own service times (jitter, and adapters when on), as a deployment would
    measure it."""

    cache: str = CacheMode.PERFECT.value
    """``perfect``: every AC request at K > 0 is a hit at its routed K (the table's quality);
    ``realistic``: per-worker caches of prompt embeddings decide hits, misses and the K used
    (:mod:`argus.sim.cluster_cache`). ``argus evaluate`` and ``argus replay`` default to
    realistic; this default keeps the simulations written before caches were modelled as
    they were."""

    cache_entries: int = defaults.CACHE_MAX_ENTRIES
    """Realistic cache: prompts each worker's cache keeps at most (the live worker's bound)."""

    cache_eviction: str = Eviction.LRU.value
    """Realistic cache: ``lru`` (the live worker's) or ``lcbfu`` (NIRVANA's)."""

    cache_rules: tuple[tuple[str, KRule], ...] = ()
    """Realistic cache: (model, its similarity → K rule) pairs, from the profile's
    ``[models.X.cache]`` tables (:func:`argus.profiles.load_cache_rules`); a model not named
    uses :data:`argus.profiles.cache_evidence.DEFAULT_RULE`."""

    cache_warm: tuple[str, ...] = ()
    """Realistic cache: prompts held at the start, as full generations of every AC model
    without adapters; empty: every cache starts cold."""

    cache_warm_dealt: bool = False
    """Realistic cache: deal the warm prompts round-robin, each worker holding its share (a
    cluster whose workers served different requests before); False: every worker holds all."""

    late_binding_window: int = 0
    """Requests a worker is sent at once; the router holds the rest and a worker with room
    takes the first by deadline, refusing those that can no longer finish in time
    (:mod:`argus.router.late_binding`, through the planned policies' ``RouterPolicy``; the
    same rule for the other policies). 0: every request is queued on its worker when routed,
    as the simulations written before (``argus evaluate --late-binding-window 2`` runs the
    live router's default). Needs ``admission``."""

    @classmethod
    def with_classes(cls, counts: Mapping[str, int], **fields: Any) -> SimConfig:
        """A config with ``counts[class]`` workers of each class, in the mapping's order."""
        pairs = tuple((str(name), int(count)) for name, count in counts.items())
        if not pairs:
            raise ValueError("gpus_by_class: no GPU class given")
        return cls(
            gpus=sum(count for _, count in pairs),
            worker_class=pairs[0][0],
            gpus_by_class=pairs,
            **fields,
        )

    def worker_counts(self) -> tuple[tuple[str, int], ...]:
        """(GPU class, workers) in worker order; one pair on a uniform cluster."""
        return self.gpus_by_class or ((self.worker_class, self.gpus),)

    def worker_class_list(self) -> tuple[str, ...]:
        """The GPU class of each worker, w0 first."""
        return tuple(name for name, count in self.worker_counts() for _ in range(count))

    def __post_init__(self) -> None:
        if self.gpus_by_class:
            self._check_classes()
        if self.gpus < 1:
            raise ValueError(f"gpus: must be >= 1, got {self.gpus}")
        if not self.period_s > 0.0:
            raise ValueError(f"period_s: must be > 0, got {self.period_s}")
        if not self.jitter >= 0.0:
            raise ValueError(f"jitter: must be >= 0, got {self.jitter}")
        if self.late_binding_window < 0:
            raise ValueError(f"late_binding_window: must be >= 0, got {self.late_binding_window}")
        if not self.slo_factor > 0.0:
            raise ValueError(f"slo_factor: must be > 0, got {self.slo_factor}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache: must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")
        if self.cache_entries < 1:
            raise ValueError(f"cache_entries: must be >= 1, got {self.cache_entries}")
        if self.cache_eviction not in tuple(Eviction):
            raise ValueError(
                f"cache_eviction: must be one of {', '.join(Eviction)}, got {self.cache_eviction!r}"
            )
        for fault in self.faults:
            if not 0.0 <= fault.start_s < fault.end_s:
                raise ValueError(f"faults: window must satisfy 0 <= start < end, got {fault}")
            if isinstance(fault, GpuFailure) and not 0 < fault.count <= self.gpus:
                raise ValueError(f"faults: GPU failure count must be in [1, gpus], got {fault}")

    def _check_classes(self) -> None:
        names = [name for name, _ in self.gpus_by_class]
        if len(set(names)) != len(names):
            raise ValueError(f"gpus_by_class: a class is named twice in {self.gpus_by_class}")
        for name, count in self.gpus_by_class:
            if count < 1:
                raise ValueError(f"gpus_by_class: {name} must have >= 1 GPU, got {count}")
        total = sum(count for _, count in self.gpus_by_class)
        if total != self.gpus:
            raise ValueError(
                f"gpus: {self.gpus} differs from the {total} of gpus_by_class "
                f"{self.gpus_by_class} (SimConfig.with_classes sets both)"
            )
        if self.worker_class != names[0]:
            raise ValueError(
                f"worker_class: {self.worker_class!r} is not the first class of gpus_by_class "
                f"{self.gpus_by_class} (SimConfig.with_classes sets both)"
            )


@dataclass
class SimContext:
    """What a policy may read: the cluster, the profiles, and per-request prompt facts."""

    profiles: ProfileSet
    worker_ids: tuple[str, ...]
    worker_class: str
    quality: Mapping[Strategy, QualityTable]
    prompt_rows: IntArray  # request i -> row of the quality tables
    rng: np.random.Generator
    probe_retrieval: Callable[[float], float | None]  # a background probe's latency, or None
    slo_s: float  # the latency objective requests are judged by
    # worker id -> GPU class; empty: every worker is of ``worker_class`` (filled in)
    worker_classes: Mapping[str, str] = field(default_factory=dict)
    admission_rule: AdmissionRule = field(default_factory=AdmissionRule)  # the router's
    # the simulated service times, for measured queueing caps (None: not known)
    service_spread: SimServiceSpread | None = None
    cache: str = CacheMode.PERFECT.value  # SimConfig.cache: what an AC request finds
    # realistic cache: each AC model's similarity → K rule (empty in perfect mode)
    cache_rules: Mapping[str, KRule] = field(default_factory=dict)
    # what a hit at (similarity, K) scores
    reuse_quality: ReuseQuality = field(default_factory=ReuseQuality)
    lookup_s: float = 0.0  # the search a miss spends before its full generation
    late_binding_window: int = 0  # SimConfig.late_binding_window (0 without admission)

    def optimal_level(self, strategy: Strategy, request: int) -> int:
        """The oracle's level index for a request (see :mod:`argus.sim.policies`)."""
        return int(self._optimal[strategy][self.prompt_rows[request]])

    def __post_init__(self) -> None:
        self._optimal = {s: table.optimal_levels() for s, table in self.quality.items()}
        if not self.worker_classes:
            self.worker_classes = {worker_id: self.worker_class for worker_id in self.worker_ids}


@dataclass(frozen=True)
class Dispatch:
    """The cluster as the router sees it when one request is dispatched."""

    queues: Mapping[str, int]
    down: frozenset[str]
    elapsed_s: Callable[[str], float]  # how long the request a worker is serving has run
    # (worker, level) → the router's t_proc there: of the level the worker serves it at, its
    # old one while the level's model loads in the background
    latency_s: Callable[[str, str], float]
    admission: AdmissionRule | None  # None: everything is queued (the ablation)
    budget_s: float  # what is left of the request's SLO
    # (worker, model) → similarity of the request's nearest neighbour in that worker's cache
    # (None: it holds none); None: perfect cache, nothing to look at
    neighbours: Neighbours | None = None


class Policy(ABC):
    """A serving policy: decides every worker's level and each request's worker.

    The simulator calls :meth:`reset` once, :meth:`replan` at every period tick and fault,
    :meth:`route` for every request and :meth:`observe_retrieval` after every AC retrieval.
    """

    name: str
    background_loads = False
    """True: a worker moved to another model keeps serving its old level while the new model
    loads beside it (GPU memory holds two, Argus §4.6); False: it stops while loading."""

    binder: LateBinder | None = None
    """The router's late binding, when the policy's own router has it (the planned policies'
    ``RouterPolicy``); None: the simulator holds requests by the same rule itself."""

    tied_last = False
    """Whether the last request :meth:`decide` admitted is tied to its worker (its cached
    neighbour is there): held only for that worker under late binding."""

    @abstractmethod
    def reset(self, ctx: SimContext) -> None:
        """Prepare for a run."""

    @abstractmethod
    def replan(self, now_s: float, view: ClusterView) -> Mapping[str, str]:
        """Level for each live worker of ``view`` (worker_id -> level name)."""

    @abstractmethod
    def route(
        self, request: int, now_s: float, queues: Mapping[str, int], down: frozenset[str]
    ) -> tuple[str, str]:
        """(worker_id, level name to serve at) for ``request``."""

    def decide(self, request: int, now_s: float, dispatch: Dispatch) -> tuple[str, str] | Refused:
        """Route ``request`` and admit it as the router admits a routed request
        (:func:`argus.router.policy.admit_on`, the check the live router runs); the planned
        policies decide with the router's whole :class:`~argus.router.policy.RouterPolicy`
        instead."""
        worker_id, level_name = self.route(request, now_s, dispatch.queues, dispatch.down)
        if dispatch.admission is None:
            return worker_id, level_name
        predicted = admit_on(
            dispatch.admission,
            dispatch.queues.get(worker_id, 0),
            dispatch.elapsed_s(worker_id),
            dispatch.latency_s(worker_id, level_name),
            dispatch.budget_s,
        )
        return predicted if isinstance(predicted, Refused) else (worker_id, level_name)

    def observe_arrival(self, now_s: float) -> None:  # noqa: B027 (optional hook)
        """A request arrived (before it is routed)."""

    def observe_retrieval(self, now_s: float, latency_s: float | None) -> None:  # noqa: B027
        """An AC retrieval took ``latency_s`` (None: it failed)."""

    def observe_lookup(self, now_s: float, level: str, similarity: float) -> None:  # noqa: B027
        """Realistic cache: a request routed to AC level ``level`` found its nearest cached
        prompt at ``similarity`` (NaN: none), what a live worker's reply tells its router."""

    def next_timer(self) -> float | None:
        """Simulated time at which the policy wants an extra :meth:`replan`, if any."""
        return None


@dataclass
class RunResult:
    """Per-request outcome of one policy on one workload."""

    policy: str
    arrivals_s: FloatArray
    finish_s: FloatArray
    level: IntArray  # index into profiles.levels
    worker: IntArray  # index of the worker that served the request
    score: FloatArray  # quality score of the image served
    relative: FloatArray  # score / the prompt's score at the best level of its strategy
    slo_s: float
    model_switches: int
    plan_changes: int
    busy_s: float
    gpu_seconds: float
    duration_s: float  # length of the trace: its horizon when known, else the last arrival
    strategy_switches: int = 0
    switch_times_s: list[float] = field(default_factory=list)  # when each model load began
    plan_change_times_s: list[float] = field(default_factory=list)  # re-plans that moved a worker
    busy_by_minute_s: list[float] = field(default_factory=list)  # GPU-seconds busy per minute
    gpus: int = 1
    adapter_s: float = 0.0  # seconds adapters added to service times, all requests together
    # True for the requests admission refused (never served); left out: none refused
    refused: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    worker_classes: tuple[str, ...] = ()  # GPU class of each worker index; () when unknown
    refused_early: int = 0  # of the refused: before classification (the router's early check)
    refused_held: int = 0  # of the refused: admitted, held by late binding, then found late
    fallbacks: int = 0  # routed to a worker of another level than the PASM's target
    spills: int = 0  # admitted at another level than routed: the chosen worker was too late
    loads: int = 0  # model loads completed (a background load cancelled before it ends: none)
    load_s: float = 0.0  # their seconds: the profile's load time of what each switch loaded
    # True for the requests that waited on a model load: queued behind one on their worker
    load_waits: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    cache: str = CacheMode.PERFECT.value  # SimConfig.cache of the run
    # True for the admitted requests served at an AC level of K > 0's ceiling: they looked a
    # cached latent up (in perfect mode too, where each is a hit unless retrieval was down)
    cache_lookup: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    cache_hit: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    # the looked-up requests' nearest cached prompt's cosine similarity; NaN where there was
    # none (a cold cache, a ControlNet, retrieval down) or no lookup; 1 for perfect-mode hits
    similarity: FloatArray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    cache_inserts: int = 0  # realistic mode: entries fed to the workers' caches (warm ones too)
    cache_evictions: int = 0  # realistic mode: entries evicted to keep the bound

    def __post_init__(self) -> None:
        if len(self.refused) != len(self.arrivals_s):
            if len(self.refused):
                raise ValueError(
                    f"refused: {len(self.refused)} flags for {len(self.arrivals_s)} requests"
                )
            self.refused = np.zeros(len(self.arrivals_s), dtype=np.bool_)
        n = len(self.arrivals_s)
        if len(self.load_waits) != n:
            self.load_waits = np.zeros(n, dtype=np.bool_)
        if len(self.cache_lookup) != n:
            self.cache_lookup = np.zeros(n, dtype=np.bool_)
        if len(self.cache_hit) != n:
            self.cache_hit = np.zeros(n, dtype=np.bool_)
        if len(self.similarity) != n:
            self.similarity = np.full(n, math.nan)

    @property
    def admitted(self) -> npt.NDArray[np.bool_]:
        """True for the requests admission let through (served, within the SLO or not)."""
        return ~self.refused

    @property
    def late(self) -> npt.NDArray[np.bool_]:
        """Admitted requests that finished later than the SLO after arriving."""
        with np.errstate(invalid="ignore"):
            return self.admitted & ((self.finish_s - self.arrivals_s) > self.slo_s)

    @property
    def violated(self) -> npt.NDArray[np.bool_]:
        """Requests not served within the SLO: late ones and refused ones."""
        return self.late | self.refused

    @property
    def good(self) -> npt.NDArray[np.bool_]:
        """Requests served within the SLO (the ones effective quality averages)."""
        return ~self.violated


class _Worker:
    __slots__ = (
        "alive",
        "finishes",
        "free_at",
        "level",
        "load_until",
        "model",
        "pending",
        "state",
        "worker_class",
        "worker_id",
    )

    def __init__(self, worker_id: str, worker_class: str) -> None:
        self.worker_id = worker_id
        self.worker_class = worker_class
        self.alive = True
        self.level: str | None = None
        self.model: str | None = None
        self.free_at = 0.0
        self.load_until = 0.0  # the end of the last model load it stops serving for
        # (finish time, request or -1 for a model load, start time), in the order served
        self.finishes: deque[tuple[float, int, float]] = deque()
        self.pending: tuple[str, str, float] | None = None  # (level, model, ready) loading now
        self.state: WorkerState | None = None  # as the last view showed it

    def current_state(self) -> WorkerState:
        """The worker as a policy's view shows it: the last view's value while it holds, so a
        view every simulated second builds only what changed."""
        state, queue = self.state, len(self.finishes)
        if (
            state is None
            or state.queue_length != queue
            or state.level != self.level
            or state.alive != self.alive
        ):
            state = self.state = WorkerState(
                self.worker_id, self.worker_class, self.alive, self.level, queue
            )
        return state


class Simulation:
    """One run of one policy over one workload."""

    def __init__(
        self,
        profiles: ProfileSet,
        quality: Mapping[Strategy, QualityTable],
        workload: Workload,
        config: SimConfig | None = None,
        *,
        embed: Embed | None = None,
    ) -> None:
        """``embed``: prompt texts to their vectors for the realistic cache (None: the live
        cache's encoder, :func:`argus.sim.prompt_vectors.embed_prompts`, run once here)."""
        self.profiles = with_table_quality(profiles, quality)
        self.quality = quality
        self.workload = workload
        self.config = config or SimConfig()
        profiles = self.profiles
        self._levels = {level.name: level for level in profiles.levels}
        self._level_index = {level.name: i for i, level in enumerate(profiles.levels)}
        self._strategy_index = {
            level.name: i for s in Strategy for i, level in enumerate(profiles.levels_for(s))
        }
        for strategy, table in quality.items():
            names = tuple(level.name for level in profiles.levels_for(strategy))
            if tuple(table.levels) != names:
                raise ValueError(
                    f"quality table for {strategy} has levels {table.levels}, "
                    f"the profiles have {names}"
                )
        classes = [name for name, _ in self.config.worker_counts()]
        unknown = [name for name in classes if name not in profiles.worker_classes]
        if unknown:
            raise ValueError(
                f"GPU class {unknown[0]!r} has no profiles; the profiles know "
                f"{', '.join(profiles.worker_classes)}"
            )
        # the SLO's unit: the best level's latency on the slowest class present
        self.slo_s = default_slo_s(profiles, classes, self.config.slo_factor)
        model = self.config.adapters
        self.adapter_draws: AdapterDraws | None = None
        # what policies plan with: the profiles as measured with the requests' adapters
        self.plan_profiles = self.profiles
        if model is not None:
            rng = np.random.default_rng(self.config.seed + 2)
            self.adapter_draws = draw_adapters(len(workload), rng, model.mix)
            self.plan_profiles = with_adapter_costs(self.profiles, model, self.adapter_draws)
        self.admission_rule = self.config.admission_rule or AdmissionRule(
            service_scv=self._service_scv()
        )
        self.reuse_quality = ReuseQuality(total_steps=profiles.reference.steps)
        # per AC model, its levels by K (K = 0: its full generation)
        self.ac_levels = profiles.ac_levels_by_model()
        self.cache_setup: CacheSetup | None = None
        if self.config.cache == CacheMode.REALISTIC and self.ac_levels:
            self.cache_setup = self._cache_setup(embed)

    def _cache_setup(self, embed: Embed | None) -> CacheSetup:
        """The realistic caches' inputs: the vectors of the prompts the requests use (the
        first rows of the quality tables, request i being row i mod rows) and of the warm
        prompts, embedded once; each AC model's rule and cached steps."""
        models = tuple(self.ac_levels)
        missing = [model for model in models if 0 not in self.ac_levels[model]]
        if missing:
            raise ValueError(
                f"cache: realistic needs a K = 0 AC level of every AC model, {missing[0]!r} "
                "has none (a miss is served in full)"
            )
        if embed is None:
            from argus.sim.prompt_vectors import embed_prompts

            embed = embed_prompts
        rows = min(len(t.prompts) for t in self.quality.values())
        table = self.quality.get(Strategy.AC) or next(iter(self.quality.values()))
        used = min(rows, len(self.workload))
        texts = [*table.prompts[:used], *self.config.cache_warm]
        vectors = np.asarray(embed(texts), dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        rules = {model: DEFAULT_RULE for model in models} | dict(self.config.cache_rules)
        cached = {
            model: tuple(sorted(k for k in by_step if k > 0))
            for model, by_step in self.ac_levels.items()
        }
        return CacheSetup(
            vectors=(vectors / np.where(norms > 0.0, norms, 1.0)).astype(np.float32),
            warm=tuple(range(used, used + len(self.config.cache_warm))),
            warm_models=models,
            rules=rules,
            cached_steps=cached,
            adapter_keys=adapter_keys(self.adapter_draws, len(self.workload)),
            capacity=self.config.cache_entries,
            eviction=Eviction(self.config.cache_eviction),
            warm_dealt=self.config.cache_warm_dealt,
        )

    def _service_scv(self) -> float:
        """The largest squared coefficient of variation of the service time of one level on
        one of the simulation's classes: the jitter's log-normal factor times the base latency
        plus each request's adapter seconds (no queue wait, the widest case)."""
        jitter = math.expm1(self.config.jitter**2)
        model, draws = self.config.adapters, self.adapter_draws
        if model is None or draws is None:
            return jitter
        by_level = {level.name: level for level in self.profiles.levels}
        present = {name for name, _ in self.config.worker_counts()}
        widest = 0.0
        for (worker_class, name), profile in self.profiles.table.items():
            if worker_class not in present:
                continue
            cost = adapter_cost(model, draws, profile.latency_s, by_level[name].skip_steps)
            service = profile.latency_s + cost.seconds()
            widest = max(widest, float(service.var() / service.mean() ** 2))
        return (1.0 + widest) * (1.0 + jitter) - 1.0

    def run(self, policy: Policy, progress: Callable[[int], None] | None = None) -> RunResult:
        """Replay the workload through ``policy``; ``progress(n)`` is told every 10,000 requests."""
        return _Run(self, policy, progress).execute()


class _Run:
    """The mutable state of one simulation run."""

    def __init__(
        self, sim: Simulation, policy: Policy, progress: Callable[[int], None] | None
    ) -> None:
        self.sim = sim
        self.cfg = sim.config
        self.policy = policy
        self.progress = progress
        n = len(sim.workload)
        rows = min(len(t.prompts) for t in sim.quality.values())
        self.prompt_rows: IntArray = np.arange(n, dtype=np.int64) % rows
        rng = np.random.default_rng(self.cfg.seed)
        self.jitter: FloatArray = (
            np.exp(rng.normal(0.0, self.cfg.jitter, n)) if self.cfg.jitter > 0 else np.ones(n)
        )
        self.workers = [
            _Worker(f"w{i}", worker_class)
            for i, worker_class in enumerate(self.cfg.worker_class_list())
        ]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.arrivals = np.asarray(sim.workload.arrivals_s, dtype=np.float64)
        self.worker_index = {w.worker_id: i for i, w in enumerate(self.workers)}
        # per-request outcomes as Python lists (item writes cost a fifth of numpy's), made
        # arrays by _result
        self.finish: list[float] = [0.0] * n
        self.level: list[int] = [-1] * n
        self.worker: list[int] = [-1] * n
        self.score: list[float] = [0.0] * n
        self.relative: list[float] = [0.0] * n
        self.refused: list[bool] = [False] * n
        self.load_waits: list[bool] = [False] * n
        self.cache_lookup: list[bool] = [False] * n
        self.cache_hit: list[bool] = [False] * n
        self.similarity: list[float] = [math.nan] * n
        setup = sim.cache_setup
        self.caches = None if setup is None else ClusterCache(setup, len(self.workers))
        self._arrival_list: list[float] = self.arrivals.tolist()
        self._jitter_list: list[float] = self.jitter.tolist()
        self._row_list: list[int] = self.prompt_rows.tolist()
        # what _dispatch hands the policy, kept up to date instead of rebuilt per request:
        # each worker's queue (len(finishes)), and the workers down
        self._queues: dict[str, int] = {w.worker_id: 0 for w in self.workers}
        self._queue_view = types.MappingProxyType(self._queues)
        self._down: frozenset[str] = frozenset()
        # (finish time, worker index) of every entry queued on a worker: _dispatch pops the
        # due ones instead of looking at every worker (stale after a failure, and harmless)
        self._due: list[tuple[float, int]] = []
        self._plan_latency_cache: dict[tuple[str, str], float] = {}
        self.refused_held = 0
        self.model_switches = 0
        self.loads = 0
        self.load_s = 0.0
        self.plan_changes = 0
        self.busy_s = 0.0
        self.switch_times: list[float] = []
        self.plan_change_times: list[float] = []
        self.busy_by_minute: list[float] = []
        self.events: list[tuple[float, int, str, Fault | int]] = []
        self._event_seq = 0
        self.next_tick = self.cfg.period_s
        self.context = SimContext(
            sim.plan_profiles,
            tuple(w.worker_id for w in self.workers),
            self.cfg.worker_class,
            sim.quality,
            self.prompt_rows,
            np.random.default_rng(self.cfg.seed + 1),
            self._probe,
            sim.slo_s,
            {w.worker_id: w.worker_class for w in self.workers},
            sim.admission_rule,
            SimServiceSpread.of(sim.profiles, self.cfg.jitter, self.cfg.adapters),
            self.cfg.cache,
            dict(setup.rules) if setup is not None else {},
            sim.reuse_quality,
            self.cfg.retrieval_s,
            self.cfg.late_binding_window if self.cfg.admission else 0,
        )
        self.binder: LateBinder | None = None  # set in execute, once the policy is reset
        self._latency_cache: dict[tuple[str, str], float] = {}
        self._adapter_costs: dict[tuple[str, str], AdapterCost] = {}
        self._adapter_lists: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        self.adapter_s = 0.0
        self._scores = {s: t.scores.tolist() for s, t in sim.quality.items()}
        self._best_scores = {s: t.scores.max(axis=1).tolist() for s, t in sim.quality.items()}

    # -- the loop ----------------------------------------------------------------------------

    def execute(self) -> RunResult:
        self.policy.reset(self.context)
        window = self.context.late_binding_window
        if window:
            self.binder = self.policy.binder or LateBinder(window, self.sim.admission_rule)
        self._schedule_events()
        self._replan(0.0)
        for i, now in enumerate(self.arrivals.tolist()):
            self._advance(now)
            self.policy.observe_arrival(now)
            self._dispatch(i, now)
            if self.progress is not None and i % 10_000 == 9_999:
                self.progress(i + 1)
        if self.binder is not None:
            while len(self.binder) and self._due:  # the held requests left at the end
                self._finish_due(self._due[0][0])
            for held in list(self.binder):  # no worker will take these
                self.binder.withdraw(held.token)
                self._refuse(held.token)
        return self._result()

    def _advance(self, now: float) -> None:
        """Handle every period tick, fault and policy timer due by ``now``, in time order."""
        timer = self.policy.next_timer()
        if (
            now < self.next_tick
            and (timer is None or now < timer)
            and (not self.events or now < self.events[0][0])
        ):
            return  # nothing due: what most requests find
        while True:
            fault_at = self.events[0][0] if self.events else math.inf
            timer = self.policy.next_timer()
            timer_at = math.inf if timer is None else timer
            due = min(self.next_tick, fault_at, timer_at)
            if due > now:
                return
            if self.binder is not None:  # held requests taken before the event sees them
                self._finish_due(due)
            if fault_at == due:
                at, _, kind, payload = heapq.heappop(self.events)
                self._event(at, kind, payload)
            elif self.next_tick == due:
                self._replan(due)
                self.next_tick += self.cfg.period_s
            else:
                self._replan(due)
                after = self.policy.next_timer()
                if after is not None and after <= due:
                    raise RuntimeError(f"policy {self.policy.name!r} timer did not advance")

    def _schedule_events(self) -> None:
        for fault in self.cfg.faults:
            self._push(fault.start_s, "start", fault)
            self._push(fault.end_s, "end", fault)

    def _push(self, at: float, kind: str, payload: Fault | int) -> None:
        self._event_seq += 1
        heapq.heappush(self.events, (at, self._event_seq, kind, payload))

    def _event(self, now: float, kind: str, payload: Fault | int) -> None:
        if kind == "ready":
            assert isinstance(payload, int)
            self._model_ready(self.workers[payload], now)
            return
        fault = payload
        if isinstance(fault, GpuFailure):
            if kind == "start":
                self._fail_workers(now, fault.count)
            else:
                self._recover_workers(fault.count)
            self._replan(now)

    def _probe(self, now: float) -> float | None:
        extra = self._retrieval_extra(now)
        return None if math.isinf(extra) else self.cfg.retrieval_s + extra

    def _retrieval_extra(self, now: float) -> float:
        extra = 0.0
        for fault in self.cfg.faults:
            if isinstance(fault, RetrievalFault) and fault.start_s <= now < fault.end_s:
                extra = max(extra, fault.extra_s)
        return extra

    # -- decisions ---------------------------------------------------------------------------

    def _view(self) -> ClusterView:
        return ClusterView(tuple(w.current_state() for w in self.workers))

    def _replan(self, now: float) -> None:
        wanted = self.policy.replan(now, self._view())
        changed = False
        for worker_id, level_name in wanted.items():
            worker = self.by_id[worker_id]
            target = worker.pending[0] if worker.pending else worker.level
            if worker.alive and target != level_name:
                self._set_level(worker, level_name, now, background=self.policy.background_loads)
                changed = True
        if changed:
            self.plan_changes += 1
            self.plan_change_times.append(now)

    def _set_level(
        self, worker: _Worker, level_name: str, now: float, *, background: bool = False
    ) -> None:
        level = self.sim._levels[level_name]
        if worker.model == level.model:
            worker.level, worker.pending = level_name, None  # a K change: nothing to load
            return
        load = self.sim.profiles.switch_load_s(worker.worker_class, level_name, worker.model)
        self.model_switches += 1
        if background and worker.model is not None:
            if worker.pending is None or worker.pending[1] != level.model:
                worker.pending = (level_name, level.model, now + load)
                self.switch_times.append(now)
                self._push(now + load, "ready", self.worker_index[worker.worker_id])
            else:  # already loading its model: another K of it is ready at the same time
                worker.pending = (level_name, level.model, worker.pending[2])
                self.model_switches -= 1
            return
        start = max(worker.free_at, now)
        worker.free_at = worker.load_until = start + load
        self._enqueue(worker, -1, start)
        worker.level, worker.model, worker.pending = level_name, level.model, None
        self.switch_times.append(start)
        self._add_busy(start, worker.free_at)
        self._count_load(load)

    def _model_ready(self, worker: _Worker, now: float) -> None:
        """A background load's time is up: the worker now serves its new level. The event of
        a load that was cancelled (the plan moved the worker back) and begun again later is
        stale: it must not cut the new load short, so only a load due by ``now`` completes."""
        pending = worker.pending
        if pending is None or pending[2] > now:
            return
        if worker.alive:
            load = self.sim.profiles.switch_load_s(worker.worker_class, pending[0], worker.model)
            worker.level, worker.model, _ = pending
            self._count_load(load)
        worker.pending = None

    def _count_load(self, load_s: float) -> None:
        self.loads += 1
        self.load_s += load_s

    def _dispatch(self, i: int, now: float) -> None:
        self._finish_due(now)
        by_id = self.by_id

        def elapsed_s(worker_id: str) -> float:
            finishes = by_id[worker_id].finishes
            return now - finishes[0][2] if finishes else 0.0

        def latency_s(worker_id: str, level_name: str) -> float:
            worker = by_id[worker_id]
            return self._plan_latency(worker.worker_class, self._serving_level(worker, level_name))

        neighbours: Neighbours | None = None
        caches = self.caches
        if caches is not None:
            row, worker_index = self._row_list[i], self.worker_index
            asked: dict[tuple[str, str], float | None] = {}  # the probe and the choice share

            def neighbours(worker_id: str, model: str) -> float | None:
                key = (worker_id, model)
                if key not in asked:
                    asked[key] = caches.similarity(worker_index[worker_id], i, row, model, now)
                return asked[key]

        dispatch = Dispatch(
            self._queue_view,
            self._down,
            elapsed_s,
            latency_s,
            self.sim.admission_rule if self.cfg.admission else None,
            self.sim.slo_s - (now - self._arrival_list[i]),
            neighbours,
        )
        outcome = self.policy.decide(i, now, dispatch)
        if isinstance(outcome, Refused):
            self._refuse(i)
            return
        worker_id, level_name = outcome
        self.refused[i] = False  # a request routed again after a failure may be admitted now
        binder = self.binder
        if binder is not None:
            if not binder.has_room(worker_id) or binder.line(worker_id):
                self._hold(i, now, by_id[worker_id], level_name, latency_s)
                return
            binder.send(worker_id)
        self._serve(i, now, by_id[worker_id], level_name)

    def _hold(
        self,
        i: int,
        now: float,
        worker: _Worker,
        level_name: str,
        latency_s: Callable[[str, str], float],
    ) -> None:
        """Late binding: hold request ``i``, routed to ``worker`` at ``level_name``, until a
        worker has room (:meth:`_finish_due`)."""
        assert self.binder is not None
        level = self.sim._level_index[worker.level or level_name]

        def service_s(worker_id: str) -> float:
            return latency_s(worker_id, level_name)

        deadline = self._arrival_list[i] + self.sim.slo_s
        pinned = self.policy.tied_last
        served = self.sim._level_index[level_name]
        held = Held(i, worker.worker_id, level, served, deadline, service_s, pinned=pinned)
        self.binder.hold(held)
        self._queues[worker.worker_id] += 1
        if not pinned:  # another worker of its level may have room for it already
            for other in self.workers:
                if (
                    other is not worker
                    and other.alive
                    and other.level is not None
                    and self.sim._level_index[other.level] == level
                    and self.binder.has_room(other.worker_id)
                ):
                    self._take_held(other, now)

    def _finish_due(self, now: float) -> None:
        """Take off the workers' queues what has finished by ``now``: only the workers with an
        entry due, found on the ``_due`` heap."""
        due = self._due
        binder = self.binder
        if binder is None:
            while due and due[0][0] <= now:
                worker = self.workers[heapq.heappop(due)[1]]
                finishes = worker.finishes
                while finishes and finishes[0][0] <= now:
                    finishes.popleft()
                self._queues[worker.worker_id] = len(finishes)
            return
        # late binding: in time order, each answer frees room for a held request then
        while due and due[0][0] <= now:
            at, index = heapq.heappop(due)
            worker = self.workers[index]
            finishes, freed = worker.finishes, False
            while finishes and finishes[0][0] <= at:
                if finishes.popleft()[1] >= 0:
                    binder.done(worker.worker_id)
                    freed = True
            self._queues[worker.worker_id] = len(finishes) + binder.line(worker.worker_id)
            if len(binder):
                self._refuse_held(binder.expired(at))
                if freed and worker.alive and worker.level is not None:
                    self._take_held(worker, at)
        if len(binder):
            self._refuse_held(binder.expired(now))

    def _take_held(self, worker: _Worker, now: float) -> None:
        """Late binding: ``worker`` answered at ``now``; its held requests are predicted again
        and it takes held requests while it has room."""
        binder = self.binder
        assert binder is not None and worker.level is not None
        finishes = worker.finishes
        elapsed = now - finishes[0][2] if finishes else 0.0
        self._refuse_held(binder.overdue(worker.worker_id, now, elapsed))
        level = self.sim._level_index[worker.level]
        while True:
            held, late = binder.take(worker.worker_id, level, now, elapsed)
            self._refuse_held(late)
            if held is None:
                return
            self._queues[held.worker] -= 1
            self._serve(held.token, now, worker, self.sim.profiles.levels[held.served].name)

    def _refuse_held(self, late: list[Held]) -> None:
        self.refused_held += len(late)
        for held in late:
            self._queues[held.worker] -= 1
            self._refuse(held.token)

    def _enqueue(self, worker: _Worker, request: int, start: float) -> None:
        """Queue ``request`` (-1: a model load) on ``worker``, from ``start`` to its
        ``free_at``."""
        worker.finishes.append((worker.free_at, request, start))
        held = 0 if self.binder is None else self.binder.line(worker.worker_id)
        self._queues[worker.worker_id] = len(worker.finishes) + held
        heapq.heappush(self._due, (worker.free_at, self.worker_index[worker.worker_id]))

    def _refuse(self, i: int) -> None:
        """Request ``i`` is refused: it gets no worker, no image and no score."""
        self.refused[i] = True
        self.finish[i] = math.nan
        self.level[i] = -1
        self.worker[i] = -1
        self.score[i] = math.nan
        self.relative[i] = math.nan
        self._forget_lookup(i)

    def _forget_lookup(self, i: int) -> None:
        """Request ``i`` was refused or is routed again: its earlier lookup no longer counts."""
        self.cache_lookup[i] = self.cache_hit[i] = False
        self.similarity[i] = math.nan

    def _plan_latency(self, worker_class: str, level_name: str) -> float:
        """The level's latency on a class in the profiles the policies plan with: the router's
        t_proc."""
        key = (worker_class, level_name)
        cached = self._plan_latency_cache.get(key)
        if cached is None:
            cached = self.sim.plan_profiles.profile(worker_class, level_name).latency_s
            self._plan_latency_cache[key] = cached
        return cached

    def _serving_level(self, worker: _Worker, level_name: str) -> str:
        """The level ``worker`` serves a request routed to it at ``level_name``: its current
        level while ``level_name``'s model still loads in the background, else
        ``level_name``. The router is told the same (``Dispatch.latency_s``), as the live
        router learns it from the workers' replies."""
        pending = worker.pending
        if pending is None or worker.level is None:
            return level_name
        return worker.level if pending[1] == self.sim._levels[level_name].model else level_name

    def _serve(self, i: int, now: float, worker: _Worker, level_name: str) -> None:
        level = self.sim._levels[self._serving_level(worker, level_name)]
        if worker.model != level.model:  # a policy may route to a level the worker lacks
            self._set_level(worker, level_name, now)  # it loads it first
        service, served, similarity, feeds = self._service_time(worker, level, now, i)
        self.load_waits[i] = worker.load_until > now  # queued behind a model load
        start = max(worker.free_at, now)
        service += self._adapter_time(worker.worker_class, served, i, start - now)
        service *= self._jitter_list[i]
        worker.free_at = start + service
        self._enqueue(worker, i, start)
        self._add_busy(start, worker.free_at)
        self.finish[i] = worker.free_at
        self.level[i] = self.sim._level_index[served.name]
        self.worker[i] = self.worker_index[worker.worker_id]
        row = self._row_list[i]
        score = self._scores[served.strategy][row][self.sim._strategy_index[served.name]]
        best = self._best_scores[served.strategy][row]
        if similarity is not None:  # resumed from a neighbour that is not the prompt itself
            score = self.sim.reuse_quality.score(score, best, similarity, served.skip_steps)
        if feeds and self.caches is not None:
            self.caches.feed(self.worker[i], i, row, served.model, worker.free_at)
        self.score[i] = score
        self.relative[i] = score / best

    def _add_busy(self, start: float, end: float) -> None:
        """Count [start, end) as busy GPU time, split over the minutes it spans."""
        self.busy_s += end - start
        busy = self.busy_by_minute
        while start < end:
            minute = int(start // 60.0)
            if minute >= len(busy):
                busy.extend([0.0] * (minute + 1 - len(busy)))
            stop = min(end, (minute + 1) * 60.0)
            busy[minute] += stop - start
            start = stop

    def _service_time(
        self, worker: _Worker, level: Level, now: float, i: int
    ) -> tuple[float, Level, float | None, bool]:
        """Request ``i`` at ``level`` on ``worker``: service seconds on its class, the level
        actually served (K = 0 after a failed retrieval or a realistic-mode miss, the K the
        neighbour allows after a realistic-mode hit), that neighbour's similarity (None: the
        table's score holds) and whether the run feeds the cache (a full run on an AC model:
        K = 0, a miss, or an SM level on that model)."""
        worker_class = worker.worker_class
        base = self._latency(worker_class, level.name)
        if level.strategy is not Strategy.AC:  # a full run on an AC model feeds its cache
            return base, level, None, level.model in self.sim.ac_levels
        if level.skip_steps == 0:
            return base, level, None, True
        self.cache_lookup[i] = True
        extra = self._retrieval_extra(now)
        if math.isinf(extra):
            self.policy.observe_retrieval(now, None)
            full = self.sim.profiles.levels_for(Strategy.AC)[0]
            if self.caches is not None:
                full = self.sim.ac_levels[level.model][0]
            timeout = self.cfg.retrieval_timeout_s
            return timeout + self._latency(worker_class, full.name), full, None, False
        self.policy.observe_retrieval(now, self.cfg.retrieval_s + extra)
        if self.caches is None:  # perfect: the prompt itself is cached at every K
            self.cache_hit[i] = True
            self.similarity[i] = 1.0
            return base + extra, level, None, False
        return self._look_up(worker, level, now, i, extra)

    def _look_up(
        self, worker: _Worker, level: Level, now: float, i: int, extra: float
    ) -> tuple[float, Level, float | None, bool]:
        """:meth:`_service_time` of a realistic-mode lookup (retrieval up, ``extra`` slower)."""
        assert self.caches is not None
        index = self.worker_index[worker.worker_id]
        found = self.caches.look_up(index, i, self._row_list[i], level.model, level.skip_steps, now)
        self.similarity[i] = found.similarity
        self.policy.observe_lookup(now, level.name, found.similarity)
        if found.step == 0:  # a miss: the search ran, then the full generation
            full = self.sim.ac_levels[level.model][0]
            latency = self._latency(worker.worker_class, full.name)
            return self.cfg.retrieval_s + extra + latency, full, None, True
        self.cache_hit[i] = True
        served = self.sim.ac_levels[level.model][found.step]
        latency = self._latency(worker.worker_class, served.name)
        return latency + extra, served, found.similarity, False

    def _adapter_time(self, worker_class: str, level: Level, i: int, wait_s: float) -> float:
        """Seconds request ``i``'s adapters add at ``level`` on a class after waiting
        ``wait_s`` queued."""
        model, draws = self.cfg.adapters, self.sim.adapter_draws
        if model is None or draws is None:
            return 0.0
        key = (worker_class, level.name)
        cost = self._adapter_costs.get(key)
        if cost is None:
            latency = self._latency(worker_class, level.name)
            cost = adapter_cost(model, draws, latency, level.skip_steps)
            self._adapter_costs[key] = cost
            self._adapter_lists[key] = (cost.fixed_s.tolist(), cost.hideable_s.tolist())
        fixed, hideable = self._adapter_lists[key]
        added = fixed[i] + max(hideable[i] - wait_s, 0.0)
        self.adapter_s += added
        return added

    def _latency(self, worker_class: str, level_name: str) -> float:
        key = (worker_class, level_name)
        cached = self._latency_cache.get(key)
        if cached is None:
            cached = self.sim.profiles.profile(worker_class, level_name).latency_s
            self._latency_cache[key] = cached
        return cached

    # -- faults ------------------------------------------------------------------------------

    def _fail_workers(self, now: float, count: int) -> None:
        victims = [w for w in self.workers if w.alive][-count:]
        orphans: list[int] = []
        for worker in victims:
            worker.alive = False
            if self.caches is not None:
                self.caches.forget_unfinished(self.worker_index[worker.worker_id], now)
            for finish, request, _ in worker.finishes:
                if finish > now and request >= 0:
                    orphans.append(request)
                    self._forget_lookup(request)
            worker.finishes.clear()
            self._queues[worker.worker_id] = 0
            worker.free_at = worker.load_until = now
            worker.level = None
            worker.model = None
            worker.pending = None
        self._down = frozenset(w.worker_id for w in self.workers if not w.alive)
        if self.binder is not None:  # their held requests are routed again too
            alive = {w.worker_id for w in self.workers if w.alive}
            orphans.extend(held.token for held in self.binder.forget(alive))
        for request in sorted(orphans):  # the router retries them elsewhere at once
            self._dispatch(request, now)

    def _recover_workers(self, count: int) -> None:
        for worker in [w for w in self.workers if not w.alive][:count]:
            worker.alive = True
        self._down = frozenset(w.worker_id for w in self.workers if not w.alive)

    # -- result ------------------------------------------------------------------------------

    def _result(self) -> RunResult:
        duration = self.sim.workload.duration_s  # the horizon when known, else the last arrival
        finish = np.array(self.finish, dtype=np.float64)
        refused = np.array(self.refused, dtype=np.bool_)
        served = finish[~refused]
        end = max(duration, float(served.max()) if len(served) else 0.0)
        strategy_switches = int(getattr(self.policy, "strategy_switches", 0))
        return RunResult(
            policy=self.policy.name,
            arrivals_s=self.arrivals,
            finish_s=finish,
            level=np.array(self.level, dtype=np.int64),
            worker=np.array(self.worker, dtype=np.int64),
            score=np.array(self.score, dtype=np.float64),
            relative=np.array(self.relative, dtype=np.float64),
            slo_s=self.sim.slo_s,
            model_switches=self.model_switches,
            plan_changes=self.plan_changes,
            busy_s=self.busy_s,
            gpu_seconds=self.cfg.gpus * end,
            duration_s=duration,
            strategy_switches=strategy_switches,
            switch_times_s=self.switch_times,
            plan_change_times_s=self.plan_change_times,
            busy_by_minute_s=self.busy_by_minute,
            gpus=self.cfg.gpus,
            adapter_s=self.adapter_s,
            refused=refused,
            worker_classes=tuple(w.worker_class for w in self.workers),
            refused_early=int(getattr(self.policy, "early_refusals", 0)),
            refused_held=self.refused_held,
            fallbacks=int(getattr(self.policy, "fallbacks", 0)),
            spills=int(getattr(self.policy, "spills", 0)),
            loads=self.loads,
            load_s=self.load_s,
            load_waits=np.array(self.load_waits, dtype=np.bool_) & ~refused,
            cache=self.cfg.cache,
            cache_lookup=np.array(self.cache_lookup, dtype=np.bool_),
            cache_hit=np.array(self.cache_hit, dtype=np.bool_),
            similarity=np.array(self.similarity, dtype=np.float64),
            cache_inserts=0 if self.caches is None else self.caches.inserts,
            cache_evictions=0 if self.caches is None else self.caches.evictions,
        )


def with_table_quality(
    profiles: ProfileSet, quality: Mapping[Strategy, QualityTable]
) -> ProfileSet:
    """The profiles with each level's Q replaced by its quality table's mean score relative to
    the strategy's best level: Q is "profiled average quality" (Argus §4.2), and in simulation
    the table is the profile. Strategies without a table keep their Q."""
    levels = []
    for level in profiles.levels:
        table = quality.get(level.strategy)
        if table is None:
            levels.append(level)
            continue
        means = table.scores.mean(axis=0)
        index = list(table.levels).index(level.name)
        levels.append(replace(level, quality=float(min(1.0, means[index] / means.max()))))
    return replace(profiles, levels=tuple(levels))
