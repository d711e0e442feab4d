"""``argus evaluate``: the Argus paper's load sweep (§5.3, Fig. 17) as one command.

Every policy replays the same workloads at several offered loads, each load a multiple of the
cluster's capacity, over several paired seeds; the command reports effective quality, goodput,
refusals and SLO violations against load, with 95 % intervals over the seeds.

This module runs the sweep. The capacity and the rescaling of a trace to a load are
:mod:`argus.sim.offered_load`; the intervals over seeds, :mod:`argus.sim.intervals`; the
files, plots and printed table, :mod:`argus.sim.evaluation_report`.

Seeds. Seed ``s`` (0 … seeds − 1) sets the arrival process and the thinning, the order of the
prompts, the service-time jitter, the adapters drawn and the policies' random streams; the
quality tables are SYNTHETIC (:func:`argus.profiles.synthetic_quality.synthetic_quality_table`)
drawn with seed ``1000 + s``, never seed 0, on which the committed classifier was trained. All
policies of one (load, seed) see the same workload, tables and cluster, so differences between
them are paired. Prompts come only from the evaluation set of :mod:`argus.prompt_split`.

Quality worlds (``quality``, :mod:`argus.profiles.quality_worlds`): see the quality-worlds
evaluation page; ``nirvana`` (AC only) cannot run in ``genai-bench``.

Caches (``cache``). ``realistic`` (the default): every worker keeps its own cache of the
prompts it generated, cold at the start, and an AC request gets the K its nearest cached
prompt's similarity allows under its routed ceiling, or a miss served in full
(:mod:`argus.sim.cluster_cache`); runs.csv counts the lookups, the hit rate and the mean
similarity. ``perfect`` makes every AC request a hit at its routed K, as before caches were
modelled. The prompts cycle through the eval set, so a prompt recurs every ~320 requests and
its later occurrences can find themselves in their worker's cache.

Policies run through :func:`argus.sim.policies.make_policy` and the trained or oracle
classifier of :func:`argus.sim.policies.make_classifier`, on :class:`~argus.sim.cluster.
Simulation`, exactly as ``argus replay`` runs them. When both ``argus`` and ``pac`` run, an
extra ``argus-oracle`` run (Argus with the quality table's own optimal levels) measures how
much of the oracle's gain over PAC the trained classifier keeps:
``(Q_argus − Q_pac) / (Q_argus-oracle − Q_pac)`` on the mean effective qualities of a load,
reported only where the oracle's paired gain over PAC has a 95 % interval above zero (there is
no gap to close where every policy runs the fastest level, and the ratio of two noisy
near-zero differences means nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from argus import defaults
from argus.profiles.quality_worlds import (
    QualityWorld,
    parse_world,
    world_label,
    world_profiles,
    world_quality_tables,
)
from argus.prompt_split import PromptSet, select
from argus.sim.named_workloads import workload_by_name
from argus.sim.offered_load import (
    EvaluationError,
    cluster_capacity_qpm,
    planning_profiles,
    rescale_to_load,
)
from argus.sim.report import Summary, summarise
from argus.sim.workloads import Workload
from argus.traces import PromptRecord
from argus.types import ProfileSet, Strategy

if TYPE_CHECKING:
    from argus.contracts.quality import QualityTable
    from argus.profiles.synthetic_quality import SyntheticModel
    from argus.sim.classifiers import Classifier

ORACLE_POLICY = "argus-oracle"  # argus with make_classifier("oracle"), run beside argus and pac
QUALITY_SEED_BASE = 1000  # quality tables of seed s are drawn with 1000 + s
SYNTHETIC_SHAPES = ("poisson", "gamma", "bursty", "ramp")


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

    loads: tuple[LoadPoint, ...] = tuple(LoadPoint(x) for x in defaults.EVALUATION_LOADS)
    """Offered loads, multiples of the capacity (``--loads``, or ``--target-load``)."""

    policies: tuple[str, ...] = defaults.EVALUATION_POLICIES
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

    quality: str = QualityWorld.SYNTHETIC.value
    """The quality world (``--quality``): synthetic, uniform or genai-bench."""

    caps: str | None = None
    """Queueing caps of the planned policies (``--caps``): analytic or measured; None: theirs."""

    strategy_choice: str | None = None
    """Strategy choice of the joint planner's policies, argus and pac (``--strategy-choice``):
    ac-first or best; None: theirs."""

    cache: str = "realistic"
    """What an AC request finds (``--cache``): ``realistic``, each worker's own cache of the
    prompts it generated (hits, misses, cold start, similarity; :mod:`argus.sim.cluster_cache`),
    or ``perfect``, every AC request a hit at its routed K."""

    cache_warm: str = "none"
    """What the realistic caches hold at the start (``--cache-warm``): ``none``, cold; ``train``,
    the prompt file's TRAIN prompts (disjoint from the EVAL prompts the requests use), dealt
    round-robin over the workers, as a cluster whose workers served them before."""

    late_binding_window: int = 0
    """Requests a worker is sent at once, the rest held by the router (``--late-binding-window``;
    :attr:`argus.sim.cluster.SimConfig.late_binding_window`); 0: queued when routed."""

    def __post_init__(self) -> None:
        if self.late_binding_window < 0:
            raise EvaluationError(
                f"late_binding_window: must be >= 0, got {self.late_binding_window}"
            )
        try:
            world = parse_world(self.quality)
        except ValueError as exc:
            raise EvaluationError(f"quality: {exc}") from None
        object.__setattr__(self, "quality", world.value)
        if world is QualityWorld.GENAI_BENCH:
            ac_only = [p for p in self.policies if p in defaults.AC_ONLY_POLICIES]
            if ac_only:
                raise EvaluationError(
                    f"policies: {ac_only[0]!r} serves AC levels only, and the genai-bench "
                    "world has none (SM only)"
                )
            if self.prompts_path is not None:
                raise EvaluationError(
                    "prompts: the genai-bench world serves GenAI-Bench's own EVAL prompts; "
                    "--prompts does not apply"
                )
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
        if self.cache not in ("realistic", "perfect"):
            raise EvaluationError(f"cache: must be realistic or perfect, got {self.cache!r}")
        if self.cache_warm not in CACHE_WARM:
            raise EvaluationError(
                f"cache_warm: must be one of {', '.join(CACHE_WARM)}, got {self.cache_warm!r}"
            )
        if self.cache_warm != "none" and world is QualityWorld.GENAI_BENCH:
            raise EvaluationError("cache_warm: the genai-bench world has no TRAIN prompts")

    @property
    def with_oracle(self) -> bool:
        """Whether the argus-oracle run (and the gap share) is part of the evaluation."""
        return "argus" in self.policies and "pac" in self.policies

    def run_names(self) -> tuple[str, ...]:
        """Policies as labelled in the results: the chosen ones, then argus-oracle."""
        return self.policies + ((ORACLE_POLICY,) if self.with_oracle else ())


# -- one seed's inputs --------------------------------------------------------------------------


def eval_prompts(
    prompts_path: str | None, quality: str = QualityWorld.SYNTHETIC.value
) -> tuple[PromptRecord, ...]:
    """The evaluation-set prompts of the prompt file (PartiPrompts when None), or of
    GenAI-Bench in the genai-bench world; each seed permutes them, so their order here does
    not matter."""
    from argus.sim.workloads import default_prompts, load_prompt_file

    if parse_world(quality) is QualityWorld.GENAI_BENCH:
        from argus.profiles.quality_worlds import genai_eval_records

        return genai_eval_records()
    records = default_prompts() if prompts_path is None else load_prompt_file(prompts_path)
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
    quality: str = QualityWorld.SYNTHETIC.value,
) -> dict[Strategy, QualityTable]:
    """SYNTHETIC quality tables of seed ``seed``'s evaluation (drawn with 1000 + seed), of
    the synthetic model ``models[strategy]`` (default: the calibrated ``SYNTHETIC_MODELS``);
    in another ``quality`` world, that world's tables
    (:func:`argus.profiles.quality_worlds.world_quality_tables`, the same seed)."""
    from argus.profiles.synthetic_quality import synthetic_quality_table

    if parse_world(quality) is not QualityWorld.SYNTHETIC:
        return world_quality_tables(quality, profiles, prompts, QUALITY_SEED_BASE + seed, models)
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
_GENAI: dict[str, Any] = {}  # the genai-bench world's trained classifier, once per process


def _classifier(
    spec: str, quality: str = QualityWorld.SYNTHETIC.value, profiles: ProfileSet | None = None
) -> Any:
    """``make_classifier(spec)``; in the genai-bench world ``default`` is the classifier
    trained on GenAI-Bench's TRAIN prompts (:func:`genai_classifier`)."""
    from argus.sim.classifiers import make_classifier

    world = parse_world(quality)
    if spec.strip() == "default" and world is QualityWorld.GENAI_BENCH:
        return genai_classifier().classifier
    if spec not in _CLASSIFIERS:
        _CLASSIFIERS[spec] = make_classifier(spec)
    if world is QualityWorld.UNIFORM:
        return _uniform_calibrated(spec, _CLASSIFIERS[spec], profiles)
    return _CLASSIFIERS[spec]


UNIFORM_CALIBRATION_SEED = 0  # the committed classifier's own calibration tables' seed


def _uniform_calibrated(spec: str, classifier: Any, profiles: ProfileSet | None) -> Any:
    """A trained classifier whose Q(v | c) is measured in the uniform world, on the uniform
    tables of the CALIBRATION prompts (seed :data:`UNIFORM_CALIBRATION_SEED`): the planner
    must believe what the world it plans in says of each class, or a world with no per-prompt
    signal would be planned with the synthetic world's, and Argus would lose to PAC by the
    mismatch alone (measured: −0.013 at 0.3 × capacity). Oracles measure Q on the replay and
    need nothing."""
    from argus.profiles import default_profiles
    from argus.sim.classifiers import TrainedClassifier
    from argus.sim.workloads import default_prompts

    if not isinstance(classifier, TrainedClassifier):
        return classifier
    key = f"{spec}@uniform"
    if key not in _CLASSIFIERS:
        calibration = select(default_prompts(), PromptSet.CALIBRATION)
        tables = world_quality_tables(
            QualityWorld.UNIFORM,
            profiles or default_profiles(),
            calibration,
            UNIFORM_CALIBRATION_SEED,
        )
        source = f"the uniform world's tables of {len(calibration)} CALIBRATION prompts"
        _CLASSIFIERS[key] = classifier.calibrated_on(tables, source)
    return _CLASSIFIERS[key]


def genai_classifier() -> Any:
    """The genai-bench world's :class:`~argus.sim.genai_classifier.GenaiClassifier`, trained
    once per process (a few seconds; the embeddings are cached on disk)."""
    from argus.sim.genai_classifier import train_genai_classifier

    if "default" not in _GENAI:
        _GENAI["default"] = train_genai_classifier()
    return _GENAI["default"]


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
    from argus.sim.adapters import adapter_model_by_name
    from argus.sim.cluster import SimConfig, Simulation
    from argus.sim.policies import make_policy

    profiles = world_profiles(config.quality, config.profiles)
    prompts = eval_prompts(config.prompts_path, config.quality)
    workload = seeded_workload(config, point, capacity_qpm, seed, prompts)
    tables = quality_tables(profiles, workload.prompts, seed, models, config.quality)
    sim_config = SimConfig.with_classes(
        dict(gpu_counts_of(config, profiles)),
        seed=seed,
        adapters=adapter_model_by_name(config.adapters),
        admission=config.admission,
        cache=config.cache,
        cache_rules=cache_rules_of(config),
        cache_warm=warm_prompts(config),
        cache_warm_dealt=True,
        late_binding_window=config.late_binding_window if config.admission else 0,
    )
    sim = Simulation(profiles, tables, workload, sim_config)
    if classifier is None:
        classifier = _classifier(config.classifier, config.quality, profiles)
    rows = []
    for name in config.run_names():
        if name == ORACLE_POLICY:
            policy = make_policy(
                "argus",
                classifier=_classifier("oracle"),
                seed=seed,
                caps=config.caps,
                strategy_choice=config.strategy_choice,
            )
        else:
            policy = make_policy(
                name,
                classifier=classifier,
                seed=seed,
                caps=config.caps,
                strategy_choice=config.strategy_choice,
            )
        started = time.perf_counter()
        result = sim.run(policy)
        wall = time.perf_counter() - started
        summary = summarise(result)
        if name == ORACLE_POLICY:
            summary = _relabel(summary, ORACLE_POLICY)
        target = point.mean * capacity_qpm
        rows.append(RunRow(point.mean, point.peak, target, seed, name, summary, wall))
    return rows


CACHE_WARM = ("none", "train")


def warm_prompts(config: EvaluationConfig) -> tuple[str, ...]:
    """The prompts the realistic caches start with (``cache_warm``): none, or the TRAIN
    prompts of the prompt file (PartiPrompts when none is given; GenAI-Bench has none)."""
    if config.cache_warm == "none" or config.cache != "realistic":
        return ()
    from argus.sim.workloads import default_prompts, load_prompt_file

    path = config.prompts_path
    records = default_prompts() if path is None else load_prompt_file(path)
    return tuple(record.prompt for record in select(records, PromptSet.TRAIN))


def cache_rules_of(config: EvaluationConfig) -> tuple[tuple[str, Any], ...]:
    """The similarity → K rules of the profile's models (``[models.X.cache]``)."""
    from argus.profiles import load_cache_rules

    if parse_world(config.quality) is QualityWorld.GENAI_BENCH:
        return ()  # SM only: no cache
    return tuple(load_cache_rules(config.profiles).items())


def cache_description(config: EvaluationConfig) -> str:
    """The cache model of the results, named with its rule."""
    if config.cache == "perfect":
        return "perfect: every AC request at K > 0 is a hit at its routed K (table quality)"
    from argus.profiles.cache_evidence import DEFAULT_RULE

    rules = dict(cache_rules_of(config))
    described = "; ".join(
        f"{model}: " + ", ".join(f"K{k}>={s:g}" for k, s in rule.floors) + f" ({rule.source})"
        for model, rule in rules.items()
    )
    default = ", ".join(f"K{k}>={s:g}" for k, s in DEFAULT_RULE.floors)
    start = "cold at the start"
    if config.cache_warm == "train":
        start = "holding the TRAIN prompts at the start, dealt round-robin over the workers"
    return (
        "realistic: per-worker LRU caches of all-MiniLM-L6-v2 prompt embeddings, "
        f"{start}; K = the largest of the routed ceiling that the nearest cached prompt's "
        f"similarity allows ({described or 'default ' + default}; other models {default}, "
        "ASSUMED); SYNTHETIC reuse quality, argus/profiles/cache_evidence.py"
    )


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
    quality_notes: tuple[str, ...] = ()
    """What the quality world adds to the results (genai-bench: the classifier's
    predictability on held-out raters)."""


def capacity_strategy(profiles: ProfileSet) -> Strategy:
    """The strategy whose fastest level sets the capacity: AC, or SM when the profiles have
    no AC level (the genai-bench world)."""
    return Strategy.AC if profiles.levels_for(Strategy.AC) else Strategy.SM


def quality_source(config: EvaluationConfig) -> str:
    """The quality model of the results, named."""
    world = parse_world(config.quality)
    if world is QualityWorld.SYNTHETIC:
        return (
            "SYNTHETIC: argus/profiles/synthetic_quality.py, "
            f"tables of seed {QUALITY_SEED_BASE} + s"
        )
    if world is QualityWorld.UNIFORM:
        return f"{world_label(world)}, tables of seed {QUALITY_SEED_BASE} + s"
    return (
        f"{world_label(world)}: mean of 3 raters per prompt and model on their 1-5 scale, "
        "SM ladder SDXL-Base > SD-2.1 > SDXL-Turbo (argus/profiles/genai_bench.toml), EVAL "
        "prompts of GenAI-Bench; GenAI-Bench, Li, Lin et al., 2024"
    )


def quality_notes(config: EvaluationConfig) -> tuple[str, ...]:
    """Lines the quality world adds to the results."""
    if parse_world(config.quality) is not QualityWorld.GENAI_BENCH:
        return ()
    if config.classifier.strip() != "default":
        return (f"classifier {config.classifier!r} given: no predictability measured",)
    found = genai_classifier()
    return (
        f"classifier trained on {len(found.trained_on)} TRAIN and CALIBRATION GenAI-Bench "
        "prompts, none of the EVAL prompts served",
        *found.predictability.lines(),
    )


def check_inputs(config: EvaluationConfig) -> tuple[ProfileSet, float, str]:
    """Load what the runs need once, failing early: (profiles, capacity QPM, classifier
    label). Raises EvaluationError, WorkloadError, ProfileError or ValueError."""
    from argus.sim.policies import make_policy

    profiles = world_profiles(config.quality, config.profiles)
    counts = gpu_counts_of(config, profiles)
    for worker_class, _ in counts:
        if worker_class not in profiles.worker_classes:
            raise EvaluationError(
                f"GPU class {worker_class!r} has no profiles; the profiles know "
                f"{', '.join(profiles.worker_classes)}"
            )
    for name in config.policies:
        make_policy(name)  # unknown names fail here, quoted
    classifier = _classifier(config.classifier, config.quality, profiles)
    cache_rules_of(config)  # the profile's cache tables read
    plan = planning_profiles(profiles, config.adapters)
    capacity = cluster_capacity_qpm(plan, counts, capacity_strategy(profiles))
    prompts = eval_prompts(config.prompts_path, config.quality)
    prepare = getattr(classifier, "prepare", None)
    if prepare is not None and {"argus", "nirvana"} & set(config.policies):
        # labels match, models load: one line
        prepare(quality_tables(profiles, prompts, 0, quality=config.quality))
    seeded_workload(config, config.loads[0], capacity, 0, prompts)  # the trace reads
    if config.cache == "realistic" and profiles.levels_for(Strategy.AC):
        from argus.sim.prompt_vectors import embed_prompts

        embed_prompts([p.prompt for p in prompts])  # once, on disk before any worker process
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
    from argus.slo import default_slo_s

    counts = gpu_counts_of(config, profiles)
    return Evaluation(
        config=config,
        capacity_qpm=capacity,
        rows=tuple(rows),
        wall_s=time.perf_counter() - started,
        classifier_label=label,
        quality_source=quality_source(config),
        slo_s=default_slo_s(profiles, [c for c, _ in counts]),  # the runs' SimConfig default
        gpu_counts=counts,
        quality_notes=quality_notes(config),
    )
