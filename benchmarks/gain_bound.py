"""How much any planner can gain from looking at the prompt: the static optimum with and
without prompt classes, on the SYNTHETIC quality model.

For a cluster of ``--gpus`` A100 workers and a steady load L × (the fastest level's capacity),
the best mean quality a plan can reach when it knows the load exactly:

* **per class**: workers per level n[v] and shares of every oracle class (the prompts whose
  δ-optimal level is c, the simulator's oracle) over the levels, maximising mean quality;
* **agnostic**: the same, with one class (every prompt sees the level averages), which is what
  PAC plans.

Each level's capacity is n[v] · P_th[v] · u(n[v]): u is the planner's own queueing cap
(:class:`argus.allocator.queueing.QueueModel`, SLO 3 × SDXL), which grows with the pool, so
splitting the cluster over many levels costs capacity. Two bounds:

1. **exact**: every integer n with Σ n[v] = gpus enumerated, the class shares solved as a
   linear program for each (the optimum of the planner's problem; up to 12 GPUs);
2. **pooled**: n continuous and every level at the cap of a pool of all ``--gpus`` workers, an
   upper bound that ignores the cost of splitting (what a very large cluster approaches).

Prompts: the EVAL split of PartiPrompts, quality tables drawn with seed 1001 (unseen by the
committed classifier). The gain Argus can show over PAC in ``argus evaluate`` at a load is at
most about these figures (the simulation adds forecast error and load swings on top), so a
target above them is out of reach for any classifier and planner on this quality model.

    .venv/bin/python benchmarks/gain_bound.py [--gpus 8] [--loads 0.3,0.5,0.65,0.8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
from scipy.optimize import linprog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.allocator.queueing import QueueModel
from argus.defaults import SLO_FACTOR as DEFAULT_SLO_FACTOR
from argus.profiles import default_profiles
from argus.sim.evaluate import eval_prompts, quality_tables
from argus.types import Strategy

FloatArray = npt.NDArray[np.float64]
GPU = "a100"
MAX_EXACT_GPUS = 12


def best_shares(
    quality: FloatArray, weights: FloatArray, load: float, capacity: FloatArray
) -> float:
    """Max of Σ_c w_c Σ_v y[c, v] Q[c, v] with Σ_v y[c, v] = 1 and Σ_c load·w_c·y[c, v] ≤
    capacity[v]; -inf when the load does not fit."""
    classes, levels = quality.shape
    cost = -(quality * weights[:, None]).ravel()
    rows = np.kron(np.eye(classes), np.ones(levels))
    per_level = np.kron(load * weights[None, :], np.eye(levels))
    result = linprog(
        cost, A_ub=per_level, b_ub=capacity, A_eq=rows, b_eq=np.ones(classes), method="highs"
    )
    return float(-result.fun) if result.status == 0 else float("-inf")


def exact(
    quality: FloatArray,
    weights: FloatArray,
    load: float,
    rate: FloatArray,
    caps: dict[tuple[int, int], float],
    gpus: int,
) -> tuple[float, tuple[int, ...]]:
    """Best quality over every integer split of ``gpus`` workers over the levels."""
    levels = rate.size
    best: tuple[float, tuple[int, ...]] = (float("-inf"), ())
    for combination in itertools.combinations_with_replacement(range(levels), gpus):
        n = np.bincount(combination, minlength=levels)
        capacity = np.array([n[v] * rate[v] * caps[v, int(n[v])] for v in range(levels)])
        if capacity.sum() < load:
            continue
        value = best_shares(quality, weights, load, capacity)
        if value > best[0]:
            best = (value, tuple(int(x) for x in n))
    return best


def pooled(
    quality: FloatArray,
    weights: FloatArray,
    load: float,
    rate: FloatArray,
    cap: FloatArray,
    gpus: int,
) -> float:
    """Continuous workers, every level at the cap of a pool of all ``gpus`` workers."""
    classes, levels = quality.shape
    cost = np.concatenate([-(quality * weights[:, None]).ravel(), np.zeros(levels)])
    rows = np.hstack([np.kron(np.eye(classes), np.ones(levels)), np.zeros((classes, levels))])
    per_level = np.hstack([np.kron(load * weights[None, :], np.eye(levels)), -np.diag(rate * cap)])
    workers = np.concatenate([np.zeros(classes * levels), np.ones(levels)])[None, :]
    result = linprog(
        cost,
        A_ub=np.vstack([per_level, workers]),
        b_ub=np.concatenate([np.zeros(levels), [gpus]]),
        A_eq=rows,
        b_eq=np.ones(classes),
        method="highs",
    )
    return float(-result.fun) if result.status == 0 else float("-inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--loads", default="0.3,0.5,0.65,0.8")
    parser.add_argument("--seed", type=int, default=1001, help="quality table seed")
    args = parser.parse_args()
    if not 1 <= args.gpus <= MAX_EXACT_GPUS:
        parser.error(f"--gpus: 1 to {MAX_EXACT_GPUS} (the exact bound enumerates every split)")
    loads = [float(x) for x in args.loads.split(",")]
    print(machine_line())
    profiles = default_profiles()
    tables = quality_tables(profiles, eval_prompts(None), args.seed)
    print(
        f"quality: SYNTHETIC (argus/profiles/synthetic_quality.py, seed {args.seed}), "
        f"{len(next(iter(tables.values())))} EVAL prompts; {args.gpus} × {GPU}"
    )
    print(
        f"{'strategy':<8} {'load':>5} {'QPM':>6}  {'exact: class':>12} {'agnostic':>9} "
        f"{'gain':>6}  {'split (class)':<20} {'pooled: class':>13} {'agnostic':>9} {'gain':>6}"
    )
    for strategy in (Strategy.AC, Strategy.SM):
        table = tables[strategy]
        names = table.levels
        service = np.array([profiles.profile(GPU, name).latency_s for name in names])
        rate = 60.0 / service
        queue = QueueModel(slo_s=DEFAULT_SLO_FACTOR * float(service[0]))
        caps = {
            (v, n): queue.max_utilisation(float(service[v]), n) if n else 0.0
            for v in range(len(names))
            for n in range(args.gpus + 1)
        }
        full_pool = np.array([caps[v, args.gpus] for v in range(len(names))])
        optimal = table.optimal_levels()
        present = [c for c in range(len(names)) if (optimal == c).any()]
        per_class = np.array([table.scores[optimal == c].mean(axis=0) for c in present])
        weights = np.array([(optimal == c).mean() for c in present])
        average = table.scores.mean(axis=0)[None, :]
        one = np.ones(1)
        capacity = args.gpus * rate[-1]
        for load in loads:
            qpm = load * capacity
            by_class, split = exact(per_class, weights, qpm, rate, caps, args.gpus)
            agnostic, _ = exact(average, one, qpm, rate, caps, args.gpus)
            pooled_class = pooled(per_class, weights, qpm, rate, full_pool, args.gpus)
            pooled_agnostic = pooled(average, one, qpm, rate, full_pool, args.gpus)
            print(
                f"{strategy.value:<8} {load:>5.2f} {qpm:>6.1f}  {by_class:>12.2f} {agnostic:>9.2f} "
                f"{_gain(by_class, agnostic):>6}  {split!s:<20} {pooled_class:>13.2f} "
                f"{pooled_agnostic:>9.2f} {_gain(pooled_class, pooled_agnostic):>6}"
            )
    print("load: × the fastest level's capacity; -inf: the load does not fit under the caps")


def _gain(value: float, base: float) -> str:
    if not (np.isfinite(value) and np.isfinite(base)):
        return "-"
    gain = 100.0 * (value / base - 1.0)
    return f"{0.0 if abs(gain) < 0.05 else gain:+.1f}%"


if __name__ == "__main__":
    main()
    print(load_line("end"))
