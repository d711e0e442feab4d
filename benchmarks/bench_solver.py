"""Solve time of the allocator ILP (Eq. 1, ``argus plan --planner paper``): the per-class
formulation Argus runs vs the paper's per-worker reference.

Instances: 12 levels, 1 or 4 worker classes, 8 / 64 / 512 / 4096 live workers, loads drawn
uniformly between 30% and 120% of the cluster's capacity (so some instances are overloaded).
The 12-level profile is SYNTHETIC: AC on SDXL with K = 0, 4, ..., 44 of N = 50 steps and the
Argus paper's 4.2 s A100 latency scaled by (N-K)/N; the extra classes are A100 speeds scaled
by 2.0, 0.7 and 0.4 (synthetic). As the product plans: switching cost on at the allocator's
default weight (1.0), every worker holding the model already, the default backend
(``highs_solver()``: 0.1% gap). The planner's joint program (the default planner) has its
own benchmark, ``bench_joint.py``.

Each row: ``--warmup`` solves not counted, then ``--repeats`` timed ones (default 200);
p50/p99 are ``numpy.percentile`` of those samples, wall and CPU time of the same solves. The
per-worker reference runs on up to ``--reference-up-to`` workers (default 64: its binary
program has workers × levels columns and takes minutes beyond), on the first
``--reference-repeats`` loads, and the gap column compares objectives on those.

    python benchmarks/bench_solver.py [--repeats 200] [--warmup 10] [--reference-up-to 64]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _machine import load_line, machine_line

from argus.allocator.paper_eq1 import highs_solver, solve, solve_per_worker
from argus.profiles import parse_profiles
from argus.types import Allocation, ClusterView, ProfileSet, Strategy, WorkerState

CLASS_SPEED = {"a100": 1.0, "h100": 2.0, "l40": 0.7, "a10": 0.4}  # synthetic speed factors


def synthetic_profiles(class_count: int) -> ProfileSet:
    classes = list(CLASS_SPEED)[:class_count]
    levels: list[dict[str, Any]] = []
    for v in range(12):
        k = 4 * v
        latency = 4.2 * (50 - k) / 50 + (0.05 if k else 0.0)
        levels.append(
            {
                "name": f"ac-k{k}",
                "strategy": "AC",
                "model": "sdxl",
                "skip_steps": k,
                "quality": 1.0 - 0.008 * v,
                "profiles": {
                    c: {
                        "latency_s": latency / CLASS_SPEED[c],
                        "load_time_s": 9.42,
                        "gpu_memory_gib": 5.14,
                    }
                    for c in classes
                },
            }
        )
    return parse_profiles({"worker_classes": classes, "levels": levels}, source="synthetic-12")


def cluster(workers: int, class_count: int) -> ClusterView:
    classes = list(CLASS_SPEED)[:class_count]
    counts = {c: workers // class_count for c in classes}
    counts[classes[0]] += workers - sum(counts.values())
    return ClusterView.by_class(counts)


def holding(view: ClusterView, level: str) -> ClusterView:
    """The cluster with every worker serving ``level`` (so switching cost applies)."""
    return ClusterView(
        tuple(WorkerState(w.worker_id, w.worker_class, True, level) for w in view.workers)
    )


def capacity(profiles: ProfileSet, view: ClusterView) -> float:
    fastest = profiles.levels_for(Strategy.AC)[-1].name
    return sum(profiles.profile(w.worker_class, fastest).throughput_qpm for w in view.workers)


SWITCH_COST_WEIGHT = 1.0  # the allocator's default (ControlConfig.switch_cost_weight)


def measure(
    fn: Callable[..., Allocation],
    profiles: ProfileSet,
    view: ClusterView,
    loads: list[float],
    backend: Callable[[], Any],
) -> tuple[list[float], list[float], list[float]]:
    """Wall ms, CPU ms and objective of one solve per load."""
    wall, cpu, objectives = [], [], []
    for load in loads:
        started, started_cpu = time.perf_counter(), time.process_time()
        allocation = fn(
            profiles,
            Strategy.AC,
            view,
            load,
            switch_cost_weight=SWITCH_COST_WEIGHT,
            backend=backend,
        )
        wall.append((time.perf_counter() - started) * 1000.0)
        cpu.append((time.process_time() - started_cpu) * 1000.0)
        objectives.append(allocation.objective)
    return wall, cpu, objectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reference-up-to", type=int, default=64, help="workers")
    parser.add_argument("--reference-repeats", type=int, default=20)
    parser.add_argument("--per-worker-limit", type=float, default=60.0, help="seconds per solve")
    args = parser.parse_args()
    print(machine_line())
    print("profile: SYNTHETIC 12-level AC profile (see module docstring); times per solve in ms")
    print(
        f"{'workers':>7} {'classes':>7} | {'wall p50':>8} {'wall p99':>8} {'cpu p50':>8} "
        f"{'cpu p99':>8} {'n':>4} | {'per-worker p50':>14} {'p99':>8} {'n':>3} | objective gap"
    )
    rng = random.Random(2026)
    for workers in (8, 64, 512, 4096):
        for class_count in (1, 4):
            profiles = synthetic_profiles(class_count)
            best = profiles.levels_for(Strategy.AC)[0].name
            view = holding(cluster(workers, class_count), best)
            cap = capacity(profiles, view)
            loads = [rng.uniform(0.3, 1.2) * cap for _ in range(args.warmup + args.repeats)]
            measure(solve, profiles, view, loads[: args.warmup], highs_solver())
            wall, cpu, fast_obj = measure(
                solve, profiles, view, loads[args.warmup :], highs_solver()
            )
            w50, w99 = np.percentile(wall, [50, 99])
            c50, c99 = np.percentile(cpu, [50, 99])
            row = (
                f"{workers:>7} {class_count:>7} | {w50:>8.2f} {w99:>8.2f} {c50:>8.2f} "
                f"{c99:>8.2f} {len(wall):>4} | "
            )
            if workers > args.reference_up_to:
                print(row + f"{'not run':>14} {'':>8} {'':>3} |", flush=True)
                continue
            reference = loads[args.warmup : args.warmup + args.reference_repeats]
            ref_wall, _, ref_obj = measure(
                solve_per_worker,
                profiles,
                view,
                reference,
                highs_solver(args.per_worker_limit),
            )
            gap = max(
                abs(a - b) / max(1.0, abs(b)) for a, b in zip(fast_obj, ref_obj, strict=False)
            )
            timed_out = max(ref_wall) >= args.per_worker_limit * 1000 * 0.95
            r50, r99 = np.percentile(ref_wall, [50, 99])
            print(
                row
                + f"{r50:>14.1f} {r99:>8.1f} {len(ref_wall):>3} | {gap:.1e}"
                + ("  (per-worker hit its time limit)" if timed_out else ""),
                flush=True,
            )
    print(load_line("end"))


if __name__ == "__main__":
    main()
