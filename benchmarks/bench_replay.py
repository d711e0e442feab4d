"""Replay speed: the whole ``argus replay`` as a user runs it, and the simulator alone.

1. **The command.** ``argus replay --trace azure`` (the real Azure trace, 19,366 requests,
   seven policies, the trained classifier, Katz adapters, reports written) run as a
   subprocess, timed from start to exit: once with an empty embedding cache (MiniLM embeds
   every unique prompt once) and once with the cache it left (what every later replay pays).
   The issue's bar is the seven-policy Azure replay in under 60 s on 2 cores.
2. **The simulator** (``--minutes``, ``--qpm``): requests per second through
   :class:`argus.sim.cluster.Simulation` per policy, on SYNTHETIC Poisson arrivals with the
   oracle classifier, admission on (``--no-admission`` queues every request).

    PYTHONPATH=. python benchmarks/bench_replay.py [--trace azure] [--minutes 60] [--qpm 600]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import machine_line

from argus.classifier.embedding_cache import CACHE_ENV
from argus.profiles import default_profiles
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.policies import POLICIES, make_policy
from argus.sim.quality import synthetic_quality_table
from argus.sim.workloads import poisson
from argus.types import Strategy


def time_command(trace: str, cache: Path, out: Path) -> float:
    """Seconds ``argus replay --trace TRACE`` takes, start to exit, with ``cache`` as the
    embedding cache."""
    env = {**os.environ, CACHE_ENV: str(cache)}
    command = [sys.executable, "-m", "argus", "replay", "--trace", trace]
    started = time.perf_counter()
    subprocess.run(
        [*command, "--quiet", "--out", str(out)], env=env, check=True, stdout=subprocess.DEVNULL
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="azure", help="trace of the timed argus replay")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--qpm", type=float, default=600.0)
    parser.add_argument("--no-admission", action="store_true", help="queue every request")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        cold = time_command(args.trace, root / "cache", root / "cold")
        warm = time_command(args.trace, root / "cache", root / "warm")
    print(f"argus replay --trace {args.trace}, 7 policies: {cold:.1f} s with an empty embedding")
    print(f"cache, {warm:.1f} s with the cache it left (wall clock, process start to exit)")

    profiles = default_profiles()
    workload = poisson(mean_qpm=args.qpm, duration_min=args.minutes, seed=0)
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    sim = Simulation(profiles, quality, workload, SimConfig(admission=not args.no_admission))
    print(
        f"simulator: SYNTHETIC Poisson {args.qpm:g} QPM x {args.minutes:g} min = "
        f"{len(workload):,} requests, oracle classifier"
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
