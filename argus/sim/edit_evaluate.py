"""``argus evaluate --workload edits``: the balancers of :mod:`argus.router.edit_balance` on the
SYNTHETIC editing workload of :mod:`argus.sim.edits`, per offered load, over paired seeds.

Load is a multiple of the cluster's capacity for edits (:func:`argus.sim.edits.capacity_per_s`):
every worker's batch full at the bound, each edit at the mean effective ratio
``h·m̄ + (1 − h)`` where m̄ is the mask distribution's mean and h the hit rate of one worker's
records when it sees every template (:func:`argus.sim.edits.lru_hit_rate`: what a balancer
blind to templates gets; one that keeps templates on their holders gets more). Seed s
draws the same workload for every balancer (``1000 + s``, as ``argus evaluate``). The first
``warmup_share`` of the trace fills the workers' records and is not measured; the statistics
are over the edits that arrive after it.

Outputs (:func:`write_edit_evaluation`): ``runs.csv`` (one row per load, balancer and seed),
``aggregate.csv`` (per load, balancer and batching the mean and 95 % interval over seeds of each
metric: ``latency_p95_s_mean`` is the P95 column), ``paired.csv`` (mask-aware against each other
balancer, paired by seed: P95 difference and relative reduction), ``batching.csv`` (with
``batchings`` both: continuous against static batching per load and balancer, paired by seed),
``summary.json``.

``batchings`` runs each worker's :class:`~argus.worker.editing.scheduler.ContinuousBatch`
continuously (the default), statically (InstGenIE's baseline, §6.4), or both on the same
requests: the worker's step batcher runs that same policy code, so the simulator predicts what
``benchmarks/bench_edit_serving.py`` measures, at any step count and load.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from argus.profiles.edit_cost import EditCostModel, default_cost_model
from argus.router.edit_balance import BALANCERS, make_balancer
from argus.sim.edits import (
    BATCH_BOUND,
    CACHE_TEMPLATES,
    MASK_MEANS,
    STEPS,
    TEMPLATES,
    ZIPF_S,
    EditCluster,
    EditOutcome,
    EditWorkloadConfig,
    capacity_per_s,
    draw_mask_ratios,
    lru_hit_rate,
    make_edit_workload,
)
from argus.sim.intervals import Interval, mean_interval
from argus.worker.editing.scheduler import BATCHINGS

METRICS = (
    "latency_mean_s",
    "latency_p95_s",
    "queueing_mean_s",
    "queueing_p95_s",
    "throughput_per_s",
    "hit_rate",
    "measured",
)
REFERENCE = "mask-aware"


@dataclass(frozen=True)
class EditEvaluationConfig:
    """One sweep: loads × balancers × seeds."""

    loads: tuple[float, ...]
    balancers: tuple[str, ...] = BALANCERS
    batchings: tuple[str, ...] = ("continuous",)
    seeds: int = 5
    duration_min: float = 30.0
    workers: int = 8
    bound: int = BATCH_BOUND
    cache_templates: int = CACHE_TEMPLATES
    zipf_s: float = ZIPF_S
    masks: str = "production"
    text_to_image_share: float = 0.0
    steps: int = STEPS
    warmup_share: float = 0.2
    model: EditCostModel = field(default_factory=default_cost_model)

    def __post_init__(self) -> None:
        if not self.loads or any(not (load > 0) for load in self.loads):
            raise ValueError(f"loads must be > 0, got {self.loads!r}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds!r}")
        if self.cache_templates < 0 or not self.zipf_s >= 0:
            raise ValueError(
                f"cache_templates and zipf_s must be >= 0, got {self.cache_templates!r}, "
                f"{self.zipf_s!r}"
            )
        if not 0.0 <= self.warmup_share < 1.0:
            raise ValueError(f"warmup_share must be in [0, 1), got {self.warmup_share!r}")
        for name in self.balancers:
            make_balancer(name, self.model)  # unknown names fail here, quoted
        unknown = [b for b in self.batchings if b not in BATCHINGS]
        if unknown or not self.batchings:
            raise ValueError(
                f"batchings: unknown {', '.join(map(repr, unknown)) or 'none given'}; "
                f"known: {', '.join(BATCHINGS)}"
            )
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps!r}")

    def hit_rate(self) -> float:
        return lru_hit_rate(TEMPLATES, self.zipf_s, self.cache_templates)

    def mean_ratio(self) -> float:
        """Mean ratio of a request: the clipped Beta's mean (drawn) mixed with generations."""
        ratios = draw_mask_ratios(self.masks, 200_000, np.random.default_rng(0))
        share = self.text_to_image_share
        return float((1 - share) * ratios.mean() + share)

    def capacity_per_s(self) -> float:
        # generations never hit: count them in the mean effective ratio as misses
        share = self.text_to_image_share
        edits_hit = self.hit_rate() * (1 - share)
        mean_edit = (self.mean_ratio() - share) / (1 - share) if share < 1 else 1.0
        return capacity_per_s(
            self.model,
            workers=self.workers,
            bound=self.bound,
            steps=self.steps,
            mean_ratio=mean_edit,
            hit_rate=edits_hit,
        )


@dataclass(frozen=True)
class EditRunRow:
    """One (load, balancer, batching, seed) run's measured statistics."""

    load: float
    balancer: str
    batching: str
    seed: int
    latency_mean_s: float
    latency_p95_s: float
    queueing_mean_s: float
    queueing_p95_s: float
    throughput_per_s: float
    hit_rate: float
    measured: int


@dataclass(frozen=True)
class EditEvaluation:
    config: EditEvaluationConfig
    capacity_per_s: float
    rows: tuple[EditRunRow, ...]


def summarize(
    outcomes: Sequence[EditOutcome],
    load: float,
    balancer: str,
    batching: str,
    seed: int,
    since_s: float,
) -> EditRunRow:
    """Statistics of the outcomes of requests that arrived at or after ``since_s``."""
    kept = [o for o in outcomes if o.arrival_s >= since_s]
    if not kept:
        nan = math.nan
        return EditRunRow(load, balancer, batching, seed, nan, nan, nan, nan, nan, nan, 0)
    latency = np.array([o.latency_s for o in kept])
    queueing = np.array([o.queueing_s for o in kept])
    span = max(o.finished_s for o in kept) - since_s
    return EditRunRow(
        load,
        balancer,
        batching,
        seed,
        float(latency.mean()),
        float(np.percentile(latency, 95)),
        float(queueing.mean()),
        float(np.percentile(queueing, 95)),
        len(kept) / span if span > 0 else math.nan,
        float(np.mean([o.hit for o in kept])),
        len(kept),
    )


def evaluate_edits(
    config: EditEvaluationConfig, progress: Callable[[int, int], None] | None = None
) -> EditEvaluation:
    """Run every (load, seed) workload under every balancer and batching."""
    capacity = config.capacity_per_s()
    duration_s = config.duration_min * 60.0
    rows: list[EditRunRow] = []
    total, done = len(config.loads) * config.seeds, 0
    for load in config.loads:
        for s in range(config.seeds):
            seed = 1000 + s
            workload = EditWorkloadConfig(
                rate_per_s=load * capacity,
                duration_s=duration_s,
                masks=config.masks,
                zipf_s=config.zipf_s,
                text_to_image_share=config.text_to_image_share,
                steps=config.steps,
            )
            requests = make_edit_workload(workload, seed)
            since_s = config.warmup_share * duration_s
            for name in config.balancers:
                for batching in config.batchings:
                    cluster = EditCluster(
                        config.model,
                        make_balancer(name, config.model),
                        workers=config.workers,
                        bound=config.bound,
                        cache_templates=config.cache_templates,
                        static=batching == "static",
                    )
                    outcomes = cluster.run(requests)
                    rows.append(summarize(outcomes, load, name, batching, seed, since_s))
            done += 1
            if progress is not None:
                progress(done, total)
    return EditEvaluation(config, capacity, tuple(rows))


def aggregate_edits(evaluation: EditEvaluation) -> list[dict[str, float | str]]:
    """Per (load, balancer, batching): each metric's mean, 95 % interval and seed count."""
    out: list[dict[str, float | str]] = []
    config = evaluation.config
    for load in config.loads:
        for name in config.balancers:
            for batching in config.batchings:
                runs = _runs(evaluation, load, name, batching)
                row: dict[str, float | str] = {"load": load, "balancer": name, "batching": batching}
                for metric in METRICS:
                    interval = mean_interval(float(getattr(r, metric)) for r in runs)
                    row[f"{metric}_mean"] = interval.mean
                    row[f"{metric}_lo"] = interval.lo
                    row[f"{metric}_hi"] = interval.hi
                    row[f"{metric}_n"] = interval.n
                out.append(row)
    return out


def _runs(
    evaluation: EditEvaluation, load: float, balancer: str, batching: str
) -> list[EditRunRow]:
    return [
        r
        for r in evaluation.rows
        if r.load == load and r.balancer == balancer and r.batching == batching
    ]


def _p95_by_seed(
    evaluation: EditEvaluation, load: float, balancer: str, batching: str
) -> dict[int, float]:
    return {r.seed: r.latency_p95_s for r in _runs(evaluation, load, balancer, batching)}


@dataclass(frozen=True)
class PairedP95:
    """One configuration's P95 against another's at one load, paired by seed."""

    load: float
    other: str  # the balancer compared with (paired_p95), or static batching's balancer
    difference_s: Interval  # the reference's P95 − the other's
    reduction: Interval  # 1 − the reference's P95 / the other's
    batching: str = "continuous"


def _paired(mine: Mapping[int, float], theirs: Mapping[int, float]) -> tuple[Interval, Interval]:
    seeds = sorted(set(mine) & set(theirs))
    return (
        mean_interval(mine[s] - theirs[s] for s in seeds),
        mean_interval(1.0 - mine[s] / theirs[s] for s in seeds if theirs[s] > 0),
    )


def paired_p95(evaluation: EditEvaluation) -> list[PairedP95]:
    """Mask-aware's P95 against every other balancer's under the same batching, seed by seed
    (none without mask-aware)."""
    config = evaluation.config
    if REFERENCE not in config.balancers:
        return []
    out = []
    for load in config.loads:
        for batching in config.batchings:
            mine = _p95_by_seed(evaluation, load, REFERENCE, batching)
            for other in config.balancers:
                if other != REFERENCE:
                    theirs = _p95_by_seed(evaluation, load, other, batching)
                    out.append(PairedP95(load, other, *_paired(mine, theirs), batching))
    return out


def paired_batching(evaluation: EditEvaluation) -> list[PairedP95]:
    """Continuous batching's P95 against static batching's under each balancer, seed by seed
    (none unless both ran): ``other`` names the balancer."""
    config = evaluation.config
    if set(config.batchings) != set(BATCHINGS):
        return []
    return [
        PairedP95(
            load,
            name,
            *_paired(
                _p95_by_seed(evaluation, load, name, "continuous"),
                _p95_by_seed(evaluation, load, name, "static"),
            ),
        )
        for load in config.loads
        for name in config.balancers
    ]


def _interval_text(interval: Interval, scale: float = 1.0, digits: int = 1) -> str:
    if math.isnan(interval.lo):
        return f"{interval.mean * scale:.{digits}f}"
    return (
        f"{interval.mean * scale:.{digits}f} [{interval.lo * scale:.{digits}f}, "
        f"{interval.hi * scale:.{digits}f}]"
    )


def format_edit_evaluation(evaluation: EditEvaluation) -> str:
    """The printed table: per load, balancer and batching, means with 95 % intervals over
    seeds, then the paired comparisons."""
    lines = [
        "SYNTHETIC editing workload (argus/sim/edits.py); seconds of simulated time; "
        "means over seeds [95% interval]",
        f"{'load':>5} {'balancer':<15} {'batching':<10} {'mean latency':>22} {'P95 latency':>22} "
        f"{'mean queueing':>22} {'edits/s':>8} {'hit rate':>8}",
    ]
    config = evaluation.config
    for load in config.loads:
        for name in config.balancers:
            for batching in config.batchings:
                runs = _runs(evaluation, load, name, batching)

                def iv(metric: str, runs: list[EditRunRow] = runs) -> Interval:
                    return mean_interval(float(getattr(r, metric)) for r in runs)

                lines.append(
                    f"{load:>5g} {name:<15} {batching:<10} "
                    f"{_interval_text(iv('latency_mean_s')):>22} "
                    f"{_interval_text(iv('latency_p95_s')):>22} "
                    f"{_interval_text(iv('queueing_mean_s')):>22} "
                    f"{iv('throughput_per_s').mean:>8.3f} {iv('hit_rate').mean:>8.3f}"
                )
    sections = [
        (
            "mask-aware's P95 against each balancer, paired by seed:",
            [(f"vs {p.other} ({p.batching} batching)", p) for p in paired_p95(evaluation)],
        ),
        (
            "continuous batching's P95 against static batching's, paired by seed:",
            [(f"under {p.other}", p) for p in paired_batching(evaluation)],
        ),
    ]
    for title, pairs in sections:
        if pairs:
            lines += ["", title]
        for what, pair in pairs:
            lines.append(
                f"  load {pair.load:g} {what}: P95 difference "
                f"{_interval_text(pair.difference_s)} s, reduction "
                f"{_interval_text(pair.reduction, 100.0)} %"
            )
    return "\n".join(lines)


def write_edit_evaluation(evaluation: EditEvaluation, out: Path) -> None:
    """runs.csv, aggregate.csv, paired.csv, batching.csv and summary.json into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "runs.csv", [asdict(r) for r in evaluation.rows])
    _write_csv(out / "aggregate.csv", aggregate_edits(evaluation))
    _write_csv(
        out / "paired.csv",
        [
            {"load": p.load, "balancer": REFERENCE, "other": p.other, "batching": p.batching}
            | _paired_columns(p)
            for p in paired_p95(evaluation)
        ],
    )
    _write_csv(
        out / "batching.csv",
        [
            {"load": p.load, "balancer": p.other, "batching": "continuous", "other": "static"}
            | _paired_columns(p)
            for p in paired_batching(evaluation)
        ],
    )
    config = evaluation.config
    model = config.model
    summary = {
        "workload": "edits (SYNTHETIC: argus/sim/edits.py)",
        "loads": list(config.loads),
        "balancers": list(config.balancers),
        "batchings": list(config.batchings),
        "seeds": [1000 + s for s in range(config.seeds)],
        "duration_min": config.duration_min,
        "warmup_share": config.warmup_share,
        "workers": config.workers,
        "batch_bound": config.bound,
        "cache_templates_per_worker": config.cache_templates,
        "templates": TEMPLATES,
        "zipf_s": config.zipf_s,
        "masks": config.masks,
        "mask_mean_paper": MASK_MEANS[config.masks],
        "mean_ratio_drawn": config.mean_ratio(),
        "text_to_image_share": config.text_to_image_share,
        "steps": config.steps,
        "capacity_hit_rate": config.hit_rate(),
        "capacity_per_s": evaluation.capacity_per_s,
        "cost_model": {
            "base_s": model.base_s,
            "per_edit_s": model.per_edit_s,
            "per_mask_s": model.per_mask_s,
            "r2": model.r2,
            "source": model.source,
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def _paired_columns(pair: PairedP95) -> dict[str, float | str]:
    return {
        "p95_difference_s_mean": pair.difference_s.mean,
        "p95_difference_s_lo": pair.difference_s.lo,
        "p95_difference_s_hi": pair.difference_s.hi,
        "p95_reduction_mean": pair.reduction.mean,
        "p95_reduction_lo": pair.reduction.lo,
        "p95_reduction_hi": pair.reduction.hi,
        "seeds": pair.difference_s.n,
    }


def _write_csv(path: Path, rows: Sequence[Mapping[str, object]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        if not rows:
            return
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
