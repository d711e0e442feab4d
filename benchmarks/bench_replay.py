"""Replay speed: the simulator as ``argus replay`` runs it, at a load a deployment would see.

The workload is the real Azure trace's shape (``--trace azure``), stretched in time to
``--requests`` arrivals and mapped minute by minute to ``--load`` × the cluster's capacity
(as ``argus evaluate --target-load`` does: :func:`argus.sim.offered_load.rescale_to_load`; the
capacity is every GPU at the fastest AC level, adapters' mean seconds included). Everything
else is ``argus replay``'s defaults: 8 A100s, the trained classifier
(``classifiers/minilm-logistic``), Katz's adapter mix served as Argus serves it, admission
on, the seven default policies. The quality tables are SYNTHETIC (as in every replay).

``--jobs N`` replays N policies at once, each in a process forked after the setup (the
planned ones first); the policies' wall time is then the span from the first start to the
last end, their CPU time the sum over the processes.

Printed: the setup (trace, quality tables, classifier loading and embedding, each apart),
then wall and CPU seconds per policy and in total, requests per second, and the load
average at start and end (the machine is shared: wall time above CPU time is time other
processes had the CPUs).

A planned policy (argus, pac, proteus) runs the allocator's control loop every simulated
second: its cost grows with the simulated time (``--requests`` / rate), the baselines' with
the requests alone.

``--scale S`` instead replays the trace at S × its recorded rate over its own hour with no
load mapping (``argus replay --trace azure --scale S``; S = 25 gives about 484,000 requests
at 53 × capacity, nearly all refused: a stress test of the per-request path, not a load a
cluster runs at).

    PYTHONPATH=. python benchmarks/bench_replay.py [--requests 100000] [--load 0.65]
    PYTHONPATH=. python benchmarks/bench_replay.py --scale 25
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from _machine import load_line, machine_line

from argus.cli.replay import DEFAULT_POLICIES
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.adapters import adapter_model_by_name
from argus.sim.classifiers import make_classifier
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.named_workloads import workload_by_name
from argus.sim.offered_load import cluster_capacity_qpm, planning_profiles, rescale_to_load
from argus.sim.policies import PLANNED, make_policy
from argus.sim.workloads import Workload
from argus.types import Strategy

T = TypeVar("T")


def timed(label: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, print its wall and CPU seconds under ``label``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    print(
        f"  {label:<44} {time.perf_counter() - wall:7.1f} s wall "
        f"{time.process_time() - cpu:7.1f} s CPU",
        flush=True,
    )
    return result


def workload_at_load(requests: int, load: float, capacity_qpm: float, seed: int) -> Workload:
    """The Azure trace stretched to about ``requests`` arrivals at ``load`` × capacity."""
    target = load * capacity_qpm
    minutes = requests / target
    stretched = workload_by_name("azure", duration_min=minutes, seed=seed)
    return rescale_to_load(stretched, target, seed=seed)


# what a forked worker process replays: set in the parent before the fork, inherited
_JOBS: tuple[Simulation, list[Any]] | None = None


def run_one(index: int) -> tuple[int, float, float, float]:
    """Replay policy ``index`` of ``_JOBS``: (index, wall s, CPU s, share refused)."""
    assert _JOBS is not None
    sim, policies = _JOBS
    wall, cpu = time.perf_counter(), time.process_time()
    result: Any = sim.run(policies[index])  # a planned run also embeds the prompts
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return index, wall, cpu, float(result.refused.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=0.65, help="mean load / capacity")
    parser.add_argument("--scale", type=float, help="the recorded hour at this rate scale")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--classifier", default="default")
    parser.add_argument("--adapters", default="katz")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="policies replayed at once, each in a forked process (1: one after another)",
    )
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs: must be >= 1, got {args.jobs}")
    print(machine_line())
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    profiles = default_profiles()
    counts = {profiles.worker_classes[0]: args.gpus}
    capacity = cluster_capacity_qpm(planning_profiles(profiles, args.adapters), counts.items())
    print("setup:")
    if args.scale is not None:
        workload = timed(
            f"azure trace x{args.scale:g}",
            lambda: workload_by_name("azure", scale=args.scale, seed=args.seed),
        )
    else:
        workload = timed(
            f"azure trace at {args.load:g} x capacity",
            lambda: workload_at_load(args.requests, args.load, capacity, args.seed),
        )
    minutes = workload.duration_s / 60.0
    print(
        f"workload: {len(workload):,} requests over {minutes:,.0f} simulated minutes, "
        f"{workload.mean_qpm():.1f} QPM = {workload.mean_qpm() / capacity:.2f} x the capacity "
        f"of {args.gpus} GPUs ({capacity:.1f} QPM at the fastest AC level, adapters: "
        f"{args.adapters})"
    )
    quality = timed(
        "quality tables (SYNTHETIC)",
        lambda: {
            s: synthetic_quality_table(
                workload.prompts, s, [lv.name for lv in profiles.levels_for(s)], seed=args.seed
            )
            for s in Strategy
        },
    )
    classifier = make_classifier(args.classifier)
    prepare = getattr(classifier, "prepare", None)
    if prepare is not None:
        timed(f"classifier {args.classifier}: load", lambda: prepare(quality))
    config = SimConfig.with_classes(
        counts, seed=args.seed, adapters=adapter_model_by_name(args.adapters)
    )
    sim = timed(
        "simulation (adapters drawn)", lambda: Simulation(profiles, quality, workload, config)
    )
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    policies = [make_policy(n, classifier=classifier, seed=args.seed) for n in names]
    print(f"classifier (argus, nirvana): {classifier.label}")
    print(f"{'policy':<11} {'wall s':>8} {'CPU s':>8} {'requests/s':>11} {'refused':>8}")
    global _JOBS
    _JOBS = (sim, policies)
    total_wall = total_cpu = 0.0
    started = time.perf_counter()
    runs: Iterator[tuple[int, float, float, float]]
    if args.jobs == 1:
        runs = map(run_one, range(len(policies)))
    else:  # planned policies first: the longest runs start at once
        order = sorted(range(len(policies)), key=lambda i: names[i] not in PLANNED)
        pool = multiprocessing.get_context("fork").Pool(args.jobs)
        runs = pool.imap_unordered(run_one, order)
    for index, wall, cpu, refused in runs:
        total_wall += wall
        total_cpu += cpu
        print(
            f"{policies[index].name:<11} {wall:8.1f} {cpu:8.1f} {len(workload) / wall:>11,.0f} "
            f"{refused:8.1%}",
            flush=True,
        )
    if args.jobs > 1:
        pool.close()
        pool.join()
        total_wall = time.perf_counter() - started  # the policies overlapped
    children_cpu = total_cpu if args.jobs > 1 else 0.0  # not in this process's CPU time
    print(f"{'policies':<11} {total_wall:8.1f} {total_cpu:8.1f}")
    print(
        f"{'all':<11} {time.perf_counter() - started_wall:8.1f} "
        f"{time.process_time() - started_cpu + children_cpu:8.1f}  (setup included)"
    )
    print(load_line("end"))


if __name__ == "__main__":
    main()
