"""``argus plan``: one allocation and PASM for a given load, printed as one JSON object.

The output is a contract other tools rely on. Keys:

``strategy``; ``levels`` (names, slowest first); ``workers_per_level`` and ``load_share``
(QPM), both ``{level: value}`` in level order; ``pasm`` (``{from: {to: probability}}``, zero
entries left out); ``objective``; ``switch_cost``; ``served_qpm``; ``shortfall_qpm``;
``saturated``; ``moved_workers``; ``solve_ms``; ``assignment`` (``{worker_id: level}``, which
``--current-plan`` reads back); ``profiles`` (where the numbers came from); ``planner``
(``joint`` or ``paper``); ``class_quality`` (where Q(v | c) came from); ``slo_s`` (what the
queue model planned against, null without one); ``why`` (``{level: sentence}``: what each
level with workers serves and how busy the queue model lets it be).

The PASM's rows are the classifier's classes (``joint``: tolerance bins, least tolerant first;
``paper``: predicted optimal levels); row ``c`` is keyed by the name of level ``c``.

Bad input (histogram length or values, strategy, worker counts, profile files) exits with
code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from argus import defaults
from argus.cli.main import CLIError
from argus.plumbing.quoting import quoted

if TYPE_CHECKING:
    from argus.allocator.queueing import QueueModel
from argus.types import ClusterView, LoadForecast, Plan, ProfileSet, Strategy, WorkerState


class PlanCommand:
    name = "plan"
    help = "Solve one plan (workers per level and the PASM) for a given load; print it as JSON."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--profiles", default="default", help="'default' or a TOML/YAML file")
        parser.add_argument("--strategy", default="AC", help="AC or SM (default AC)")
        workers = parser.add_mutually_exclusive_group()
        workers.add_argument(
            "--workers", type=int, help="live workers, all of the first class (default 8)"
        )
        workers.add_argument(
            "--workers-by-class", help="live workers per GPU class, e.g. a100=4,h100=4"
        )
        parser.add_argument("--load", type=float, required=True, help="forecast load W_t in QPM")
        parser.add_argument(
            "--histogram",
            help="affinity H, one value per level, slowest first (default: uniform)",
        )
        parser.add_argument("--current-plan", type=Path, help="JSON of the plan now running")
        parser.add_argument(
            "--switch-cost",
            type=float,
            default=1.0,
            help="weight of a model load's forgone work, for workers that stop while loading "
            "(default 1); 0 plans as the allocator does for workers that load in the "
            "background, which forgo none",
        )
        parser.add_argument(
            "--period",
            type=float,
            default=defaults.PLANNING_PERIOD_S,
            help="planning period, s (default: %(default)s)",
        )
        parser.add_argument(
            "--planner",
            default="joint",
            help="joint (one program over class × level, the default) or paper (Eq. 1 + ODA)",
        )
        parser.add_argument(
            "--slo",
            type=float,
            help="SLO in seconds the queue model plans against (default "
            f"{defaults.SLO_FACTOR:g} × the best level's latency on the first class, as the "
            "allocator's); 0 plans every level up to its peak throughput",
        )

    def run(self, args: argparse.Namespace) -> int:
        from argus.allocator.planner import PlannerConfig, PlannerMode, make_plan
        from argus.allocator.queueing import QueueModel
        from argus.profiles import ProfileError, load_profiles
        from argus.slo import default_slo_s

        try:
            strategy = Strategy.parse(args.strategy)
            profiles = load_profiles(args.profiles)
            slo = default_slo_s(profiles, profiles.worker_classes[:1])
            if args.slo is not None:
                if not (math.isfinite(args.slo) and args.slo >= 0.0):
                    raise ValueError(f"--slo: must be a finite number >= 0, got {args.slo}")
                slo = args.slo
            config = PlannerConfig(
                switch_cost_weight=args.switch_cost,
                mode=PlannerMode.parse(args.planner),
                queue=QueueModel(slo) if slo > 0.0 else None,
            )
        except (ValueError, ProfileError) as exc:
            raise CLIError(str(exc)) from None
        levels = profiles.levels_for(strategy)
        if not levels:
            raise CLIError(
                f"--strategy: profiles {quoted(profiles.source)} have no {strategy} levels"
            )
        if not math.isfinite(args.load) or args.load < 0:
            raise CLIError(f"--load: must be a finite number >= 0, got {args.load}")
        histogram = parse_histogram(args.histogram, len(levels))
        workers = cluster_from_args(args, profiles)
        if args.current_plan is not None:
            workers = with_current_levels(workers, read_current_plan(args.current_plan))
        forecast = LoadForecast(args.load, args.load, args.load, 0.0)
        try:
            plan = make_plan(
                profiles,
                strategy,
                workers,
                forecast,
                histogram,
                config=config,
                period_s=args.period,
            )
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        document = plan_to_json(plan, profiles)
        document["planner"] = config.mode.value
        document["class_quality"] = "level averages"
        document["slo_s"] = config.queue.slo_s if config.queue else None
        document["why"] = explain(plan, profiles, workers, config.queue)
        print(json.dumps(document, indent=2))
        return 0


def parse_histogram(text: str | None, count: int) -> tuple[float, ...]:
    if text is None:
        return tuple(1.0 for _ in range(count))
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise CLIError(
            f"--histogram: expected comma-separated numbers, got {quoted(text)}"
        ) from None
    if len(values) != count:
        raise CLIError(f"--histogram: expected {count} values (one per level), got {len(values)}")
    for index, value in enumerate(values):
        if not math.isfinite(value) or value < 0:
            raise CLIError(f"--histogram: value {index} must be a finite number >= 0, got {value}")
    if sum(values) == 0:
        raise CLIError("--histogram: values sum to zero")
    return values


def cluster_from_args(args: argparse.Namespace, profiles: ProfileSet) -> ClusterView:
    if args.workers_by_class is None:
        count = 8 if args.workers is None else args.workers
        if count < 0:
            raise CLIError(f"--workers: must be >= 0, got {count}")
        return ClusterView.uniform(count, profiles.worker_classes[0])
    counts: dict[str, int] = {}
    for part in args.workers_by_class.split(","):
        name, sep, number = part.partition("=")
        if not sep or not number.strip().isdigit():
            raise CLIError(f"--workers-by-class: expected CLASS=COUNT, got {quoted(part)}")
        if name not in profiles.worker_classes:
            known = ", ".join(profiles.worker_classes)
            raise CLIError(
                f"--workers-by-class: unknown class {quoted(name)}; profiles know {known}"
            )
        counts[name] = int(number)
    return ClusterView.by_class(counts)


def read_current_plan(path: Path) -> dict[str, str]:
    """The ``assignment`` of a previous ``argus plan`` output: worker id → level."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CLIError(f"--current-plan: cannot read {path}: {exc}") from None
    assignment = data.get("assignment") if isinstance(data, dict) else None
    if not isinstance(assignment, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in assignment.items()
    ):
        raise CLIError(f"--current-plan: {path} has no 'assignment' object of worker -> level")
    return assignment


def with_current_levels(workers: ClusterView, assignment: dict[str, str]) -> ClusterView:
    return ClusterView(
        tuple(
            WorkerState(w.worker_id, w.worker_class, w.alive, assignment.get(w.worker_id))
            for w in workers.workers
        )
    )


def plan_to_json(plan: Plan, profiles: ProfileSet) -> dict[str, Any]:
    allocation = plan.allocation
    levels = allocation.levels
    return {
        "strategy": plan.strategy.value,
        "levels": list(levels),
        "workers_per_level": dict(zip(levels, allocation.workers_per_level, strict=True)),
        "load_share": {
            level: round(qpm, 6)
            for level, qpm in zip(levels, allocation.load_share_qpm, strict=True)
        },
        "pasm": {
            src: {dst: round(p, 12) for dst, p in row.items()}
            for src, row in plan.shift_map.as_dict().items()
        },
        "objective": round(allocation.objective, 6),
        "switch_cost": round(allocation.switch_cost, 6),
        "served_qpm": round(allocation.served_qpm, 6),
        "shortfall_qpm": round(allocation.shortfall_qpm, 6),
        "saturated": allocation.saturated,
        "moved_workers": allocation.moved_workers,
        "solve_ms": round(allocation.solve_ms, 3),
        "assignment": dict(sorted(allocation.assignment.items())),
        "profiles": profiles.source,
    }


def explain(
    plan: Plan, profiles: ProfileSet, workers: ClusterView, queue: QueueModel | None
) -> dict[str, str]:
    """One sentence per level with workers: which classes it serves, its planned load, and
    the utilisation and expected wait the queue model allows there."""
    allocation = plan.allocation
    levels = allocation.levels
    by_id = {w.worker_id: w for w in workers.workers}
    why: dict[str, str] = {}
    for v, name in enumerate(levels):
        count = allocation.workers_per_level[v]
        if count == 0:
            continue
        load = allocation.load_share_qpm[v]
        if load <= 0.0:
            why[name] = f"{count} spare worker(s) with no planned load: headroom at this level"
            continue
        total = max(sum(plan.histogram), 1e-12)
        shares = [
            plan.histogram[c] * plan.shift_map.matrix[c][v] / total for c in range(len(levels))
        ]
        served = [
            f"{share:.0%} of all prompts from class {c}"
            for c, share in enumerate(shares)
            if share > 0.005
        ]
        sentence = f"{load:.1f} QPM on {count} worker(s): {', '.join(served) or 'no class'}"
        if queue is not None:
            ids = [w for w, level in allocation.assignment.items() if level == name]
            worker_class = by_id[ids[0]].worker_class if ids and ids[0] in by_id else ""
            service = profiles.profile(worker_class, name).latency_s
            peak = sum(
                profiles.profile(by_id[w].worker_class, name).throughput_qpm
                for w in ids
                if w in by_id
            )
            busy = load / peak if peak else 0.0
            cap = queue.max_utilisation(service, count)
            wait = queue.expected_wait_s(service, count, busy)
            sentence += (
                f"; {busy:.0%} busy (cap {cap:.0%}), expected wait {wait:.2f} s within the "
                f"{queue.slo_s - service:.2f} s the SLO leaves after {service:.2f} s of service"
            )
        why[name] = sentence
    return why
