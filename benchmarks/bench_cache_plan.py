"""Is Algorithm 1 (InstGenIE §4.2, :func:`argus.worker.editing.activation_store.plan_cache_use`)
optimal? Brute force over all 2^N load/recompute plans in the same two-stream model.

For each setting, ``--cases`` random instances with N blocks: ``compute_without`` uniform in
[0.5, 1.5] (seconds, any unit), ``compute_with = m * compute_without`` with m uniform in
[0.05, 1.0] per block (mask ratios), ``load`` uniform in [0, load_scale] per block. For each,
Algorithm 1's latency against the best of all 2^N plans (:func:`pipeline_latency`). Prints, per
load scale and N: the share of cases where Algorithm 1 loses, and the mean and largest ratio
(Algorithm 1 / optimum) among them.

    .venv/bin/python benchmarks/bench_cache_plan.py [--cases 2000] [--seed 7]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.worker.editing.activation_store import pipeline_latency, plan_cache_use

LOAD_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 100.0)
BLOCKS = (2, 4, 6, 8, 10)


def best_latency(without: list[float], with_: list[float], load: list[float]) -> float:
    """The optimum over every plan, by enumeration."""
    return min(
        pipeline_latency(use, without, with_, load)
        for use in itertools.product((False, True), repeat=len(without))
    )


def one_setting(rng: random.Random, n: int, load_scale: float, cases: int) -> str:
    ratios: list[float] = []
    for _ in range(cases):
        without = [rng.uniform(0.5, 1.5) for _ in range(n)]
        with_ = [c * rng.uniform(0.05, 1.0) for c in without]
        load = [rng.uniform(0.0, load_scale) for _ in range(n)]
        greedy = plan_cache_use(without, with_, load).latency_s
        ratios.append(greedy / best_latency(without, with_, load))
    losing = [r for r in ratios if r > 1 + 1e-9]
    share = len(losing) / cases
    mean = sum(losing) / len(losing) if losing else 1.0
    worst = max(losing, default=1.0)
    return (
        f"load<= {load_scale:6.2f}  N={n:2d}  loses in {share:6.1%}"
        f"  mean ratio when losing {mean:.3f}  worst {worst:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print(machine_line())
    rng = random.Random(args.seed)
    for load_scale in LOAD_SCALES:
        for n in BLOCKS:
            print(one_setting(rng, n, load_scale, args.cases), flush=True)
    print(load_line("end"))


if __name__ == "__main__":
    main()
