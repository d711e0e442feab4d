"""Time the Optimized Distribution Aligner on random instances.

Run from the repository root: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_oda.py``.
Prints the median and 99th-percentile wall time of one ``align`` call, in microseconds, for
6 and 12 levels, with the machine it ran on.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
from _machine import load_line, machine_line

from argus.allocator.oda import align

INSTANCES = 2000
LEVEL_COUNTS = (6, 12)
SEED = 20250101


def random_vector(rng: np.random.Generator, n: int) -> list[float]:
    """A non-negative vector with about a quarter zeros and a positive total."""
    values = rng.random(n) * 100.0
    values[rng.random(n) < 0.25] = 0.0
    if values.sum() == 0.0:
        values[rng.integers(n)] = 1.0
    return [float(v) for v in values]


def time_align(n: int, rng: np.random.Generator) -> np.ndarray:
    """Wall time of ``align`` in microseconds for ``INSTANCES`` random instances of size n."""
    levels = tuple(f"v{i}" for i in range(n))
    cases = [(random_vector(rng, n), random_vector(rng, n)) for _ in range(INSTANCES)]
    for histogram, load_share in cases[:50]:  # warm-up
        align(histogram, load_share, levels)
    times = np.empty(len(cases))
    for index, (histogram, load_share) in enumerate(cases):
        start = time.perf_counter_ns()
        align(histogram, load_share, levels)
        times[index] = (time.perf_counter_ns() - start) / 1e3
    return times


def main() -> None:
    """Run the benchmark and print labelled figures."""
    rng = np.random.default_rng(SEED)
    processor = platform.processor() or platform.machine() or "unknown"
    print(
        f"ODA align() benchmark: {INSTANCES} random instances per size, "
        f"Python {platform.python_version()}, processor {processor!r}, "
        f"{os.cpu_count()} logical CPUs"
    )
    for n in LEVEL_COUNTS:
        times = time_align(n, rng)
        p50, p99 = np.percentile(times, [50, 99])
        print(f"  {n:2d} levels: p50 {p50:8.1f} us   p99 {p99:8.1f} us   max {times.max():8.1f} us")


if __name__ == "__main__":
    print(machine_line())
    main()
    print(load_line("end"))
