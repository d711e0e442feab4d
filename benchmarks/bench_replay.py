"""Replay speed: requests per second through the simulator, per policy.

Default: 800 minutes of Poisson arrivals at 600 QPM (about 480,000 requests, SYNTHETIC) on
8 simulated A100 GPUs, every policy, synthetic quality model, the router's admission on (a
refused request costs the simulator less than a served one; ``--no-admission`` queues them
all). The issue's bar is all seven policies in under 2 minutes on a 2-core machine.

    PYTHONPATH=. python benchmarks/bench_replay.py [--minutes 800] [--qpm 600] [--no-admission]
"""

from __future__ import annotations

import argparse
import time

from _machine import machine_line

from argus.profiles import default_profiles
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.policies import POLICIES, make_policy
from argus.sim.quality import synthetic_quality_table
from argus.sim.workloads import poisson
from argus.types import Strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=800.0)
    parser.add_argument("--qpm", type=float, default=600.0)
    parser.add_argument("--no-admission", action="store_true", help="queue every request")
    args = parser.parse_args()
    print(machine_line())
    profiles = default_profiles()
    workload = poisson(mean_qpm=args.qpm, duration_min=args.minutes, seed=0)
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    sim = Simulation(profiles, quality, workload, SimConfig(admission=not args.no_admission))
    print(
        f"workload: SYNTHETIC Poisson {args.qpm:g} QPM x {args.minutes:g} min = {len(workload):,}"
    )
    total = 0.0
    for name in POLICIES:
        started = time.perf_counter()
        result = sim.run(make_policy(name))
        elapsed = time.perf_counter() - started
        total += elapsed
        print(
            f"{name:<11} {elapsed:7.1f} s  {len(workload) / elapsed:>10,.0f} requests/s  "
            f"{result.refused.mean():6.1%} refused",
            flush=True,
        )
    print(f"{'all':<11} {total:7.1f} s")


if __name__ == "__main__":
    main()
