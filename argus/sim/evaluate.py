"""``argus evaluate``: the Argus paper's load sweep (§5.3, Fig. 17) as one command.

Every policy replays the same workloads at several offered loads, each load a multiple of the
cluster's capacity, over several paired seeds; the command reports effective quality, goodput,
refusals and SLO violations against load, with 95 % intervals over the seeds.

Capacity (:func:`cluster_capacity_qpm`): the sum over the workers of the throughput of the
fastest level of the default strategy (AC) on each worker's GPU class, in the profiles the
policies plan with (so with adapters on, each level's throughput includes the mean seconds
the adapters add; the mean is taken over :data:`CAPACITY_DRAWS` requests drawn with seed 0,
and each run's own draws differ from it by sampling noise only). Above 1.0 × capacity no
policy can serve every request, even at the fastest level.

Workloads (:func:`seeded_workload`): for load point ``L`` the target mean is
``L × capacity`` QPM. The trace (``poisson`` by default; any ``argus replay --trace``) is
first generated or fitted to ``duration_min`` minutes — the synthetic shapes (poisson, gamma,
bursty, ramp) at the rate scale that puts their nominal mean at the target, so their
randomness is that of the target rate — and then rescaled exactly by
:func:`rescale_to_load`:

1. the per-minute rates ``r_m`` of the trace are mapped to target rates: with a mean only,
   ``r'_m = r_m × M / r̄`` (the trace's shape, relative burstiness kept); with
   ``--target-load MEAN:PEAK``, the affine map ``r'_m = M + (r_m − r̄)(P − M)/(max r − r̄)``,
   which gives mean ``M`` and busiest minute ``P`` exactly (an error names the largest
   feasible peak when the quietest minute would need a negative rate);
2. each minute gets a whole number of arrivals: the target counts rounded on their running
   sum, so every minute is within one request of its target and the total is exact;
3. each minute is thinned or filled to its count, seeded: a minute with more arrivals than
   wanted keeps a uniformly random subset of them (bursts within the minute stay); one with
   fewer keeps all and adds copies of randomly chosen arrivals, each placed uniformly between
   its original and the next arrival of the minute (an empty minute is filled uniformly).

Seeds. Seed ``s`` (0 … seeds − 1) sets the arrival process and the thinning, the order of the
prompts, the service-time jitter, the adapters drawn and the policies' random streams; the
quality tables are SYNTHETIC (:func:`argus.sim.quality.synthetic_quality_table`) drawn with
seed ``1000 + s``, never seed 0, on which the committed classifier was trained. All policies of
one (load, seed) see the same workload, tables and cluster, so differences between them are
paired. Prompts come only from the evaluation set of :mod:`argus.prompt_split`.

Policies run through :func:`argus.sim.policies.make_policy` and the trained or oracle
classifier of :func:`argus.sim.policies.make_classifier`, on :class:`~argus.sim.cluster.
Simulation`, exactly as ``argus replay`` runs them. When both ``argus`` and ``pac`` run, an
extra ``argus-oracle`` run (Argus with the quality table's own optimal levels) measures how
much of the oracle's gain over PAC the trained classifier keeps:
``(Q_argus − Q_pac) / (Q_argus-oracle − Q_pac)`` on the mean effective qualities of a load,
reported only where the oracle's paired gain over PAC has a 95 % interval above zero (there is
no gap to close where every policy runs the fastest level, and the ratio of two noisy
near-zero differences means nothing).

Intervals (:func:`mean_interval`): mean ± t(0.975, n − 1) × s / √n over the n seeds
(Student's t; none with one seed). A run whose requests all miss the SLO has no effective
quality; its seed is left out of the quality mean, and the interval says over how many seeds.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from argus.prompt_split import PromptSet, select
from argus.sim.report import Summary, summarise
from argus.sim.workloads import Workload, workload_by_name
from argus.traces import PromptRecord
from argus.types import ProfileSet, Strategy

if TYPE_CHECKING:
    from argus.contracts.quality import QualityTable
    from argus.sim.classifiers import Classifier
    from argus.sim.quality import SyntheticModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

DEFAULT_LOADS = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5)
DEFAULT_POLICIES = ("argus", "pac", "proteus", "clipper-ha", "clipper-ht", "sommelier", "nirvana")
ORACLE_POLICY = "argus-oracle"  # argus with make_classifier("oracle"), run beside argus and pac
QUALITY_SEED_BASE = 1000  # quality tables of seed s are drawn with 1000 + s
CAPACITY_DRAWS = 100_000  # requests drawn (seed 0) for the adapters' mean seconds in capacity
SYNTHETIC_SHAPES = ("poisson", "gamma", "bursty", "ramp")

# metrics aggregated over seeds, in the order of aggregate.csv (Summary field names)
METRICS = (
    "effective_quality",
    "relative_quality",
    "quality_n",
    "offered_qpm",
    "admitted_qpm",
    "refused_qpm",
    "goodput_qpm",
    "slo_violation_ratio_admitted",
    "slo_violation_ratio",
)


class EvaluationError(ValueError):
    """Bad evaluation settings; the message is one line."""


@dataclass(frozen=True)
class LoadPoint:
    """One offered load, in multiples of the cluster's capacity."""

    mean: float  # mean offered load / capacity
    peak: float | None = None  # busiest minute / capacity; None: the trace's own shape, scaled

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean > 0.0):
            raise EvaluationError(f"load: must be > 0, got {self.mean!r}")
        if self.peak is not None and not (math.isfinite(self.peak) and self.peak >= self.mean):
            raise EvaluationError(
                f"load {self.mean:g}: peak must be >= the mean, got {self.peak!r}"
            )

    @property
    def label(self) -> str:
        return f"{self.mean:g}" if self.peak is None else f"{self.mean:g}:{self.peak:g}"


@dataclass(frozen=True)
class EvaluationConfig:
    """What ``argus evaluate`` runs (one field per flag)."""

    loads: tuple[LoadPoint, ...] = tuple(LoadPoint(x) for x in DEFAULT_LOADS)
    """Offered loads, multiples of the capacity (``--loads``, or ``--target-load``)."""

    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies by :func:`~argus.sim.policies.make_policy` name (``--policies``)."""

    seeds: int = 5
    """Paired seeds 0 … seeds − 1 (``--seeds``)."""

    duration_min: float = 30.0
    """Minutes of trace per run (``--duration``)."""

    trace: str = "poisson"
    """A workload name of ``argus replay --trace`` or a trace file (``--trace``)."""

    prompts_path: str | None = None
    """Prompt file (``--prompts``); its evaluation-set prompts are used. None: PartiPrompts."""

    gpu_counts: tuple[tuple[str, int], ...] = ()
    """(GPU class, count) pairs (``--gpus``); empty: 8 of the profiles' first class."""

    profiles: str = "default"
    """``default`` or a profile file (``--profiles``)."""

    adapters: str = "katz"
    """Adapter model of ``argus replay --adapters`` (``--adapters``)."""

    classifier: str = "default"
    """Classifier of argus and nirvana, a :func:`make_classifier` spec (``--classifier``)."""

    admission: bool = True
    """The router's admission in the simulator (``--no-admission`` turns it off)."""

    jobs: int = 1
    """Worker processes; each runs whole (load, seed) points (``--jobs``)."""

    def __post_init__(self) -> None:
        if not self.loads:
            raise EvaluationError("loads: no load given")
        if not self.policies:
            raise EvaluationError("policies: no policy given")
        if ORACLE_POLICY in self.policies:
            raise EvaluationError(
                f"policies: {ORACLE_POLICY!r} is added by itself when argus and pac both run"
            )
        if len(set(self.policies)) != len(self.policies):
            raise EvaluationError(f"policies: a policy is named twice in {self.policies}")
        if self.seeds < 1:
            raise EvaluationError(f"seeds: must be >= 1, got {self.seeds}")
        if not (math.isfinite(self.duration_min) and self.duration_min > 0.0):
            raise EvaluationError(f"duration_min: must be > 0, got {self.duration_min!r}")
        if self.jobs < 1:
            raise EvaluationError(f"jobs: must be >= 1, got {self.jobs}")

    @property
    def with_oracle(self) -> bool:
        """Whether the argus-oracle run (and the gap share) is part of the evaluation."""
        return "argus" in self.policies and "pac" in self.policies

    def run_names(self) -> tuple[str, ...]:
        """Policies as labelled in the results: the chosen ones, then argus-oracle."""
        return self.policies + ((ORACLE_POLICY,) if self.with_oracle else ())


# -- capacity ----------------------------------------------------------------------------------


def planning_profiles(
    profiles: ProfileSet, adapters: str, *, draws: int = CAPACITY_DRAWS, seed: int = 0
) -> ProfileSet:
    """The profiles policies plan with: ``profiles`` with the mean seconds of the adapter
    model's adapters added (``draws`` requests drawn with ``seed``); unchanged without."""
    from argus.sim.adapters import adapter_model_by_name, draw_adapters, with_adapter_costs

    model = adapter_model_by_name(adapters)
    if model is None:
        return profiles
    sample = draw_adapters(draws, np.random.default_rng(seed), model.mix)
    return with_adapter_costs(profiles, model, sample)


def cluster_capacity_qpm(
    plan_profiles: ProfileSet,
    gpu_counts: Iterable[tuple[str, int]],
    strategy: Strategy = Strategy.AC,
) -> float:
    """QPM the cluster serves with every worker at the fastest level of ``strategy``: the sum
    over workers of that level's throughput on the worker's class."""
    levels = plan_profiles.levels_for(strategy)
    if not levels:
        raise EvaluationError(f"the profiles have no {strategy} level")
    total = 0.0
    for worker_class, count in gpu_counts:
        fastest = max(plan_profiles.profile(worker_class, lv.name).throughput_qpm for lv in levels)
        total += count * fastest
    return total


# -- rescaling a trace to a load ----------------------------------------------------------------


def minute_lengths(duration_s: float) -> FloatArray:
    """Seconds in each minute of a run of ``duration_s`` (the last may be partial)."""
    minutes = max(1, math.ceil(duration_s / 60.0 - 1e-9))
    lengths = np.full(minutes, 60.0)
    lengths[-1] = duration_s - 60.0 * (minutes - 1) if duration_s > 0 else 60.0
    return lengths


def target_rates(
    rates_qpm: FloatArray, lengths_s: FloatArray, mean_qpm: float, peak_qpm: float | None = None
) -> FloatArray:
    """Per-minute target rates with length-weighted mean ``mean_qpm`` and, when ``peak_qpm``
    is given, maximum ``peak_qpm`` (see the module docstring for the two maps)."""
    weights = lengths_s / lengths_s.sum()
    average = float(np.dot(rates_qpm, weights))
    if average <= 0.0:
        raise EvaluationError("the trace has no arrivals to rescale")
    if peak_qpm is None:
        scaled: FloatArray = rates_qpm * (mean_qpm / average)
        return scaled
    if peak_qpm < mean_qpm:
        raise EvaluationError(f"peak {peak_qpm:g} QPM is below the mean {mean_qpm:g} QPM")
    top = float(rates_qpm.max())
    if top - average <= 1e-9 * average:
        if peak_qpm - mean_qpm <= 1e-9 * mean_qpm:
            return np.full_like(rates_qpm, mean_qpm)
        raise EvaluationError(
            "every minute of the trace has the same rate: it has no busiest minute to scale "
            f"to a peak of {peak_qpm:g} QPM"
        )
    mapped: FloatArray = mean_qpm + (rates_qpm - average) * (
        (peak_qpm - mean_qpm) / (top - average)
    )
    low = float(mapped.min())
    if low < -1e-9:
        quietest = float(rates_qpm.min())
        largest = mean_qpm + (top - average) * mean_qpm / (average - quietest)
        raise EvaluationError(
            f"a peak of {peak_qpm:g} QPM over a mean of {mean_qpm:g} QPM would need "
            f"{low:.1f} QPM in the trace's quietest minute; the largest peak this trace "
            f"allows at that mean is {largest:.1f} QPM"
        )
    clipped: FloatArray = np.maximum(mapped, 0.0)
    return clipped


def whole_counts(expected: FloatArray) -> IntArray:
    """Whole arrivals per minute: ``expected`` rounded on its running sum (each minute within
    one of its expectation, the total the rounded total)."""
    running = np.floor(np.cumsum(expected) + 0.5)
    counts: IntArray = np.diff(running, prepend=0.0).astype(np.int64)
    return counts


def _fill_minute(
    chunk: FloatArray, count: int, start_s: float, end_s: float, rng: np.random.Generator
) -> FloatArray:
    """``count`` arrival times in [start_s, end_s) from the minute's own ``chunk``."""
    have = chunk.size
    if count <= have:
        keep = np.sort(rng.choice(have, size=count, replace=False))
        kept: FloatArray = chunk[keep]
        return kept
    if have == 0:
        return start_s + rng.random(count) * (end_s - start_s)
    origins = rng.integers(0, have, size=count - have)
    gaps = np.append(chunk[1:], end_s) - chunk
    extra = chunk[origins] + rng.random(origins.size) * gaps[origins]
    return np.concatenate([chunk, extra])


def rescale_to_load(
    workload: Workload,
    mean_qpm: float,
    peak_qpm: float | None = None,
    *,
    seed: int | np.random.Generator = 0,
) -> Workload:
    """``workload`` with mean rate ``mean_qpm`` and, with ``peak_qpm``, busiest minute
    ``peak_qpm``, over the same duration (see the module docstring). The prompts are kept."""
    duration = workload.duration_s
    if duration <= 0.0 or len(workload) == 0:
        raise EvaluationError(f"workload {workload.name!r} is empty: nothing to rescale")
    if not (math.isfinite(mean_qpm) and mean_qpm > 0.0):
        raise EvaluationError(f"mean_qpm: must be > 0, got {mean_qpm!r}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    lengths = minute_lengths(duration)
    arrivals = workload.arrivals_s
    index = np.minimum((arrivals // 60.0).astype(np.int64), lengths.size - 1)
    counts = np.bincount(index, minlength=lengths.size).astype(np.float64)
    targets = target_rates(counts * 60.0 / lengths, lengths, mean_qpm, peak_qpm)
    wanted = whole_counts(targets * lengths / 60.0)
    bounds = np.searchsorted(index, np.arange(lengths.size + 1))
    pieces = [
        _fill_minute(
            arrivals[bounds[m] : bounds[m + 1]],
            int(wanted[m]),
            60.0 * m,
            60.0 * m + float(lengths[m]),
            rng,
        )
        for m in range(lengths.size)
    ]
    out = np.sort(np.concatenate(pieces))
    shape = f"mean {mean_qpm:.1f} QPM" + ("" if peak_qpm is None else f", peak {peak_qpm:.1f}")
    return Workload(
        workload.name,
        out,
        workload.prompts,
        f"{workload.source}; per-minute rate mapped to {shape}",
        horizon_s=duration,
    )


# -- one seed's inputs --------------------------------------------------------------------------


def eval_prompts(prompts_path: str | None) -> tuple[PromptRecord, ...]:
    """The evaluation-set prompts of the prompt file (PartiPrompts when None); each seed
    permutes them, so their order here does not matter."""
    from argus.sim.workloads import _default_prompts, load_prompt_file

    records = _default_prompts() if prompts_path is None else load_prompt_file(prompts_path)
    chosen = select(records, PromptSet.EVAL)
    if not chosen:
        where = prompts_path or "PartiPrompts"
        raise EvaluationError(f"{where}: none of its {len(records)} prompts is in the eval set")
    return chosen


def seeded_workload(
    config: EvaluationConfig,
    point: LoadPoint,
    capacity_qpm: float,
    seed: int,
    prompts: Sequence[PromptRecord],
) -> Workload:
    """The workload of one (load, seed): the trace at ``point`` × capacity, the evaluation
    prompts in seed ``seed``'s order."""
    target = point.mean * capacity_qpm
    peak = None if point.peak is None else point.peak * capacity_qpm
    base = workload_by_name(config.trace, duration_min=config.duration_min, seed=seed)
    if config.trace.strip().lower() in SYNTHETIC_SHAPES and base.mean_qpm() > 0.0:
        scale = target / base.mean_qpm()  # generated at about the target rate
        base = workload_by_name(
            config.trace, duration_min=config.duration_min, scale=scale, seed=seed
        )
    rng = np.random.default_rng([seed, 1])
    shaped = rescale_to_load(base, target, peak, seed=rng)
    order = np.random.default_rng([seed, 2]).permutation(len(prompts))
    return Workload(
        shaped.name,
        shaped.arrivals_s,
        tuple(prompts[i] for i in order),
        f"{shaped.source}; eval-set prompts in seed {seed}'s order",
        horizon_s=shaped.horizon_s,
    )


def quality_tables(
    profiles: ProfileSet,
    prompts: Sequence[PromptRecord],
    seed: int,
    models: Mapping[Strategy, SyntheticModel] | None = None,
) -> dict[Strategy, QualityTable]:
    """SYNTHETIC quality tables of seed ``seed``'s evaluation (drawn with 1000 + seed), of
    the synthetic model ``models[strategy]`` (default: the calibrated ``SYNTHETIC_MODELS``)."""
    from argus.sim.quality import synthetic_quality_table

    return {
        s: synthetic_quality_table(
            prompts,
            s,
            [lv.name for lv in profiles.levels_for(s)],
            seed=QUALITY_SEED_BASE + seed,
            model=None if models is None else models[s],
        )
        for s in Strategy
    }


# -- the runs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRow:
    """One (load, seed, policy) run: its settings and its summary."""

    load: float  # mean offered load / capacity
    peak: float | None  # busiest minute / capacity, when set
    target_qpm: float  # load × capacity
    seed: int
    policy: str
    summary: Summary
    wall_s: float  # seconds the run took on this machine

    def record(self) -> dict[str, Any]:
        """The row of runs.csv."""
        row: dict[str, Any] = {
            "load": self.load,
            "peak": "" if self.peak is None else self.peak,
            "target_qpm": round(self.target_qpm, 3),
            "seed": self.seed,
        }
        row.update(asdict(self.summary))
        row["policy"] = self.policy
        row["wall_s"] = round(self.wall_s, 3)
        return row


_CLASSIFIERS: dict[str, Any] = {}  # make_classifier(spec) per process: load a model once


def _classifier(spec: str) -> Any:
    from argus.sim.classifiers import make_classifier

    if spec not in _CLASSIFIERS:
        _CLASSIFIERS[spec] = make_classifier(spec)
    return _CLASSIFIERS[spec]


def gpu_counts_of(config: EvaluationConfig, profiles: ProfileSet) -> tuple[tuple[str, int], ...]:
    """The cluster: ``config.gpu_counts``, or 8 GPUs of the profiles' first class."""
    return config.gpu_counts or ((profiles.worker_classes[0], 8),)


def run_point(
    config: EvaluationConfig,
    point: LoadPoint,
    seed: int,
    capacity_qpm: float,
    *,
    classifier: Classifier | None = None,
    models: Mapping[Strategy, SyntheticModel] | None = None,
) -> list[RunRow]:
    """Every policy (and argus-oracle) on the workload and tables of one (load, seed).

    ``classifier`` stands in for ``config.classifier`` (argus and nirvana), for a caller that
    trained one in memory; ``models`` are the synthetic quality model of each strategy
    (:func:`quality_tables`)."""
    from argus.profiles import load_profiles
    from argus.sim.adapters import adapter_model_by_name
    from argus.sim.cluster import SimConfig, Simulation
    from argus.sim.policies import make_policy

    profiles = load_profiles(config.profiles)
    prompts = eval_prompts(config.prompts_path)
    workload = seeded_workload(config, point, capacity_qpm, seed, prompts)
    tables = quality_tables(profiles, workload.prompts, seed, models)
    sim_config = SimConfig.with_classes(
        dict(gpu_counts_of(config, profiles)),
        seed=seed,
        adapters=adapter_model_by_name(config.adapters),
        admission=config.admission,
    )
    sim = Simulation(profiles, tables, workload, sim_config)
    if classifier is None:
        classifier = _classifier(config.classifier)
    rows = []
    for name in config.run_names():
        if name == ORACLE_POLICY:
            policy = make_policy("argus", classifier=_classifier("oracle"), seed=seed)
        else:
            policy = make_policy(name, classifier=classifier, seed=seed)
        started = time.perf_counter()
        result = sim.run(policy)
        wall = time.perf_counter() - started
        summary = summarise(result)
        if name == ORACLE_POLICY:
            summary = _relabel(summary, ORACLE_POLICY)
        target = point.mean * capacity_qpm
        rows.append(RunRow(point.mean, point.peak, target, seed, name, summary, wall))
    return rows


def _relabel(summary: Summary, policy: str) -> Summary:
    from dataclasses import replace

    return replace(summary, policy=policy)


def _run_task(task: tuple[EvaluationConfig, LoadPoint, int, float]) -> list[RunRow]:
    return run_point(*task)


@dataclass(frozen=True)
class Evaluation:
    """Everything ``argus evaluate`` measured."""

    config: EvaluationConfig
    capacity_qpm: float
    rows: tuple[RunRow, ...]
    wall_s: float
    classifier_label: str
    quality_source: str
    slo_s: float
    gpu_counts: tuple[tuple[str, int], ...] = field(default_factory=tuple)


def check_inputs(config: EvaluationConfig) -> tuple[ProfileSet, float, str]:
    """Load what the runs need once, failing early: (profiles, capacity QPM, classifier
    label). Raises EvaluationError, WorkloadError, ProfileError or ValueError."""
    from argus.profiles import load_profiles
    from argus.sim.policies import make_policy

    profiles = load_profiles(config.profiles)
    counts = gpu_counts_of(config, profiles)
    for worker_class, _ in counts:
        if worker_class not in profiles.worker_classes:
            raise EvaluationError(
                f"GPU class {worker_class!r} has no profiles; the profiles know "
                f"{', '.join(profiles.worker_classes)}"
            )
    for name in config.policies:
        make_policy(name)  # unknown names fail here, quoted
    classifier = _classifier(config.classifier)
    plan = planning_profiles(profiles, config.adapters)
    capacity = cluster_capacity_qpm(plan, counts)
    prompts = eval_prompts(config.prompts_path)
    prepare = getattr(classifier, "prepare", None)
    if prepare is not None and {"argus", "nirvana"} & set(config.policies):
        prepare(quality_tables(profiles, prompts, 0))  # labels match, models load: one line
    seeded_workload(config, config.loads[0], capacity, 0, prompts)  # the trace reads
    return profiles, capacity, str(classifier.label)


def evaluate(
    config: EvaluationConfig, progress: Callable[[int, int], None] | None = None
) -> Evaluation:
    """Run the sweep; ``progress(done, total)`` after each (load, seed) point."""
    started = time.perf_counter()
    profiles, capacity, label = check_inputs(config)
    tasks = [
        (config, point, seed, capacity) for point in config.loads for seed in range(config.seeds)
    ]
    rows: list[RunRow] = []
    if config.jobs == 1:
        for done, task in enumerate(tasks, 1):
            rows.extend(_run_task(task))
            if progress is not None:
                progress(done, len(tasks))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no torch state shared across a fork
        with ProcessPoolExecutor(max_workers=config.jobs, mp_context=context) as pool:
            for done, chunk in enumerate(pool.map(_run_task, tasks), 1):
                rows.extend(chunk)
                if progress is not None:
                    progress(done, len(tasks))
    from argus.sim.cluster import SimConfig

    counts = gpu_counts_of(config, profiles)
    slowest = max(profiles.best_latency_s(c) for c, _ in counts)
    return Evaluation(
        config=config,
        capacity_qpm=capacity,
        rows=tuple(rows),
        wall_s=time.perf_counter() - started,
        classifier_label=label,
        quality_source=(f"SYNTHETIC: argus/sim/quality.py, tables of seed {QUALITY_SEED_BASE} + s"),
        slo_s=SimConfig().slo_factor * slowest,
        gpu_counts=counts,
    )


# -- statistics --------------------------------------------------------------------------------

# t(0.975, df) for df = 1 … 30 (Student's t, two-sided 95 %)
_T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom: a table up to 30,
    the Cornish-Fisher expansion beyond (error below 1e-5 there)."""
    if df < 1:
        raise ValueError(f"df: must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its two-sided 95 % t-interval (NaN bounds with one value)."""

    mean: float
    lo: float
    hi: float
    n: int  # values averaged (finite ones)

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0


def mean_interval(values: Iterable[float]) -> Interval:
    """Mean ± t(0.975, n − 1) × sample standard deviation / √n of the finite ``values``."""
    data = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    n = int(data.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(data.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile_975(n - 1) * float(data.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def _metric(summary: Summary, name: str) -> float:
    value = float(getattr(summary, name))
    if name in ("effective_quality", "relative_quality") and summary.quality_n == 0:
        return math.nan  # no request met the SLO: no quality to average
    return value


@dataclass(frozen=True)
class Aggregate:
    """Every metric of one (load, policy) over the seeds."""

    load: float
    peak: float | None
    policy: str
    metrics: Mapping[str, Interval]


def aggregate(rows: Sequence[RunRow]) -> list[Aggregate]:
    """One :class:`Aggregate` per (load point, policy), in the order the rows came."""
    groups: dict[tuple[float, float | None, str], list[Summary]] = {}
    for row in rows:
        groups.setdefault((row.load, row.peak, row.policy), []).append(row.summary)
    return [
        Aggregate(
            load,
            peak,
            policy,
            {name: mean_interval(_metric(s, name) for s in summaries) for name in METRICS},
        )
        for (load, peak, policy), summaries in groups.items()
    ]


@dataclass(frozen=True)
class Paired:
    """Argus against PAC at one load, paired by seed."""

    load: float
    peak: float | None
    quality_diff: Interval  # effective quality, argus − pac
    goodput_diff: Interval  # goodput QPM, argus − pac
    oracle_diff: Interval  # effective quality, argus-oracle − pac (n = 0 when it did not run)
    argus_quality: float  # means over the seeds
    pac_quality: float
    oracle_quality: float  # argus-oracle's; NaN when it did not run
    gap_closed: float  # (argus − pac) / (argus-oracle − pac); NaN when there is no gap


def paired(rows: Sequence[RunRow]) -> list[Paired]:
    """Argus − PAC per load (seeds where both ran), and the share of the oracle's gain over
    PAC that Argus keeps (on the loads where argus, pac and argus-oracle all ran).

    The share is only defined where there is a gain to share: where argus-oracle beats PAC,
    by a paired 95 % interval above zero (with one seed, by a positive difference). Elsewhere
    (the oracle is no better than PAC, typically at loads where every policy runs the
    fastest level) it is NaN, as a ratio of two noisy near-zero numbers means nothing."""
    by_key: dict[tuple[float, float | None], dict[str, dict[int, Summary]]] = {}
    for row in rows:
        by_key.setdefault((row.load, row.peak), {}).setdefault(row.policy, {})[row.seed] = (
            row.summary
        )
    out = []
    for (load, peak), policies in by_key.items():
        argus, pac = policies.get("argus"), policies.get("pac")
        if argus is None or pac is None:
            continue
        seeds = sorted(set(argus) & set(pac))
        quality = [
            _metric(argus[s], "effective_quality") - _metric(pac[s], "effective_quality")
            for s in seeds
        ]
        goodput = [argus[s].goodput_qpm - pac[s].goodput_qpm for s in seeds]
        means = {
            name: mean_interval(_metric(runs[s], "effective_quality") for s in seeds).mean
            for name, runs in policies.items()
            if all(s in runs for s in seeds)
        }
        q_argus, q_pac = means["argus"], means["pac"]
        q_oracle = means.get(ORACLE_POLICY, math.nan)
        oracle = policies.get(ORACLE_POLICY, {})
        oracle_diff = mean_interval(
            _metric(oracle[s], "effective_quality") - _metric(pac[s], "effective_quality")
            for s in seeds
            if s in oracle
        )
        closed = math.nan
        if _gain(oracle_diff):
            closed = (q_argus - q_pac) / (q_oracle - q_pac)
        out.append(
            Paired(
                load,
                peak,
                mean_interval(quality),
                mean_interval(goodput),
                oracle_diff,
                q_argus,
                q_pac,
                q_oracle,
                closed,
            )
        )
    return out


def _gain(diff: Interval) -> bool:
    """Whether a paired difference is a gain: its interval is above zero (one seed: > 0)."""
    if diff.n == 0 or not diff.mean > 0.0:
        return False
    return diff.n == 1 or diff.lo > 0.0


# -- files and the printed table ----------------------------------------------------------------


def write_evaluation(evaluation: Evaluation, out_dir: Path) -> dict[str, Path]:
    """Write runs.csv, aggregate.csv, paired.csv, summary.json and the three PNG plots;
    returns their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "runs": out_dir / "runs.csv",
        "aggregate": out_dir / "aggregate.csv",
        "paired": out_dir / "paired.csv",
        "summary": out_dir / "summary.json",
        "quality_plot": out_dir / "quality_vs_load.png",
        "goodput_plot": out_dir / "goodput_vs_load.png",
        "slo_plot": out_dir / "slo_violations_vs_load.png",
    }
    _write_runs(evaluation.rows, paths["runs"])
    aggregates = aggregate(evaluation.rows)
    comparisons = paired(evaluation.rows)
    _write_aggregate(aggregates, paths["aggregate"])
    _write_paired(comparisons, paths["paired"])
    paths["summary"].write_text(json.dumps(describe(evaluation), indent=2) + "\n")
    capacity = evaluation.capacity_qpm
    quality = "effective quality" + (" (SYNTHETIC)" if _synthetic(evaluation) else "")
    _plot(aggregates, "effective_quality", quality, capacity, paths["quality_plot"])
    goodput = "goodput (QPM served within the SLO)"
    _plot(aggregates, "goodput_qpm", goodput, capacity, paths["goodput_plot"], offered=True)
    violations = "SLO violations, refused included"
    _plot(aggregates, "slo_violation_ratio", violations, capacity, paths["slo_plot"], percent=True)
    return paths


def describe(evaluation: Evaluation) -> dict[str, Any]:
    """summary.json: the settings, the capacity and how the workloads were built."""
    config = evaluation.config
    return {
        "title": "argus evaluate: load sweep (Argus §5.3, Fig. 17)",
        "capacity_qpm": evaluation.capacity_qpm,
        "capacity": (
            "sum over workers of the fastest AC level's throughput on the worker's class, "
            "planning profiles" + ("" if config.adapters == "none" else " with adapters")
        ),
        "gpus": ",".join(f"{c}={n}" for c, n in evaluation.gpu_counts),
        "slo_s": evaluation.slo_s,
        "loads": [p.label for p in config.loads],
        "policies": list(config.run_names()),
        "seeds": config.seeds,
        "duration_min": config.duration_min,
        "trace": config.trace,
        "rescaling": (
            "per-minute rates mapped to the target mean (x mean / trace mean), or with a peak "
            "affinely (mean and busiest minute exact); whole counts per minute by rounding the "
            "running sum; each minute thinned to a random subset or filled with copies placed "
            "between an arrival and the next (seeded)"
        ),
        "prompts": f"eval set of argus.prompt_split ({config.prompts_path or 'PartiPrompts'})",
        "quality": evaluation.quality_source,
        "classifier": evaluation.classifier_label,
        "adapters": config.adapters,
        "admission": config.admission,
        "wall_s": round(evaluation.wall_s, 2),
        "intervals": "mean ± t(0.975, n-1) · s / sqrt(n) over seeds",
    }


def _write_runs(rows: Sequence[RunRow], path: Path) -> None:
    records = [row.record() for row in rows]
    columns = list(records[0]) if records else ["load", "policy", "seed"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def aggregate_columns() -> list[str]:
    """Columns of aggregate.csv."""
    columns = ["load", "peak", "policy", "seeds"]
    for name in METRICS:
        columns += [f"{name}_mean", f"{name}_lo", f"{name}_hi"]
    columns.append("quality_seeds")
    return columns


def _write_aggregate(aggregates: Sequence[Aggregate], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(aggregate_columns())
        for a in aggregates:
            row: list[Any] = [a.load, "" if a.peak is None else a.peak, a.policy]
            row.append(a.metrics["offered_qpm"].n)
            for name in METRICS:
                interval = a.metrics[name]
                row += [_num(interval.mean), _num(interval.lo), _num(interval.hi)]
            row.append(a.metrics["effective_quality"].n)
            writer.writerow(row)


PAIRED_COLUMNS = (
    "load",
    "peak",
    "seeds",
    "quality_diff_mean",
    "quality_diff_lo",
    "quality_diff_hi",
    "goodput_diff_mean",
    "goodput_diff_lo",
    "goodput_diff_hi",
    "oracle_diff_mean",
    "oracle_diff_lo",
    "oracle_diff_hi",
    "argus_quality",
    "pac_quality",
    "argus_oracle_quality",
    "oracle_gap_closed",
)


def _write_paired(comparisons: Sequence[Paired], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(PAIRED_COLUMNS)
        for p in comparisons:
            q, g, o = p.quality_diff, p.goodput_diff, p.oracle_diff
            writer.writerow(
                [p.load, "" if p.peak is None else p.peak, q.n]
                + [_num(v) for v in (q.mean, q.lo, q.hi, g.mean, g.lo, g.hi, o.mean, o.lo, o.hi)]
                + [_num(v) for v in (p.argus_quality, p.pac_quality, p.oracle_quality)]
                + [_num(p.gap_closed)]
            )


def _num(value: float) -> str:
    return "" if not math.isfinite(value) else f"{value:.6g}"


def _plot(
    aggregates: Sequence[Aggregate],
    metric: str,
    label: str,
    capacity_qpm: float,
    path: Path,
    *,
    offered: bool = False,
    percent: bool = False,
) -> None:
    """One metric against offered load, a line per policy, 95 % intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    factor = 100.0 if percent else 1.0
    policies = list(dict.fromkeys(a.policy for a in aggregates))
    for policy in policies:
        points = sorted((a for a in aggregates if a.policy == policy), key=lambda a: a.load)
        x = np.array([a.load * capacity_qpm for a in points])
        y = np.array([a.metrics[metric].mean for a in points]) * factor
        err = np.array([a.metrics[metric].half_width for a in points]) * factor
        ax.errorbar(x, y, yerr=np.nan_to_num(err), lw=1, marker="o", ms=3, capsize=2, label=policy)
    if offered and aggregates:
        loads = sorted({a.load for a in aggregates})
        x = np.array(loads) * capacity_qpm
        ax.plot(x, x, color="black", lw=2, ls="--", label="offered load")
    ax.axvline(capacity_qpm, color="grey", lw=1, ls=":")
    ax.set_xlabel(f"offered load (QPM); capacity {capacity_qpm:.0f} QPM (dotted)")
    ax.set_ylabel(label + (" (%)" if percent else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_evaluation(evaluation: Evaluation) -> str:
    """The compact table ``argus evaluate`` prints: per load and policy, means over the seeds
    ± the half-width of their 95 % interval; then argus − pac per load."""
    aggregates = aggregate(evaluation.rows)
    header = (
        f"{'load':>8} {'policy':<13} {'quality':>13} {'over n':>7} {'goodput QPM':>13} "
        f"{'refused QPM':>12} {'late/adm':>14} {'viol/all':>14}"
    )
    lines = [header, "-" * len(header)]
    previous: float | None = None
    for a in sorted(aggregates, key=lambda a: (a.load, a.peak or 0.0)):
        if previous is not None and a.load != previous:
            lines.append("")
        previous = a.load
        m = a.metrics
        lines.append(
            f"{_load_label(a.load, a.peak):>8} {a.policy:<13} "
            f"{_pm(m['effective_quality'], 2):>13} {m['quality_n'].mean:>7,.0f} "
            f"{_pm(m['goodput_qpm'], 1):>13} {_pm(m['refused_qpm'], 1):>12} "
            f"{_pm(m['slo_violation_ratio_admitted'], 1, 100):>14} "
            f"{_pm(m['slo_violation_ratio'], 1, 100):>14}"
        )
    config = evaluation.config
    lines.append(
        f"means over {config.seeds} seeds ± 95% t-interval half-width; quality: SYNTHETIC, "
        "mean over the 'over n' requests served within the SLO (per run); late/adm and "
        "viol/all in %"
    )
    comparisons = paired(evaluation.rows)
    if comparisons:
        lines += [
            "",
            f"{'load':>8} {'argus − pac quality [95%]':>28} {'oracle − pac [95%]':>28} "
            f"{'gap closed':>10}",
        ]
        for p in sorted(comparisons, key=lambda p: (p.load, p.peak or 0.0)):
            closed = f"{p.gap_closed + 0.0:.0%}" if math.isfinite(p.gap_closed) else "-"
            closed = "0%" if closed == "-0%" else closed  # no sign on a rounded zero
            lines.append(
                f"{_load_label(p.load, p.peak):>8} {format_difference(p.quality_diff):>28} "
                f"{format_difference(p.oracle_diff):>28} {closed:>10}"
            )
        lines.append(
            "paired over seeds; gap closed = (Q_argus − Q_pac) / (Q_argus-oracle − Q_pac), "
            "only where the oracle beats PAC (interval above 0)"
        )
        lines.append(f"argus classifier: {evaluation.classifier_label}")
    return "\n".join(lines)


def _synthetic(evaluation: Evaluation) -> bool:
    return "synthetic" in evaluation.quality_source.lower()


def _load_label(load: float, peak: float | None) -> str:
    return f"{load:g}x" if peak is None else f"{load:g}:{peak:g}x"


def format_difference(interval: Interval) -> str:
    """A paired difference as ``+m [+lo, +hi]`` (``+m`` over one seed, ``-`` over none)."""
    if interval.n == 0:
        return "-"
    if interval.n == 1:
        return f"{interval.mean:+.3f}"
    return f"{interval.mean:+.3f} [{interval.lo:+.3f}, {interval.hi:+.3f}]"


def _pm(interval: Interval, digits: int, factor: float = 1.0) -> str:
    if interval.n == 0:
        return "-"
    mean = interval.mean * factor
    if interval.n == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f}±{interval.half_width * factor:.{digits}f}"
