"""Argus's gain over PAC as a function of how predictable quality is from a prompt's text.

Argus claims that per-prompt, quality-aware planning (policy ``argus``) serves better images
than prompt-agnostic approximation (``pac``) at the same deadline misses. Per prompt, it can
only do better than PAC as far as its classifier can read from the text how much approximation
the prompt tolerates. In the simulator that tolerance is SYNTHETIC
(:func:`argus.profiles.synthetic_quality.synthetic_quality_table`): a latent difficulty
``ρ·f + √(1-ρ²)·ν``, where ``f`` comes from the prompt (its words and its PartiPrompts
challenge label, :func:`argus.profiles.synthetic_quality.prompt_difficulty`) and ``ν`` is
noise nothing in the prompt reveals. ``ρ`` is the text share
(``SyntheticModel.feature_share``); the calibrated ``SYNTHETIC_MODELS`` have ρ = 1, the case
most favourable to Argus (and still not fully readable: the encoder sees the words, not the
label). This script shows what the gain is at smaller ρ. For each ρ of ``--rhos``:

1. **Quality model**: each strategy's entry of ``SYNTHETIC_MODELS`` with its text share set
   to ρ, nothing else changed.
2. **Classifier**, trained as ``argus train-classifier`` trains the committed one
   (:func:`argus.classifier.train.train_classifier`): labels are the optimal levels (δ = 0.9)
   of seed-0 tables at this ρ; a logistic head on frozen all-MiniLM-L6-v2 vectors is fitted
   on the TRAIN split (C chosen on a validation slice of it); temperature, tolerance classes
   and Q(v | c) are measured on the CALIBRATION split. The prompts are embedded once (the
   embedding cache) and the classifier is served from memory
   (:meth:`argus.sim.classifiers.TrainedClassifier.in_memory`).
3. **Serving**, as ``argus evaluate`` runs a load point
   (:func:`argus.sim.evaluate.run_point`): EVAL-split prompts, quality tables of the unseen
   seeds 1000 + s at this ρ, a Poisson trace rescaled to ``--target-load`` (mean and busiest
   minute, multiples of the capacity of 8 A100s at the fastest AC level), no adapters,
   ``--seeds`` paired seeds s; policies ``argus`` with the trained classifier, ``pac``, and
   ``argus-oracle`` (Argus with each prompt's true optimal level and Q measured on the
   replay's own tables: what perfect prediction would give).
4. **Report**: the classifier on the EVAL prompts (seed-0 tables: each prompt served at its
   predicted level, against a random and the optimal level) and how different its classes
   are (Q spread: quality at the fastest level of the most tolerant class minus that of the
   least tolerant, on CALIBRATION; about 0 when the classes say nothing); then the effective
   quality of argus, pac and argus-oracle (means over seeds of the mean score of the
   requests served within the SLO, with that request count), SLO violations (refused
   included), Argus − PAC with a paired 95 % t-interval and the share of the oracle's gain
   over PAC that Argus keeps (only where that gain's interval is above 0, as ``argus
   evaluate`` reports it). The claim is about equal deadline misses; the load is fixed, not
   the misses, so both policies' violations are printed side by side.

Every quality figure is SYNTHETIC, and every line that prints one says so. The default run
(5 values of ρ, 20 seeds of 15 simulated minutes, one thread) took four minutes on two cores
busy with other jobs, three quarters of it simulating, embedding the prompts included (they
are cached for later runs). Run from the repository root::

    .venv/bin/python benchmarks/predictability_sweep.py [--rhos 0,0.25,0.5,0.75,1]
        [--seeds 20] [--duration 15] [--target-load 0.65:1.0] [--prompts FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # with sklearn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.classifier.embedding_cache import EmbeddingCache
from argus.classifier.labels import labels_from_table
from argus.classifier.prompts import max_chars_for
from argus.classifier.serving import ClassifierSet
from argus.classifier.train import TrainConfig, TrainResult, train_classifier
from argus.cli.evaluate import parse_loads
from argus.cli.main import CLIError
from argus.contracts.quality import DEFAULT_DELTA
from argus.profiles import load_profiles
from argus.profiles.synthetic_quality import (
    SYNTHETIC_MODELS,
    SyntheticModel,
    synthetic_quality_table,
)
from argus.prompt_split import PromptSet, prompt_set
from argus.sim.classifiers import TrainedClassifier
from argus.sim.evaluate import (
    ORACLE_POLICY,
    EvaluationConfig,
    RunRow,
    gpu_counts_of,
    run_point,
)
from argus.sim.evaluation_report import format_difference
from argus.sim.intervals import Aggregate, Paired, aggregate, paired
from argus.sim.offered_load import cluster_capacity_qpm, planning_profiles
from argus.sim.workloads import load_prompt_file
from argus.traces import PromptRecord, default_prompt_trace
from argus.types import Strategy

DEFAULT_RHOS = (0.0, 0.25, 0.5, 0.75, 1.0)
LABEL_SEED = 0  # the quality seed argus train-classifier labels with by default
POLICIES = ("argus", "pac")  # run_point adds argus-oracle when both run


def text_share_models(rho: float) -> dict[Strategy, SyntheticModel]:
    """The calibrated synthetic model of each strategy with text share ``rho``."""
    return {s: dataclasses.replace(SYNTHETIC_MODELS[s], feature_share=rho) for s in Strategy}


@dataclasses.dataclass(frozen=True)
class Point:
    """What the sweep measured at one text share."""

    rho: float
    training: dict[Strategy, TrainResult]  # the classifier of each strategy, with its metrics
    rows: tuple[RunRow, ...]  # every (seed, policy) run
    train_s: float  # wall seconds of steps 1-2
    serve_s: float  # wall seconds of step 3

    def aggregates(self) -> dict[str, Aggregate]:
        """Means over the seeds, by policy."""
        return {a.policy: a for a in aggregate(self.rows)}

    def comparison(self) -> Paired:
        [only] = paired(self.rows)  # one load point
        return only

    def q_spread(self, strategy: Strategy) -> float:
        """Q(fastest | most tolerant class) − Q(fastest | least tolerant class), measured on
        the CALIBRATION prompts."""
        calibration = self.training[strategy].classifier.calibration
        assert calibration is not None and calibration.stats is not None
        quality = calibration.stats.quality
        return quality[-1][-1] - quality[0][-1]


def train_at(
    rho: float,
    records: Sequence[PromptRecord],
    profiles_name: str,
    cache: EmbeddingCache,
    config: TrainConfig,
) -> tuple[dict[Strategy, TrainResult], TrainedClassifier]:
    """Steps 1-2: each strategy's classifier on the seed-0 tables at text share ``rho``."""
    profiles = load_profiles(profiles_name)
    models = text_share_models(rho)
    results = {}
    for strategy in Strategy:
        levels = [lv.name for lv in profiles.levels_for(strategy)]
        table = synthetic_quality_table(records, strategy, levels, LABEL_SEED, models[strategy])
        data = labels_from_table(table, DEFAULT_DELTA, max_chars=max_chars_for(config.max_tokens))
        results[strategy] = train_classifier(data, config, cache=cache)
    served = ClassifierSet({s: r.classifier for s, r in results.items()})
    return results, TrainedClassifier.in_memory(served, f"minilm-logistic at ρ = {rho:g}")


def sweep_point(
    rho: float,
    records: Sequence[PromptRecord],
    config: EvaluationConfig,
    capacity_qpm: float,
    cache: EmbeddingCache,
    train_config: TrainConfig,
) -> Point:
    """Steps 1-3 at one text share."""
    started = time.perf_counter()
    training, classifier = train_at(rho, records, config.profiles, cache, train_config)
    trained = time.perf_counter()
    models = text_share_models(rho)
    rows = [
        row
        for seed in range(config.seeds)
        for point in config.loads
        for row in run_point(
            config, point, seed, capacity_qpm, classifier=classifier, models=models
        )
    ]
    done = time.perf_counter()
    return Point(rho, training, tuple(rows), trained - started, done - trained)


def capacity_of(config: EvaluationConfig) -> float:
    """The capacity the target load multiplies, as ``argus evaluate`` computes it."""
    profiles = load_profiles(config.profiles)
    plan = planning_profiles(profiles, config.adapters)
    return cluster_capacity_qpm(plan, gpu_counts_of(config, profiles))


# ---------------------------------------------------------------------------------------------
# The tables

CLASSIFIER_HEADER = (
    f"{'ρ':>5} {'':<3} {'C':>5} {'accuracy':>8} {'classifier':>10} {'random':>7} "
    f"{'oracle':>7} {'gap closed':>10} {'mean level':>11} {'Q spread':>8}  quality"
)
SERVING_HEADER = (
    f"{'ρ':>5} {'argus (n)':>15} {'pac (n)':>15} {'oracle (n)':>15} {'viol argus':>10} "
    f"{'viol pac':>8} {'argus − pac [95%]':>25} {'oracle − pac [95%]':>25} {'kept':>5}  quality"
)


def classifier_lines(point: Point) -> list[str]:
    """One line per strategy: the classifier's EVAL figures and its classes' Q spread."""
    lines = []
    for strategy, result in point.training.items():
        evaluation = result.evaluations["eval"]
        quality = evaluation.quality
        assert quality is not None  # synthetic labels come with scores
        lines.append(
            f"{point.rho:5.2f} {strategy.value:<3} {result.selection['C']:5g} "
            f"{evaluation.accuracy:8.1%} {quality.classifier:10.2f} {quality.random:7.2f} "
            f"{quality.oracle:7.2f} {_percent(quality.gap_closed):>10} "
            f"{quality.mean_level_classifier:5.2f}/{quality.mean_level_oracle:<5.2f} "
            f"{point.q_spread(strategy):+8.3f}  SYNTHETIC"
        )
    return lines


def serving_line(point: Point) -> str:
    """Effective quality per policy, violations, Argus − PAC and the oracle gap kept."""
    means, comparison = point.aggregates(), point.comparison()

    def served(policy: str) -> str:
        metrics = means[policy].metrics
        quality, count = metrics["effective_quality"].mean, metrics["quality_n"].mean
        return f"{quality:.2f} ({count:,.0f})"

    def violations(policy: str) -> str:
        return f"{means[policy].metrics['slo_violation_ratio'].mean:.1%}"

    return (
        f"{point.rho:5.2f} {served('argus'):>15} {served('pac'):>15} "
        f"{served(ORACLE_POLICY):>15} {violations('argus'):>10} {violations('pac'):>8} "
        f"{format_difference(comparison.quality_diff):>25} "
        f"{format_difference(comparison.oracle_diff):>25} "
        f"{_percent(comparison.gap_closed):>5}  SYNTHETIC"
    )


def _percent(share: float) -> str:
    return f"{share:.0%}" if math.isfinite(share) else "-"


def print_header(
    records: Sequence[PromptRecord], config: EvaluationConfig, capacity_qpm: float
) -> None:
    sets = [prompt_set(r.prompt) for r in records]
    split = "/".join(str(sets.count(which)) for which in PromptSet)
    [load] = config.loads
    counts = gpu_counts_of(config, load_profiles(config.profiles))
    gpus = ", ".join(f"{n} {c}" for c, n in counts)
    print(machine_line())
    print(
        "Argus vs PAC against the text share ρ of the SYNTHETIC quality model "
        "(argus/profiles/synthetic_quality.py)"
    )
    print(
        f"prompts: {config.prompts_path or 'PartiPrompts'} ({len(records)}; "
        f"train/calibration/eval {split}); load {load.label} × capacity {capacity_qpm:.1f} "
        f"QPM ({gpus}); {config.seeds} paired seeds × {config.duration_min:g} simulated min; "
        f"adapters {config.adapters}"
    )


def print_tables(points: Sequence[Point]) -> None:
    print(
        "\nClassifier (logistic head on frozen all-MiniLM-L6-v2, TRAIN split, seed-0 labels), "
        "SYNTHETIC quality of the\nEVAL prompts on the seed-0 tables at the predicted, a "
        "random and the optimal level; mean level index served\n(predicted/optimal, 0 = "
        "slowest: quality alone flatters a classifier that plays safe); Q spread on CALIBRATION"
    )
    print(CLASSIFIER_HEADER)
    for point in points:
        for line in classifier_lines(point):
            print(line)
    print(
        "\nServing: SYNTHETIC effective quality (mean over seeds; n = requests served within "
        "the SLO, per run), SLO\nviolations (refused included), paired differences over "
        "seeds; kept = (argus − pac) / (oracle − pac)"
    )
    print(SERVING_HEADER)
    for point in points:
        print(serving_line(point))
    print(
        "kept: only where oracle − pac has a 95% interval above 0 (one seed: above 0); "
        "'-' elsewhere"
    )


# ---------------------------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--rhos",
        default=",".join(f"{r:g}" for r in DEFAULT_RHOS),
        help="text shares ρ in [0, 1], comma-separated",
    )
    parser.add_argument("--seeds", type=int, default=20, help="paired seeds per ρ")
    parser.add_argument("--duration", type=float, default=15.0, help="simulated minutes per run")
    parser.add_argument(
        "--target-load", default="0.65:1.0", help="MEAN:PEAK offered load, × capacity"
    )
    parser.add_argument("--prompts", help="prompt file (TSV, Prompt column); default PartiPrompts")
    args = parser.parse_args(argv)
    try:
        args.rhos = tuple(float(part) for part in args.rhos.split(",") if part.strip())
        args.config = EvaluationConfig(
            loads=parse_loads(None, [args.target_load]),
            policies=POLICIES,
            seeds=args.seeds,
            duration_min=args.duration,
            prompts_path=args.prompts,
            adapters="none",
        )
    except (CLIError, ValueError) as exc:
        parser.error(str(exc))
    if not args.rhos or any(not 0.0 <= r <= 1.0 for r in args.rhos):
        parser.error(f"--rhos: need values in [0, 1], got {args.rhos}")
    return args


def main(argv: Sequence[str] | None = None) -> list[Point]:
    """Run the sweep; prints the tables and returns what was measured per ρ."""
    import torch

    args = parse_args(argv)
    config: EvaluationConfig = args.config
    records = load_prompt_file(args.prompts or default_prompt_trace())
    capacity = capacity_of(config)
    print_header(records, config, capacity)
    started = time.perf_counter()
    cache = EmbeddingCache()
    points = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; restored for a caller in this process
    try:
        with threadpool_limits(limits=1):
            for rho in args.rhos:
                point = sweep_point(rho, records, config, capacity, cache, TrainConfig())
                print(
                    f"ρ = {rho:g}: trained in {point.train_s:.0f} s, "
                    f"served in {point.serve_s:.0f} s",
                    flush=True,
                )
                points.append(point)
    finally:
        torch.set_num_threads(threads)
    print_tables(points)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return points


if __name__ == "__main__":
    main()
    print(load_line("end"))
