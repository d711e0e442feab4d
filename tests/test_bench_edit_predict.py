"""``benchmarks/bench_edit_serving.py --predict``: the benchmark's own workload through the
batching policy, each step priced by a cost model instead of run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from argus.profiles.edit_cost import EditCostModel
from argus.request_limits import EditInput
from argus.worker.editing.step_batch import StepStats
from argus.worker.models.pipelines import GenerationSpec
from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.unit

# a step costs 1 s alone and 0.1 s more per edit beside it; a full edit 0.5 s more than a replay
MODEL = EditCostModel(base_s=0.9, per_edit_s=0.1, per_mask_s=0.5)


@pytest.fixture
def bench() -> Iterator[Any]:
    with benchmark_module("bench_edit_serving") as module:
        yield module


def inpaint(bench: Any, at_s: float, template: np.ndarray, steps: int = 4) -> Any:
    edit = EditInput(template, bench.region_rect(16, 0.25), 1.0)
    spec = GenerationSpec("edit", height=16, width=16, steps=steps, edit=edit)
    return bench.Arrival(at_s, spec)


def test_static_waits_for_the_batch_continuous_joins_at_the_next_step(bench: Any) -> None:
    template = np.zeros((16, 16, 3), dtype=np.uint8)
    arrivals = [inpaint(bench, 0.0, template), inpaint(bench, 0.5, template, steps=2)]
    full = MODEL.step_s(1, 1.0)  # the first edit of a template runs in full: a miss
    static, _ = bench.predict(arrivals, MODEL.step_s, 4, static=True)
    assert static[1].started_s == pytest.approx(4 * full)  # after the whole first batch
    # it replays the record the first edit left
    assert static[1].done_s == pytest.approx(4 * full + 2 * MODEL.step_s(1, 0.25))
    continuous, stats = bench.predict(arrivals, MODEL.step_s, 4, static=False)
    assert continuous[1].started_s == pytest.approx(full)  # at the first step's end
    # the template is not recorded yet when it joins: a full run too, two steps beside the first
    assert continuous[1].done_s == pytest.approx(full + 2 * MODEL.step_s(2, 2.0))
    assert continuous[0].done_s == pytest.approx(2 * full + 2 * MODEL.step_s(2, 2.0))
    assert (stats.steps, stats.rows) == (4, 6)


def test_img2img_runs_its_strengths_steps_in_full(bench: Any) -> None:
    template = np.zeros((16, 16, 3), dtype=np.uint8)
    edit = EditInput(template, None, 0.5)
    spec = GenerationSpec("img2img", height=16, width=16, steps=4, edit=edit)
    arrivals = [inpaint(bench, 0.0, template), bench.Arrival(10.0, spec)]
    outcomes, _ = bench.predict(arrivals, MODEL.step_s, 4, static=False)
    # strength 0.5 of 4 steps: 2 steps, each full although the template is recorded
    assert outcomes[1].done_s - outcomes[1].started_s == pytest.approx(2 * MODEL.step_s(1, 1.0))


def test_the_unet_time_by_batch_size_is_a_mean_per_size(bench: Any) -> None:
    stats = StepStats(steps=3, steps_by_batch={3: 1, 1: 2}, unet_s_by_batch={1: 3.0, 3: 2.5})
    line = bench.unet_by_batch("static", stats)
    assert line == "static: UNet a step by batch (steps) 1: 1.500 s (2), 3: 2.500 s (1)"
    assert bench.unet_by_batch("one-at-a-time", None) is None
