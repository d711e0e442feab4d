"""``argus replay``: replay a workload through several policies on a simulated cluster.

Writes ``summary.json``, ``per_minute.csv`` and ``timeseries.png`` into ``--out`` and prints
the summary table. Bad input (trace, prompts, policy names, fault specs) exits with code 2 and
a one-line error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from argus.cli.main import CLIError


class ReplayCommand:
    name = "replay"
    help = "Replay a trace through Argus and the baselines on a simulated cluster."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--trace",
            default="azure",
            help="azure, bursty, ramp, gamma, poisson, or a trace file (CSV)",
        )
        parser.add_argument("--prompts", help="prompt file (TSV with a Prompt column)")
        parser.add_argument(
            "--policies",
            default="argus,pac,proteus,clipper-ha,clipper-ht,sommelier,nirvana",
            help="comma-separated policy names",
        )
        parser.add_argument("--gpus", type=int, default=8)
        parser.add_argument("--duration", type=float, help="minutes, for synthetic traces")
        parser.add_argument("--scale", type=float, default=1.0, help="rate scale of the trace")
        parser.add_argument("--profiles", default="default", help="'default' or a TOML/YAML file")
        parser.add_argument(
            "--classifier",
            default="default",
            help=(
                "level classifier of argus and nirvana: 'default' (the committed "
                "classifiers/minilm-logistic: logistic heads on frozen all-MiniLM-L6-v2, "
                "trained on SYNTHETIC labels), 'oracle' (the quality table's optimal level), "
                "'noisy-oracle@ACCURACY', or a classifier directory from argus train-classifier"
            ),
        )
        parser.add_argument(
            "--gpu-failure",
            action="append",
            default=[],
            metavar="START:END:COUNT",
            help="minutes; COUNT GPUs down (repeatable)",
        )
        parser.add_argument(
            "--retrieval-fault",
            action="append",
            default=[],
            metavar="START:END[:EXTRA_S]",
            help="minutes; retrieval slower by EXTRA_S seconds, or down without it",
        )
        parser.add_argument(
            "--adapters",
            default="katz",
            help=(
                "ControlNets and LoRAs on the requests, drawn from Katz's production statistics "
                "(service A): 'katz' (served as Argus does: ControlNet-as-a-Service + bounded "
                "async LoRA loading), 'sequential' (the naive pipeline, Katz Eq. 1) or 'none'"
            ),
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--out", type=Path, default=Path("replay-out"))
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        from argus.profiles import ProfileError, load_profiles
        from argus.sim.adapters import adapter_model_by_name
        from argus.sim.cluster import SimConfig, Simulation
        from argus.sim.policies import make_classifier, make_policy
        from argus.sim.quality import synthetic_quality_table
        from argus.sim.report import format_table, write_reports
        from argus.sim.workloads import WorkloadError, workload_by_name
        from argus.types import Strategy

        try:
            profiles = load_profiles(args.profiles)
            workload = workload_by_name(
                args.trace,
                duration_min=args.duration,
                scale=args.scale,
                seed=args.seed,
                prompts_path=args.prompts,
            )
            names = [name.strip() for name in args.policies.split(",") if name.strip()]
            if not names:
                raise CLIError("--policies: no policy named")
            classifier = make_classifier(args.classifier)
            policies = [make_policy(n, classifier=classifier, seed=args.seed) for n in names]
            faults = parse_faults(args.gpu_failure, args.retrieval_fault)
            adapters = adapter_model_by_name(args.adapters)
            config = SimConfig(gpus=args.gpus, faults=faults, seed=args.seed, adapters=adapters)
        except (ProfileError, WorkloadError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        quality = {
            s: synthetic_quality_table(
                workload.prompts, s, [lv.name for lv in profiles.levels_for(s)], seed=args.seed
            )
            for s in Strategy
        }
        prepare = getattr(classifier, "prepare", None)
        if prepare is not None and any(
            getattr(p, "classifier", None) is classifier for p in policies
        ):
            try:
                prepare(quality)  # load the trained models now: errors are one line
            except ValueError as exc:
                raise CLIError(f"--classifier: {exc}") from None
        sim = Simulation(profiles, quality, workload, config)
        results = []
        started = time.perf_counter()
        for policy in policies:
            bar = None if args.quiet else _Progress(policy.name, len(workload))
            results.append(sim.run(policy, bar.update if bar else None))
            if bar:
                bar.done()
        description = _description(args, workload, quality, classifier)
        description["adapters"] = "none" if adapters is None else adapters.describe()
        summaries = write_reports(results, args.out, description=description)
        print(format_table(summaries))
        print(
            f"\n{len(workload):,} requests × {len(policies)} policies in "
            f"{time.perf_counter() - started:.1f} s; quality model: {_short(description)}; "
            f"classifier (argus, nirvana): {classifier.label}; adapters: {args.adapters}; "
            f"reports in {args.out}/"
        )
        return 0


def parse_faults(gpu_specs: list[str], retrieval_specs: list[str]) -> tuple[Any, ...]:
    """``START:END:COUNT`` and ``START:END[:EXTRA_S]`` specs (minutes) into fault values."""
    from argus.sim.cluster import GpuFailure, RetrievalFault

    faults: list[Any] = []
    for spec in gpu_specs:
        parts = spec.split(":")
        if len(parts) != 3:
            raise CLIError(f"--gpu-failure: expected START:END:COUNT in minutes, got {spec!r}")
        start, end = _minutes(parts[0], spec), _minutes(parts[1], spec)
        if not parts[2].isdigit():
            raise CLIError(f"--gpu-failure: COUNT must be a whole number, got {spec!r}")
        faults.append(GpuFailure(start, end, int(parts[2])))
    for spec in retrieval_specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise CLIError(f"--retrieval-fault: expected START:END[:EXTRA_S], got {spec!r}")
        extra = math.inf if len(parts) == 2 else _number(parts[2], spec)
        faults.append(RetrievalFault(_minutes(parts[0], spec), _minutes(parts[1], spec), extra))
    return tuple(faults)


def _minutes(text: str, spec: str) -> float:
    return 60.0 * _number(text, spec)


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CLIError(f"fault {spec!r}: {text!r} is not a number") from None


def _description(
    args: argparse.Namespace, workload: Any, quality: Any, classifier: Any
) -> dict[str, str]:
    sources = sorted({table.source for table in quality.values()})
    return {
        "title": (
            f"{workload.name} (rate x{args.scale:g}): {len(workload):,} requests on "
            f"{args.gpus} GPUs, synthetic quality"
        ),
        "trace": workload.source,
        "quality": "; ".join(sources),
        "classifier": classifier.label,
        "gpus": str(args.gpus),
        "seed": str(args.seed),
    }


def _short(description: dict[str, str]) -> str:
    """The quality model in a few words (summary.json has the full description)."""
    if description["quality"].startswith("synthetic"):
        return "SYNTHETIC (argus/sim/quality.py)"
    return description["quality"]


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, name: str, total: int) -> None:
        self.name = name
        self.total = max(total, 1)
        self.started = time.perf_counter()
        self.update(0)

    def update(self, done: int) -> None:
        width = 30
        filled = width * done // self.total
        sys.stderr.write(
            f"\r{self.name:<11} [{'#' * filled}{'.' * (width - filled)}] {done:>9,}/{self.total:,}"
        )
        sys.stderr.flush()

    def done(self) -> None:
        self.update(self.total)
        sys.stderr.write(f"  {time.perf_counter() - self.started:.1f} s\n")
