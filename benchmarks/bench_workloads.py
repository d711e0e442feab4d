"""Time the workload generators of ``argus replay``.

Run from the repository root: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_workloads.py``.
Prints the median wall time of generating the 800-minute stress ramp (50 → 600 QPM, about
260,000 arrivals), 480,000 Poisson arrivals (600 QPM for 800 minutes), the same count from the
Gamma renewal process, the default bursty hour and the Azure trace rescaled, with the machine
it ran on. The prompt list is loaded once before timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

from _machine import load_line, machine_line

from argus.sim.arrivals import azure_trace, bursty, gamma_arrivals, poisson, ramp
from argus.sim.named_workloads import workload_by_name
from argus.sim.workloads import Workload

CASES: list[tuple[str, Callable[[int], Workload]]] = [
    ("ramp 50->600 QPM, 800 min", lambda seed: ramp(50.0, 600.0, 800.0, seed)),
    ("poisson 600 QPM, 800 min", lambda seed: poisson(600.0, 800.0, seed)),
    ("gamma 600 QPM cv 2, 800 min", lambda seed: gamma_arrivals(600.0, 2.0, 800.0, seed)),
    ("bursty default, 60 min", lambda seed: bursty(seed=seed)),
    ("azure rate x0.5", lambda seed: azure_trace(rate_scale=0.5, seed=seed)),
    (
        "azure played over 800 min",
        lambda seed: workload_by_name("azure", duration_min=800.0, seed=seed),
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()} {platform.processor() or platform.system()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    poisson(1.0, 1.0, 0)  # load PartiPrompts and the Azure trace outside the timings
    azure_trace()
    print(f"{'workload':<30} {'arrivals':>10} {'median ms':>10} {'max ms':>8}")
    for label, make in CASES:
        times = []
        count = 0
        for seed in range(args.repeats):
            started = time.perf_counter()
            count = len(make(seed))
            times.append((time.perf_counter() - started) * 1000.0)
        print(f"{label:<30} {count:>10,} {statistics.median(times):>10.1f} {max(times):>8.1f}")


if __name__ == "__main__":
    print(machine_line())
    main()
    print(load_line("end"))
