"""``benchmarks/bench_edit_cost.py --mixed`` (mixed batches against copies of one edit), run
on the tiny SD-1.5 at 64 px for one round: every mix is timed, its replays replay the
templates' records, and its mask sum and table price are the ones the README's table shows."""

from __future__ import annotations

import math

import pytest
import torch

from tests.benchmark_modules import benchmark_module
from tests.worker_factories import tiny_model, torch_threads

pytestmark = pytest.mark.unit


def test_every_mix_is_timed_and_its_replays_replay() -> None:
    with benchmark_module("bench_edit_cost") as bench, torch_threads(1), torch.inference_mode():
        rows, counts = bench.measure_mixed(tiny_model("sd-1.5"), 64, 1, 0)
    assert [row.label for row in rows] == [label for label, _ in bench.MIXES]
    replays = sum(r < 1 for _, ratios in bench.MIXES for r in ratios)
    assert counts == {"hit": replays, "miss": 2, "evicted": 0}  # two templates recorded once
    sums = [round(row.mask_sum, 3) for row in rows]
    assert sums == [0.188, 0.266, 1.094, 2.0, 0.375, 0.422, 2.188, 4.0]
    for row in rows:
        assert len(row.seconds) == 2 and min(row.seconds) > 0
        assert math.isfinite(row.table_s) and row.table_s > 0  # the table has the tiny SD-1.5
