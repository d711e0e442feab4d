"""Solve time of the allocator ILP (Eq. 1): fast per-class formulation vs per-worker reference.

Instances: 12 levels, 1 or 4 worker classes, 8 / 64 / 512 / 4096 live workers, loads drawn
uniformly between 30% and 120% of the cluster's capacity (so some instances are overloaded).
The 12-level profile is SYNTHETIC: AC on SDXL with K = 0, 4, ..., 44 of N = 50 steps and the
Argus paper's 4.2 s A100 latency scaled by (N-K)/N; the extra classes are A100 speeds scaled
by 2.0, 0.7 and 0.4 (synthetic). The per-worker formulation gets fewer repeats at large sizes
and a time limit, reported as such.

    python benchmarks/bench_solver.py [--repeats 50] [--per-worker-limit 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from _machine import machine_line

from argus.allocator.solver import highs_solver, solve, solve_per_worker
from argus.profiles import parse_profiles
from argus.types import Allocation, ClusterView, ProfileSet, Strategy

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


def capacity(profiles: ProfileSet, view: ClusterView) -> float:
    fastest = profiles.levels_for(Strategy.AC)[-1].name
    return sum(profiles.profile(w.worker_class, fastest).throughput_qpm for w in view.workers)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    fn: Callable[..., Allocation],
    profiles: ProfileSet,
    view: ClusterView,
    loads: list[float],
    limit_s: float,
) -> tuple[list[float], list[float]]:
    times, objectives = [], []
    for load in loads:
        started = time.perf_counter()
        allocation = fn(profiles, Strategy.AC, view, load, backend=highs_solver(limit_s))
        times.append((time.perf_counter() - started) * 1000.0)
        objectives.append(allocation.objective)
    return times, objectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--per-worker-limit", type=float, default=60.0, help="seconds per solve")
    args = parser.parse_args()
    print(machine_line())
    print("profile: SYNTHETIC 12-level AC profile (see module docstring); times in ms")
    header = f"{'workers':>7} {'classes':>7} | {'fast p50':>9} {'fast p99':>9} |"
    print(header + f" {'per-worker p50':>14} {'per-worker p99':>14} {'n':>3} | objective gap")
    rng = random.Random(2026)
    for workers in (8, 64, 512, 4096):
        for class_count in (1, 4):
            profiles = synthetic_profiles(class_count)
            view = cluster(workers, class_count)
            cap = capacity(profiles, view)
            loads = [rng.uniform(0.3, 1.2) * cap for _ in range(args.repeats)]
            fast_ms, fast_obj = measure(solve, profiles, view, loads, 60.0)
            reference_n = {8: args.repeats, 64: 10, 512: 2, 4096: 1}[workers]
            ref_ms, ref_obj = measure(
                solve_per_worker, profiles, view, loads[:reference_n], args.per_worker_limit
            )
            gap = max(
                abs(a - b) / max(1.0, abs(b)) for a, b in zip(fast_obj, ref_obj, strict=False)
            )
            timed_out = max(ref_ms) >= args.per_worker_limit * 1000 * 0.95
            print(
                f"{workers:>7} {class_count:>7} | {statistics.median(fast_ms):>9.2f} "
                f"{percentile(fast_ms, 0.99):>9.2f} | {statistics.median(ref_ms):>14.1f} "
                f"{percentile(ref_ms, 0.99):>14.1f} {len(ref_ms):>3} | {gap:.1e}"
                + ("  (per-worker hit its time limit)" if timed_out else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
