"""Solve time of the joint program (argus/allocator/joint.py) as the planner calls it.

Instances: the SYNTHETIC 12-level AC profile of ``bench_solver.py``, 1 or 4 worker classes,
8 / 64 / 512 / 4,096 live workers, loads drawn uniformly between 30% and 120% of the cluster's
capacity, a class histogram drawn from a flat Dirichlet per instance, and a SYNTHETIC
Q(v | c) in which class c keeps full quality up to level c and loses 6% per level beyond it.
Everything the product plans with is on: switching cost weight 1 with workers already
holding the model, utilisation caps from the queue model (SLO 12.6 s) for the pools of the
previous plan and the second start that prices every level as if it had every worker, each
solved again when the pools it picks change (up to four solves, all on one warm
``JointSolver``), the planner's own default ``HighsOptions``. A solve is the LP relaxation,
its rounding, repair and local search, and branch and bound only when those are more than
``HighsOptions.shortcut_gap`` (5%) below the bound (small clusters, now and then). Each
figure is over ``--repeats`` plans after ``--warmup`` plans that are not counted (the first
plans pay imports and caches); percentiles are ``numpy.percentile`` of those samples, wall
and CPU time (the process's) of the same plans. The machine's load average is printed at
the start and the end: on a shared machine the wall times are those of a busy one.

    python benchmarks/bench_joint.py [--repeats 200] [--warmup 20] [--workers 8,64,512,4096]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np
from _machine import load_line, machine_line
from bench_solver import cluster, synthetic_profiles

from argus.allocator import highs_session
from argus.allocator.planner import PlannerConfig, make_plan
from argus.allocator.queueing import QueueModel
from argus.types import ClassQuality, ClusterView, LoadForecast, Plan, Strategy, WorkerState


def class_quality(levels: tuple[str, ...]) -> ClassQuality:
    n = len(levels)
    rows = tuple(
        tuple(1.0 if v <= c else max(0.5, 1.0 - 0.06 * (v - c)) for v in range(n)) for c in range(n)
    )
    return ClassQuality(Strategy.AC, levels, rows, tuple(1.0 / n for _ in levels), "SYNTHETIC")


def holding(view: ClusterView, level: str) -> ClusterView:
    return ClusterView(
        tuple(WorkerState(w.worker_id, w.worker_class, True, level) for w in view.workers)
    )


class _Counter:
    """Counts the solves and the branch-and-bound runs of the plans being timed."""

    def __init__(self) -> None:
        self.solves = self.branched = 0
        solve, branch = (
            highs_session.HighsSession.relaxation,
            highs_session.HighsSession.branch_and_bound,
        )

        def counted_solve(highs: highs_session.HighsSession) -> Any:
            self.solves += 1
            return solve(highs)

        def counted_branch(highs: highs_session.HighsSession, *args: Any) -> Any:
            self.branched += 1
            return branch(highs, *args)

        highs_session.HighsSession.relaxation = counted_solve  # type: ignore[method-assign,assignment]
        highs_session.HighsSession.branch_and_bound = counted_branch  # type: ignore[method-assign,assignment]

    def reset(self) -> None:
        self.solves = self.branched = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--workers",
        default="8,64,512,4096",
        help="comma-separated cluster sizes (live workers) to time",
    )
    args = parser.parse_args()
    print(machine_line())
    print("SYNTHETIC 12-level profile and Q(v | c); times per plan in ms (four solves at most)")
    print(
        f"{'workers':>7} {'classes':>7} | {'wall p50':>8} {'wall p99':>8} | "
        f"{'cpu p50':>8} {'cpu p99':>8} | {'n':>4} | branch and bound"
    )
    rng = random.Random(2026)
    draws = np.random.default_rng(2026)
    config = PlannerConfig(queue=QueueModel(12.6))
    counter = _Counter()
    for workers in (int(n) for n in args.workers.split(",")):
        for class_count in (1, 4):
            profiles = synthetic_profiles(class_count)
            levels = profiles.levels_for(Strategy.AC)
            quality = class_quality(tuple(level.name for level in levels))
            view = holding(cluster(workers, class_count), levels[0].name)
            fastest = levels[-1].name
            cap = sum(
                profiles.profile(w.worker_class, fastest).throughput_qpm for w in view.workers
            )
            previous: Plan | None = None
            wall: list[float] = []
            cpu: list[float] = []
            solves, branched = [0], [0]
            for i in range(args.warmup + args.repeats):
                load = rng.uniform(0.3, 1.2) * cap
                histogram = tuple(draws.dirichlet(np.ones(len(levels))))
                forecast = LoadForecast(load, load, load, float(i))
                counter.reset()
                started, started_cpu = time.perf_counter(), time.process_time()
                previous = make_plan(
                    profiles,
                    Strategy.AC,
                    view,
                    forecast,
                    histogram,
                    config=config,
                    previous=previous,
                    class_quality=quality,
                )
                if i >= args.warmup:
                    solves[0] += counter.solves
                    branched[0] += counter.branched
                    wall.append((time.perf_counter() - started) * 1000.0)
                    cpu.append((time.process_time() - started_cpu) * 1000.0)
            w50, w99 = np.percentile(wall, [50, 99])
            c50, c99 = np.percentile(cpu, [50, 99])
            print(
                f"{workers:>7} {class_count:>7} | {w50:>8.2f} {w99:>8.2f} | {c50:>8.2f} "
                f"{c99:>8.2f} | {len(wall):>4} | {branched[0]} of {solves[0]} solves",
                flush=True,
            )
    print(load_line("end"))


if __name__ == "__main__":
    main()
