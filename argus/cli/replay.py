"""``argus replay``: replay a workload through several policies on a simulated cluster, or with
``--live ADDRESS`` through a running cluster's router (:mod:`argus.tools.live`).

Writes ``summary.json``, ``per_minute.csv`` and ``timeseries.png`` into ``--out`` and prints
the summary table (a live replay also writes ``requests.csv``, one row per request);
``--save-trace PATH`` also writes the simulated workload as a trace file
(:mod:`argus.sim.trace_files`), so ``--trace PATH`` replays it again. Bad input
(trace, prompts, policy names, fault specs, flags of the other mode, an unreachable router)
exits with code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from argus import defaults
from argus.cli.main import CLIError
from argus.cli.options import (
    add_cache_argument,
    add_late_binding_argument,
    add_quality_argument,
    describe_gpus,
    parse_gpus,
)
from argus.plumbing.quoting import quoted

DEFAULT_POLICIES = ",".join(defaults.EVALUATION_POLICIES)
SIM_DEFAULTS: dict[str, Any] = {
    "policies": DEFAULT_POLICIES,
    "gpus": "8",
    "classifier": "default",
    "adapters": "katz",
}
SIM_ONLY = (
    "policies",
    "gpus",
    "classifier",
    "adapters",
    "gpu_failure",
    "retrieval_fault",
    "no_admission",
    "save_trace",
)
LIVE_ONLY = ("speedup", "limit", "timeout_s", "max_outstanding", "auth_token_file", "tls_ca")
DEFAULT_SPEEDUP = 60.0
CONNECT_TIMEOUT_S = 5.0
REFUSALS = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"})


class ReplayCommand:
    name = "replay"
    help = (
        "Replay a trace through Argus and the baselines on a simulated cluster, "
        "or with --live through a running cluster."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--trace",
            default="azure",
            help="azure, bursty, ramp, gamma, poisson, or a trace file (CSV)",
        )
        parser.add_argument("--prompts", help="prompt file (TSV with a Prompt column)")
        parser.add_argument(
            "--policies", help=f"comma-separated policy names (default {DEFAULT_POLICIES})"
        )
        parser.add_argument(
            "--gpus",
            metavar="N|CLASS=N,...",
            help=(
                "simulated GPUs: a count, all of the profiles' first GPU class (default 8), or "
                "counts per class such as a100=4,h100=4; the SLO is 3 x the best level's "
                "latency on the slowest class present"
            ),
        )
        parser.add_argument("--duration", type=float, help="minutes, for synthetic traces")
        parser.add_argument("--scale", type=float, default=1.0, help="rate scale of the trace")
        parser.add_argument("--profiles", default="default", help="'default' or a TOML/YAML file")
        parser.add_argument(
            "--classifier",
            help=(
                "level classifier of argus and nirvana: 'default' (the committed "
                "classifiers/minilm-l2-logistic-int8: logistic heads on the first 2 layers "
                "of all-MiniLM-L6-v2 in int8, trained on SYNTHETIC labels), 'oracle' "
                "(the quality table's optimal level), "
                "'noisy-oracle@ACCURACY', 'text-ceiling' (the synthetic world's own "
                "difficulty feature, fitted on TRAIN prompts), or a classifier directory from "
                "argus train-classifier"
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
            help=(
                "ControlNets and LoRAs on the requests, drawn from Katz's production statistics "
                "(service A): 'katz' (served as Argus does: ControlNet-as-a-Service + bounded "
                "async LoRA loading; the default), 'sequential' (the naive pipeline, Katz Eq. 1) "
                "or 'none'"
            ),
        )
        parser.add_argument(
            "--no-admission",
            action="store_true",
            default=None,
            help=(
                "queue every request (an ablation); by default the simulator refuses, as the "
                "router does, a request predicted to miss its deadline"
            ),
        )
        add_quality_argument(parser)
        parser.add_argument(
            "--save-trace",
            type=Path,
            metavar="PATH",
            help=(
                "also write the workload replayed (arrivals and prompts) as a trace file; "
                "--trace PATH replays it again"
            ),
        )
        add_cache_argument(parser)
        add_late_binding_argument(parser)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--out", type=Path, default=Path("replay-out"))
        parser.add_argument("--quiet", action="store_true", help="no progress bar")
        live = parser.add_argument_group(
            "live replay", "send the trace to a running cluster's router instead of simulating"
        )
        live.add_argument("--live", metavar="ADDRESS", help="HOST:PORT of a router")
        live.add_argument(
            "--speedup",
            type=float,
            help=(
                f"trace seconds per wall-clock second (default {DEFAULT_SPEEDUP:g}); the "
                "cluster sees SPEEDUP x the trace's rate, add --scale 1/SPEEDUP to keep its load"
            ),
        )
        live.add_argument("--limit", type=int, help="send only the first N requests")
        live.add_argument(
            "--timeout-s", type=float, help="client timeout per request (default: the SLO + 10 s)"
        )
        live.add_argument(
            "--max-outstanding",
            type=int,
            help="requests in flight at most (default 256); more are dropped, not queued",
        )
        live.add_argument(
            "--auth-token-file",
            type=Path,
            metavar="PATH",
            help="bearer token, sent as 'authorization: Bearer <token>'",
        )
        live.add_argument(
            "--tls-ca", type=Path, metavar="PATH", help="PEM CA certificates: connect with TLS"
        )

    def run(self, args: argparse.Namespace) -> int:
        if args.live is not None:
            _refuse(args, SIM_ONLY, "does not apply with --live (the cluster decides)")
            return run_live(args)
        _refuse(args, LIVE_ONLY, "needs --live")
        for name, value in SIM_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
                if name == "policies" and args.quality == "genai-bench":
                    args.policies = ",".join(
                        p for p in value.split(",") if p.strip() not in defaults.AC_ONLY_POLICIES
                    )
        return self._simulate(args)

    def _simulate(self, args: argparse.Namespace) -> int:
        from argus.profiles import ProfileError, load_cache_rules
        from argus.profiles.quality_worlds import world_profiles
        from argus.sim.adapters import adapter_model_by_name
        from argus.sim.classifiers import make_classifier
        from argus.sim.cluster import SimConfig, Simulation
        from argus.sim.policies import make_policy
        from argus.sim.report import format_table, is_synthetic, write_reports
        from argus.sim.trace_files import save_workload
        from argus.sim.workloads import WorkloadError

        genai = args.quality == "genai-bench"
        try:
            profiles = world_profiles(args.quality, args.profiles)
            workload = _workload(args)
            names = [name.strip() for name in args.policies.split(",") if name.strip()]
            if not names:
                raise CLIError("--policies: no policy named")
            if genai and any(name in defaults.AC_ONLY_POLICIES for name in names):
                raise CLIError(
                    "--policies: nirvana serves AC levels only, and the genai-bench world "
                    "has none (SM only)"
                )
            if genai and args.classifier.strip() == "default":
                from argus.sim.evaluate import genai_classifier

                classifier = genai_classifier().classifier
            else:
                classifier = make_classifier(args.classifier)
            policies = [make_policy(n, classifier=classifier, seed=args.seed) for n in names]
            faults = parse_faults(args.gpu_failure, args.retrieval_fault)
            adapters = adapter_model_by_name(args.adapters)
            gpu_counts = parse_gpus(args.gpus, profiles.worker_classes)
            config = SimConfig.with_classes(
                gpu_counts,
                faults=faults,
                seed=args.seed,
                adapters=adapters,
                admission=not args.no_admission,
                cache=args.cache,
                cache_rules=tuple(load_cache_rules(args.profiles).items()),
                late_binding_window=0 if args.no_admission else args.late_binding_window,
            )
            if args.save_trace is not None:
                save_workload(workload, args.save_trace)
        except (ProfileError, WorkloadError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        quality = _quality(args.quality, profiles, workload.prompts, args.seed)
        if not args.quiet and hasattr(classifier, "progress"):
            classifier.progress = _EmbeddingProgress()
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
        description = _description(args, workload, quality, classifier, gpu_counts)
        description["slo_s"] = f"{sim.slo_s:g}"
        description["adapters"] = "none" if adapters is None else adapters.describe()
        description["cache"] = args.cache
        description["admission"] = (
            "on: refuse what is predicted to miss its deadline, as the router does"
            if config.admission
            else "off: every request queued (ablation)"
        )
        summaries = write_reports(results, args.out, description=description)
        print(format_table(summaries, synthetic_quality=is_synthetic(description["quality"])))
        if genai and args.classifier.strip() == "default":
            from argus.sim.evaluate import genai_classifier

            print("\n" + "\n".join(genai_classifier().predictability.lines()))
        print(
            f"\n{len(workload):,} requests × {len(policies)} policies in "
            f"{time.perf_counter() - started:.1f} s; quality model: {_short(description)}; "
            f"classifier (argus, nirvana): {classifier.label}; adapters: {args.adapters}; "
            f"reports in {args.out}/"
        )
        return 0


def _workload(args: argparse.Namespace) -> Any:
    """The trace with its prompts; in the genai-bench world the prompts are GenAI-Bench's
    EVAL prompts in seed ``args.seed``'s order (``--prompts`` does not apply)."""
    import numpy as np

    from argus.sim.named_workloads import workload_by_name
    from argus.sim.workloads import Workload

    if args.quality == "genai-bench" and args.prompts is not None:
        raise CLIError("--prompts: the genai-bench world serves GenAI-Bench's own EVAL prompts")
    workload = workload_by_name(
        args.trace,
        duration_min=args.duration,
        scale=args.scale,
        seed=args.seed,
        prompts_path=args.prompts,
    )
    if args.quality != "genai-bench":
        return workload
    from argus.profiles.quality_worlds import genai_eval_records

    prompts = genai_eval_records()
    order = np.random.default_rng([args.seed, 2]).permutation(len(prompts))
    return Workload(
        workload.name,
        workload.arrivals_s,
        tuple(prompts[i] for i in order),
        f"{workload.source}; GenAI-Bench EVAL prompts in seed {args.seed}'s order",
        horizon_s=workload.horizon_s,
    )


def _quality(world: str, profiles: Any, prompts: Any, seed: int) -> dict[Any, Any]:
    """The quality tables of ``world`` for the workload's prompts, drawn with ``seed``."""
    from argus.profiles.quality_worlds import world_quality_tables
    from argus.profiles.synthetic_quality import synthetic_quality_table
    from argus.types import Strategy

    if world != "synthetic":
        return world_quality_tables(world, profiles, prompts, seed)
    return {
        s: synthetic_quality_table(
            prompts, s, [lv.name for lv in profiles.levels_for(s)], seed=seed
        )
        for s in Strategy
    }


def _refuse(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """CLIError naming the first flag of ``names`` given on the command line."""
    for name in names:
        if getattr(args, name) not in (None, []):
            raise CLIError(f"--{name.replace('_', '-')} {why}")


def run_live(args: argparse.Namespace) -> int:
    """``argus replay --live``: the workload through a running router, the simulator's reports."""
    from argus.profiles import ProfileError, load_profiles
    from argus.sim.named_workloads import workload_by_name
    from argus.sim.report import format_table, is_synthetic, write_reports
    from argus.sim.workloads import WorkloadError
    from argus.tools.live import (
        NOT_SENT,
        LiveConfig,
        LiveError,
        open_channel,
        replay_live,
        selected_count,
        write_requests,
    )

    if args.quality == "genai-bench":
        raise CLIError(
            "--quality genai-bench does not apply with --live: the cluster serves its own "
            "levels, not GenAI-Bench's rated models"
        )
    if ":" not in args.live:
        raise CLIError(f"--live: expected HOST:PORT, got {quoted(args.live)}")
    try:
        profiles = load_profiles(args.profiles)
        workload = workload_by_name(
            args.trace,
            duration_min=args.duration,
            scale=args.scale,
            seed=args.seed,
            prompts_path=args.prompts,
        )
        config = LiveConfig(
            address=args.live,
            speedup=DEFAULT_SPEEDUP if args.speedup is None else args.speedup,
            limit=args.limit,
            timeout_s=args.timeout_s,
            max_outstanding=256 if args.max_outstanding is None else args.max_outstanding,
            seed=args.seed,
            auth_token=_read_token(args.auth_token_file),
        )
    except (ProfileError, WorkloadError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    tls_ca = _read_file("--tls-ca", args.tls_ca) if args.tls_ca is not None else None
    count = selected_count(workload, config.limit, config.window_s)
    if count == 0:
        raise CLIError(f"workload {workload.name!r} has no requests to send")
    quality = _quality(args.quality, profiles, workload.prompts, args.seed)
    try:
        channel = open_channel(args.live, tls_ca=tls_ca, connect_timeout_s=CONNECT_TIMEOUT_S)
    except LiveError as exc:
        raise CLIError(str(exc)) from None
    bar = None if args.quiet else _Progress("live", count)
    try:
        result = replay_live(
            workload, profiles, quality, config, channel, progress=bar.update if bar else None
        )
    finally:
        channel.close()
    if bar:
        bar.done()
    sources = sorted({table.source for table in quality.values()})
    description = {
        "title": (
            f"{workload.name} (rate x{args.scale:g}) live against {args.live} at "
            f"{config.speedup:g}x: {count:,} requests, {args.quality} quality"
        ),
        "trace": workload.source,
        "quality": "; ".join(sources),
        "quality_world": args.quality,
        "classifier": "the router's",
        "seed": str(args.seed),
        **result.describe(),
    }
    summaries = write_reports([result.run], args.out, description=description)
    write_requests(result, args.out / "requests.csv")
    print(format_table(summaries, synthetic_quality=is_synthetic(description["quality"])))
    c = result.counts
    print(
        f"\n{c.total:,} requests live against {args.live} at {config.speedup:g}x in "
        f"{result.wall_s:.1f} s: {c.sent:,} sent = {c.served:,} served "
        f"({c.late:,} later than the {result.run.slo_s:g} s SLO) + {c.rejected:,} rejected "
        f"+ {c.failed:,} failed; {c.dropped:,} dropped unsent; quality model: "
        f"{_short(description)}; reports in {args.out}/"
    )
    statuses = set(result.statuses()) - {NOT_SENT}
    if c.served == 0 and statuses and statuses <= REFUSALS:
        first = next(r for r in result.records if r.status in REFUSALS)
        raise CLIError(f"the router refused every request: {first.status}: {first.detail}")
    return 0


def _read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = _read_file("--auth-token-file", path).decode("utf-8", "replace").strip()
    if not token:
        raise CLIError(f"--auth-token-file: {path} is empty")
    return token


def _read_file(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CLIError(f"{flag}: cannot read {path}: {err.strerror}") from None


def parse_faults(gpu_specs: list[str], retrieval_specs: list[str]) -> tuple[Any, ...]:
    """``START:END:COUNT`` and ``START:END[:EXTRA_S]`` specs (minutes) into fault values."""
    from argus.sim.cluster import GpuFailure, RetrievalFault

    faults: list[Any] = []
    for spec in gpu_specs:
        parts = spec.split(":")
        if len(parts) != 3:
            raise CLIError(
                f"--gpu-failure: expected START:END:COUNT in minutes, got {quoted(spec)}"
            )
        start, end = _minutes(parts[0], spec), _minutes(parts[1], spec)
        if not parts[2].isdigit():
            raise CLIError(f"--gpu-failure: COUNT must be a whole number, got {quoted(spec)}")
        faults.append(GpuFailure(start, end, int(parts[2])))
    for spec in retrieval_specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise CLIError(f"--retrieval-fault: expected START:END[:EXTRA_S], got {quoted(spec)}")
        extra = math.inf if len(parts) == 2 else _number(parts[2], spec)
        faults.append(RetrievalFault(_minutes(parts[0], spec), _minutes(parts[1], spec), extra))
    return tuple(faults)


def _minutes(text: str, spec: str) -> float:
    return 60.0 * _number(text, spec)


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CLIError(f"fault {quoted(spec)}: {quoted(text)} is not a number") from None


def _description(
    args: argparse.Namespace,
    workload: Any,
    quality: Any,
    classifier: Any,
    gpu_counts: dict[str, int],
) -> dict[str, str]:
    sources = sorted({table.source for table in quality.values()})
    return {
        "title": (
            f"{workload.name} (rate x{args.scale:g}): {len(workload):,} requests on "
            f"{describe_gpus(gpu_counts)}, {args.quality} quality"
        ),
        "trace": workload.source,
        "quality": "; ".join(sources),
        "quality_world": args.quality,
        "classifier": classifier.label,
        "gpus": ",".join(f"{name}={count}" for name, count in gpu_counts.items()),
        "seed": str(args.seed),
    }


def _short(description: dict[str, str]) -> str:
    """The quality model in a few words (summary.json has the full description)."""
    from argus.profiles.quality_worlds import world_label

    world = description.get("quality_world")
    if world is not None:
        return world_label(world)
    if description["quality"].startswith("synthetic"):
        return "SYNTHETIC (argus/profiles/synthetic_quality.py)"
    return description["quality"]


class _EmbeddingProgress:
    """The progress bar of the classifier's embedding pass, made at its first report."""

    def __init__(self) -> None:
        self._bar: _Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = _Progress("classify", total)
        self._bar.update(done)
        if done >= total:
            self._bar.done()
            self._bar = None


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
