"""The planner's utilisation caps per pool size and level: measured (the simulated queue with
the simulator's service-time spread) against analytic (Allen–Cunneen over Erlang C), and the
share of requests late at each cap, simulated again with other draws.

For each level of the default profile on one worker class, with Katz's adapter mix (the
``katz`` workflow, as ``argus evaluate``) and the simulator's 5% log-normal jitter:

* ``measured``: :func:`argus.allocator.queueing.measured_caps`, the largest utilisation at
  which at most the tolerated share (``QueueModel.late_share``, 2%) of the requests of a FCFS
  c-server queue with Poisson arrivals wait and are served past the SLO (3 × SDXL);
* ``analytic``: :meth:`QueueModel.max_utilisation` with its default service SCV (0.1), the
  caps ``argus evaluate`` plans with by default;
* ``late@m`` and ``late@a``: the late share at each cap in a queue simulated with seed 1
  (other arrivals, other service draws), with the same number of requests.

Then the spread of a measured cap over seeds 0–4 (the simulation's uncertainty) and the time
to build a table of every level × pools 1 … ``--servers``.

    .venv/bin/python benchmarks/queueing_caps.py [--servers 8] [--class a100] [--requests N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.allocator import queueing
from argus.allocator.queueing import QueueModel, late_shares_at, measured_caps
from argus.defaults import SLO_FACTOR
from argus.profiles import default_profiles
from argus.sim.adapters import AdapterModel, draw_adapters, with_adapter_costs
from argus.sim.service_times import SimServiceSpread

CHECK_SEED = 1
SPREAD_SEEDS = range(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=8, help="largest pool (default 8)")
    parser.add_argument("--class", dest="worker_class", default="a100")
    parser.add_argument("--requests", type=int, default=queueing.MEASURED_REQUESTS)
    args = parser.parse_args()
    print(machine_line())

    profiles = default_profiles()
    model = AdapterModel()
    spread = SimServiceSpread.of(profiles, 0.05, model)
    plan = with_adapter_costs(profiles, model, draw_adapters(50_000, np.random.default_rng(0)))
    g = args.worker_class
    slo_s = SLO_FACTOR * profiles.profile(g, profiles.levels[0].name).latency_s
    queue = QueueModel(slo_s)
    levels = [level.name for level in profiles.levels]
    cells = [(g, name) for name in levels]
    pools = list(range(1, args.servers + 1))
    print(
        f"class {g}, SLO {slo_s:g} s, tolerated late share {queue.late_share:.0%}, "
        f"{args.requests:,} requests per queue (a tenth warm-up), adapters: {model.describe()}"
    )

    started = time.perf_counter()
    table = measured_caps(
        spread, cells, args.servers, slo_s, queue.late_share, requests=args.requests
    )
    built_s = time.perf_counter() - started
    analytic = np.array(
        [[queue.max_utilisation(plan.profile(g, n).latency_s, c) for c in pools] for n in levels]
    )
    measured = np.array([table[cell][: args.servers] for cell in cells])
    others = [spread.draws(g, name, args.requests, CHECK_SEED) for name in levels]
    late_m = late_shares_at(others, pools, measured, slo_s, seed=CHECK_SEED)
    late_a = late_shares_at(others, pools, analytic, slo_s, seed=CHECK_SEED)

    for index, name in enumerate(levels):
        draws = others[index].at_no_wait()
        print(
            f"\n{name}: mean service {draws.mean():.2f} s after no wait, SCV "
            f"{draws.var() / draws.mean() ** 2:.3f}, p99 {np.quantile(draws, 0.99):.2f} s"
        )
        print(f"  {'pool':>4} {'measured':>9} {'late@m':>7} {'analytic':>9} {'late@a':>7}")
        for c in pools:
            i = c - 1
            print(
                f"  {c:>4} {measured[index, i]:>9.3f} {late_m[index, i]:>7.2%} "
                f"{analytic[index, i]:>9.3f} {late_a[index, i]:>7.2%}"
            )

    print(f"\ntable of {len(cells)} levels x {args.servers} pools built in {built_s:.1f} s")
    fit = late_m <= queue.late_share + 0.01
    print(
        f"late share at the measured caps (seed {CHECK_SEED}): mean {late_m.mean():.2%}, "
        f"max {late_m.max():.2%}; within the tolerated share + 1 point: {fit.mean():.0%}"
    )
    gap = measured - analytic
    print(
        f"late share at the analytic caps (seed {CHECK_SEED}): mean {late_a.mean():.2%}, "
        f"max {late_a.max():.2%}; measured cap - analytic: mean {np.mean(gap):+.3f}, "
        f"min {np.min(gap):+.3f}, max {np.max(gap):+.3f}"
    )

    subset = [(g, name) for name in ("ac-k0", "ac-k15", "sm-small-sd", "sm-tiny-sd")]
    by_seed = []
    for seed in SPREAD_SEEDS:
        caps = measured_caps(
            spread, subset, args.servers, slo_s, queue.late_share, requests=args.requests, seed=seed
        )
        by_seed.append([caps[cell][: args.servers] for cell in subset])
    spread_sd = np.array(by_seed).std(axis=0, ddof=1)  # (cell, pool)
    below = spread_sd[np.array(by_seed).mean(axis=0) < 0.98]  # caps at the grid's top vary not
    print(
        f"uncertainty of a cap over seeds {SPREAD_SEEDS.start}-{SPREAD_SEEDS.stop - 1} "
        f"({', '.join(n for _, n in subset)}; pools 1-{args.servers}, caps under 0.98): "
        f"sd mean {below.mean():.3f}, max {below.max():.3f}"
    )
    print(load_line("end"))


if __name__ == "__main__":
    main()
