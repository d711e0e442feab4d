"""``argus evaluate``: the load sweep of the Argus paper's Fig. 17 on the simulated cluster.

Runs every policy at several offered loads (multiples of the cluster's capacity) over paired
seeds and writes, into ``--out``:

* ``runs.csv``: every (load, policy, seed) run's summary (the keys of ``argus replay``'s
  summary.json) with its load, seed and wall time;
* ``aggregate.csv``: per (load, policy), the mean and 95 % interval over the seeds of effective
  quality (with its count), goodput, refusals and SLO violations (admitted and all);
* ``paired.csv``: argus − pac per load, paired by seed, and the share of the oracle's quality
  gain over PAC that the trained classifier keeps;
* ``summary.json``: the settings, the capacity and how the workloads were made;
* ``quality_world.txt`` (genai-bench world only): the classifier's predictability on
  held-out raters, as printed;
* ``quality_vs_load.png``, ``goodput_vs_load.png``, ``slo_violations_vs_load.png``.

and prints the compact table. The method is in :mod:`argus.sim.evaluate`. Bad input exits with
code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from argus import defaults
from argus.cli.edit_evaluate import add_edit_arguments, run_edits
from argus.cli.main import CLIError
from argus.cli.options import (
    add_cache_argument,
    add_cache_warm_argument,
    add_late_binding_argument,
    add_quality_argument,
    describe_gpus,
    parse_gpus,
)
from argus.plumbing.quoting import quoted

DEFAULT_LOADS = ",".join(f"{load:g}" for load in defaults.EVALUATION_LOADS)
DEFAULT_POLICIES = ",".join(defaults.EVALUATION_POLICIES)


class EvaluateCommand:
    name = "evaluate"
    help = (
        "Sweep the offered load over multiples of the cluster's capacity and compare every "
        "policy over paired seeds (the Argus paper's Fig. 17), on the simulated cluster."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--loads",
            help=f"mean offered loads as multiples of the capacity (default {DEFAULT_LOADS})",
        )
        parser.add_argument(
            "--target-load",
            action="append",
            default=[],
            metavar="MEAN[:PEAK]",
            help=(
                "instead of --loads: one load point, mean and busiest minute as multiples of "
                "the capacity (repeatable)"
            ),
        )
        parser.add_argument(
            "--policies",
            help=(
                f"comma-separated policy names (default {DEFAULT_POLICIES}; without nirvana, "
                "AC only, in the genai-bench world)"
            ),
        )
        parser.add_argument("--seeds", type=int, default=5, help="paired seeds (default 5)")
        parser.add_argument(
            "--duration", type=float, default=30.0, help="minutes of trace per run (default 30)"
        )
        parser.add_argument(
            "--trace",
            default="poisson",
            help=(
                "poisson (default), gamma, bursty, ramp, azure or a trace file, rescaled to "
                "each load"
            ),
        )
        parser.add_argument(
            "--prompts", help="prompt file (TSV with a Prompt column); only its eval set is used"
        )
        parser.add_argument(
            "--gpus",
            default="8",
            metavar="N|CLASS=N,...",
            help="simulated GPUs, as argus replay --gpus (default 8)",
        )
        parser.add_argument("--profiles", default="default", help="'default' or a TOML/YAML file")
        parser.add_argument("--adapters", default="katz", help="katz (default), sequential or none")
        parser.add_argument(
            "--classifier",
            default="default",
            help=(
                "level classifier of argus and nirvana, as argus replay --classifier (default: "
                "the committed trained classifier); argus-oracle always uses 'oracle'"
            ),
        )
        parser.add_argument(
            "--no-admission",
            action="store_true",
            help="queue every request instead of refusing what would miss its deadline",
        )
        add_quality_argument(parser)
        add_cache_argument(parser)
        add_cache_warm_argument(parser)
        add_late_binding_argument(parser)
        add_edit_arguments(parser)  # --workload edits: argus/cli/edit_evaluate.py
        parser.add_argument(
            "--caps",
            choices=defaults.CAPS,
            help="queueing caps of the planned policies (default: theirs, measured)",
        )
        parser.add_argument(
            "--strategy-choice",
            choices=defaults.STRATEGY_CHOICES,
            help="strategy choice of argus and pac (default: theirs)",
        )
        parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
        parser.add_argument("--out", type=Path, default=Path("evaluate-out"))
        parser.add_argument("--quiet", action="store_true", help="no progress line")

    def run(self, args: argparse.Namespace) -> int:
        if args.workload == "edits":
            return run_edits(args)
        from argus.profiles import ProfileError
        from argus.profiles.quality_worlds import world_label
        from argus.sim.evaluate import EvaluationConfig, evaluate
        from argus.sim.evaluation_report import format_evaluation, write_evaluation
        from argus.sim.workloads import WorkloadError

        started = time.perf_counter()
        policies = args.policies
        if policies is None:
            policies = DEFAULT_POLICIES
            if args.quality == "genai-bench":
                policies = ",".join(
                    p for p in _names(policies) if p not in defaults.AC_ONLY_POLICIES
                )
        try:
            config = EvaluationConfig(
                loads=parse_loads(args.loads, args.target_load),
                policies=tuple(_names(policies)),
                seeds=args.seeds,
                duration_min=args.duration,
                trace=args.trace,
                prompts_path=args.prompts,
                gpu_counts=_gpu_counts(args.gpus, args.profiles, args.quality),
                profiles=args.profiles,
                adapters=args.adapters,
                classifier=args.classifier,
                admission=not args.no_admission,
                jobs=args.jobs,
                quality=args.quality,
                caps=args.caps,
                strategy_choice=args.strategy_choice,
                cache=args.cache,
                cache_warm=args.cache_warm,
                late_binding_window=args.late_binding_window,
            )
            progress = None if args.quiet else _Progress().update
            evaluation = evaluate(config, progress)
        except (ProfileError, WorkloadError, ValueError) as exc:
            raise CLIError(_one_line(str(exc))) from None
        if not args.quiet:
            sys.stderr.write("\n")
        write_evaluation(evaluation, args.out)
        print(format_evaluation(evaluation))
        if evaluation.quality_notes:
            notes = "\n".join(evaluation.quality_notes)
            print(f"\n{notes}")
            (args.out / "quality_world.txt").write_text(notes + "\n", encoding="utf-8")
        runs = len(evaluation.rows)
        print(
            f"\n{runs} runs ({len(config.loads)} loads × {len(config.run_names())} policies × "
            f"{config.seeds} seeds, {config.duration_min:g} min each) in "
            f"{time.perf_counter() - started:.1f} s; capacity {evaluation.capacity_qpm:.1f} QPM "
            f"on {_describe(evaluation.gpu_counts)}; SLO {evaluation.slo_s:g} s; quality model: "
            f"{world_label(config.quality)}; cache: {config.cache}; files in {args.out}/"
        )
        return 0


def parse_loads(loads: str | None, targets: list[str]) -> tuple[Any, ...]:
    """``--loads A,B,...`` or ``--target-load MEAN[:PEAK]`` (repeatable) -> LoadPoints."""
    from argus.sim.evaluate import LoadPoint

    if loads is not None and targets:
        raise CLIError("give --loads or --target-load, not both")
    if targets:
        points = []
        for spec in targets:
            mean, colon, peak = spec.partition(":")
            points.append(
                LoadPoint(
                    _number("--target-load", mean, spec),
                    _number("--target-load", peak, spec) if colon else None,
                )
            )
        return tuple(points)
    text = DEFAULT_LOADS if loads is None else loads
    values = [_number("--loads", part, text) for part in text.split(",") if part.strip()]
    if not values:
        raise CLIError(f"--loads: no load in {quoted(text)}")
    return tuple(LoadPoint(value) for value in values)


def _number(flag: str, text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CLIError(
            f"{flag}: {quoted(text.strip())} is not a number (in {quoted(spec)})"
        ) from None


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CLIError("--policies: no policy named")
    return names


def _gpu_counts(text: str, profiles: str, quality: str) -> tuple[tuple[str, int], ...]:
    from argus.profiles.quality_worlds import world_profiles

    known = world_profiles(quality, profiles).worker_classes
    return tuple(parse_gpus(text, known).items())


def _describe(counts: tuple[tuple[str, int], ...]) -> str:
    return describe_gpus(dict(counts))


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Progress:
    """``(load, seed) points done / total`` on one line of stderr."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def update(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(f"\revaluate: {done}/{total} (load, seed) points, {elapsed:.0f} s")
        sys.stderr.flush()
