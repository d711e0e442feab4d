"""``benchmarks/bench_edit_serving.py --side-by-side``: the engines serve the same arrivals
at the same time, each in a process of its own, and every request is answered by each."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration


def test_engines_side_by_side_serve_the_same_arrivals_over_the_same_seconds() -> None:
    with benchmark_module("bench_edit_serving") as bench:
        args = argparse.Namespace(
            model="tiny", size=64, steps=3, duration=2.0, bound=4, masks="production",
            img2img=0.2, templates=2, threads=1, seed=0, no_edit_cache=False,
        )  # fmt: skip
        with bench.SideBySide(args, ["static", "continuous"]) as engines:
            alone_s = engines.probe()  # timed in both processes at once
            arrivals = bench.make_workload(args, 0.9 / alone_s, np.random.default_rng(0))
            runs = engines.run(arrivals)
    assert alone_s > 0
    assert set(runs) == {"static", "continuous"}
    static, continuous = (runs[name][0] for name in ("static", "continuous"))
    assert len(static) == len(continuous) == len(arrivals) > 2
    # one clock for both: each request arrived at the same instant in both engines
    assert [o.arrival_s for o in static] == [o.arrival_s for o in continuous]
    # and over the same seconds: each answered its first request before the last arrival
    last_arrival = static[-1].arrival_s
    assert min(o.done_s for o in static) < last_arrival
    assert min(o.done_s for o in continuous) < last_arrival
    for _, stats in runs.values():
        assert stats is not None and sum(stats.steps_by_batch.values()) == stats.steps > 0


def test_an_engine_that_fails_to_start_is_named_and_the_others_are_stopped() -> None:
    with benchmark_module("bench_edit_serving") as bench:
        args = argparse.Namespace(
            model="tiny:no-such-variant", size=64, steps=3, duration=2.0, bound=4,
            masks="production", img2img=0.2, templates=2, threads=1, seed=0,
            no_edit_cache=False,
        )  # fmt: skip
        failed = pytest.raises(RuntimeError, match=r"engine (static|continuous): .*no-such-variant")
        with failed, bench.SideBySide(args, ["static", "continuous"]):
            pass
