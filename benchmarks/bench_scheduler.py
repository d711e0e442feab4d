"""Scheduling decisions per second in process: PASM sampling + worker selection (Eq. 3).

A plan is made with the default profiles (AC, 6 levels) for a cluster of N A100 workers at 70%
of its capacity and a skewed affinity histogram; then classified levels are routed one by one
with the router's queue-length map changing as requests are placed and finished.

    python benchmarks/bench_scheduler.py [--decisions 200000]
"""

from __future__ import annotations

import argparse
import random
import time

from _machine import load_line, machine_line

from argus.allocator.planner import make_plan
from argus.profiles import default_profiles
from argus.router.scheduler import PromptScheduler
from argus.types import ClusterView, LoadForecast, Strategy


def run(workers: int, decisions: int) -> tuple[float, float]:
    profiles = default_profiles()
    view = ClusterView.uniform(workers)
    load = 0.7 * workers * profiles.profile("a100", "ac-k25").throughput_qpm
    plan = make_plan(
        profiles, Strategy.AC, view, LoadForecast(load, load, load, 0.0), (30, 25, 20, 10, 10, 5)
    )
    classes = {w.worker_id: w.worker_class for w in view.workers}
    scheduler = PromptScheduler.from_plan(plan, profiles, classes, random.Random(1))
    rng = random.Random(2)
    levels = rng.choices(range(6), weights=(30, 25, 20, 10, 10, 5), k=decisions)
    queues = dict.fromkeys(classes, 0)
    started = time.perf_counter()
    for i, level in enumerate(levels):
        decision = scheduler.route(level, queues)
        queues[decision.worker_id] += 1
        if i % 4 == 0:  # requests finish too, so queues stay short
            busiest = decision.worker_id
            queues[busiest] = max(0, queues[busiest] - 2)
    elapsed = time.perf_counter() - started
    return decisions / elapsed, elapsed / decisions * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200_000)
    args = parser.parse_args()
    print(machine_line())
    print(f"{'workers':>8} {'decisions/s':>12} {'us/decision':>12}")
    for workers in (8, 64, 512):
        rate, micros = run(workers, args.decisions)
        print(f"{workers:>8} {rate:>12,.0f} {micros:>12.2f}")


if __name__ == "__main__":
    main()
    print(load_line("end"))
