"""The worker's edit lane (argus/worker/editing/lane.py): with ``edit_batch`` > 1, edits join a
running step batch at step boundaries through :meth:`Worker.generate`, replay the mask-aware
activation cache inside it, leave it on a cancel or an expired deadline without disturbing
the others, and decode on the device thread or a decode thread of their own.

Tiny real pipelines at 64 px (tests/editing_factories.py), one torch thread so that a
request's numbers do not depend on how the machine's cores are shared."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from argus.contracts.generate import GenerateCall
from argus.worker.editing.activation_cache import EditCache
from argus.worker.editing.activation_store import ActivationStore
from argus.worker.editing.lane import LaneEvents
from argus.worker.engine import Worker, WorkerConfig
from argus.worker.metrics import WorkerMetrics
from argus.worker.models.pipelines import Cancelled, CancelToken
from tests.editing_factories import SIZE, encode, mask_png, pixels, region_of, template_rgb
from tests.worker_factories import default_profiles, make_registry, make_worker, torch_threads

pytestmark = pytest.mark.integration

PROMPT = "a red boat on a lake"
TOLERANCE = 2  # grey levels: a batched convolution may sum in another order than alone


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def edit(
    ratio: float, seed: int, steps: int = 6, template: int = 7, size: int = SIZE, **fields: Any
) -> GenerateCall:
    return GenerateCall(
        prompt=PROMPT,
        seed=seed,
        steps=steps,
        image=encode(template_rgb(size, seed=template)),
        mask=mask_png(region_of(ratio, size)),
        **fields,
    )


class Steps(LaneEvents):
    """Records each batched step's size and lets a test wait for the n-th step."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self._changed = threading.Condition()

    def on_batch_step(self, rows: int) -> None:
        with self._changed:
            self.rows.append(rows)
            self._changed.notify_all()

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.rows) >= count, timeout_s)


def lane_worker(events: LaneEvents | None = None, **config: Any) -> Worker:
    config.setdefault("edit_batch", 4)
    edit_cache = config.pop("edit_cache", None)
    worker = Worker(
        default_profiles(),
        make_registry(),
        config=WorkerConfig(default_steps=6, **config),
        edit_cache=edit_cache,
        lane_events=events,
    )
    worker.configure(wait=True)
    return worker


def close_enough(one: bytes, other: bytes) -> None:
    a, b = pixels(one).astype(int), pixels(other).astype(int)
    assert np.abs(a - b).max() <= TOLERANCE


def test_edits_joining_at_different_steps_and_ratios_equal_their_runs_alone() -> None:
    """An edit that arrives while another runs joins the running batch at a step boundary
    (a step of two ran), and each answer is its answer alone on a worker without the lane."""
    calls = [edit(0.5, seed=1, steps=8), edit(0.25, seed=2, steps=5, template=9)]
    alone = make_worker(default_steps=6)
    try:
        expected = [alone.generate(call).png for call in calls]
    finally:
        alone.close()
    steps = Steps()
    worker = lane_worker(steps)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(worker.generate, calls[0])
            steps.wait_for(2)  # the first runs alone for two steps, then the second joins
            second = pool.submit(worker.generate, calls[1])
            answers = [first.result(60), second.result(60)]
    finally:
        worker.close()
    assert steps.rows[:2] == [1, 1] and 2 in steps.rows
    for answer, png in zip(answers, expected, strict=True):
        close_enough(answer.png, png)
        assert answer.steps_run in (8, 5)
        assert answer.timing.queue_ms <= answer.timing.total_ms


def test_edits_of_a_recorded_template_replay_it_inside_the_batch() -> None:
    """The first edit of a template records it; two later edits of it run together, both
    replaying the record (counted hits), and give what they give replayed alone."""
    calls = [edit(0.5, seed=3), edit(0.25, seed=4)]
    alone = make_worker(default_steps=6, edit_cache=EditCache(ActivationStore(2**30)))
    try:
        alone.generate(edit(0.5, seed=99))  # records the template
        expected = [alone.generate(call).png for call in calls]
    finally:
        alone.close()
    steps = Steps()
    worker = lane_worker(steps, edit_cache=EditCache(ActivationStore(2**30)))
    try:
        worker.generate(edit(0.5, seed=99))
        worker.flush(30)  # the record is in the store
        recorded = len(steps.rows)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(worker.generate, calls))
        assert worker.edit_cache is not None
        assert worker.edit_cache.counts() == {"hit": 2, "miss": 1, "evicted": 0}
    finally:
        worker.close()
    assert max(steps.rows[recorded:]) == 2  # they ran together
    for answer, png in zip(answers, expected, strict=True):
        close_enough(answer.png, png)


def test_a_cancel_mid_batch_frees_its_slot_and_leaves_the_other_alone() -> None:
    """A running edit whose client goes away leaves at the next boundary (Cancelled, stage
    running); the edit beside it finishes with its answer alone."""
    keep, drop = edit(0.5, seed=5, steps=8), edit(0.5, seed=6, steps=8, template=9)
    alone = make_worker(default_steps=6)
    try:
        expected = alone.generate(keep).png
    finally:
        alone.close()
    steps = Steps()
    worker = lane_worker(steps)
    token = CancelToken()
    try:
        with ThreadPoolExecutor(2) as pool:
            kept = pool.submit(worker.generate, keep)
            dropped: Future[Any] = pool.submit(worker.generate, drop, token)
            steps.wait_for(3)
            token.cancel()
            with pytest.raises(Cancelled) as stopped:
                dropped.result(60)
            answer = kept.result(60)
        assert stopped.value.stage == "running" and stopped.value.reason == "cancelled"
        assert worker.stats().stopped == {"cancelled": {"running": 1}}
    finally:
        worker.close()
    close_enough(answer.png, expected)
    after = steps.rows[steps.rows.index(2) :]
    assert 1 in after  # the batch went on with one request


def test_an_edit_whose_deadline_passes_in_the_queue_leaves_it_at_once() -> None:
    """An edit waiting behind a full batch whose deadline passes is stopped in the queue
    (stage queued) without waiting for the batch to reach a boundary or finish."""
    steps = Steps()
    worker = lane_worker(steps, edit_batch=2)
    try:
        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(worker.generate, edit(0.5, seed=s, steps=30)) for s in (1, 2)]
            steps.wait_for(1)
            late = pool.submit(
                worker.generate, edit(0.5, seed=3), CancelToken(time.monotonic() + 0.3)
            )
            with pytest.raises(Cancelled) as stopped:
                late.result(60)
            assert not any(f.done() for f in running)  # they were still running
            for future in running:
                future.result(120)
        assert stopped.value.stage == "queued" and stopped.value.reason == "expired"
    finally:
        worker.close()


def test_decoding_on_a_thread_of_its_own_keeps_every_answers_bytes() -> None:
    """The same edits, served one after another, give the same PNG bytes whether they decode
    on the device thread or on the decode thread."""
    calls = [edit(0.5, seed=7), edit(1.0, seed=8), edit(0.1, seed=9, template=9)]
    answers = {}
    for decode_thread in (False, True):
        worker = lane_worker(decode_thread=decode_thread)
        try:
            answers[decode_thread] = [worker.generate(call).png for call in calls]
        finally:
            worker.close()
    assert answers[True] == answers[False]


def test_a_generation_on_a_lane_worker_takes_the_slot_between_batches() -> None:
    """Generations keep today's path; one that arrives while edits run waits for the batch to
    drain, runs, and the edits behind it run after (nothing starves, nothing deadlocks)."""
    steps = Steps()
    worker = lane_worker(steps, edit_batch=2)
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(worker.generate, edit(0.5, seed=1, steps=8))
            steps.wait_for(1)
            generation = pool.submit(worker.generate, GenerateCall(prompt=PROMPT, steps=4))
            later = pool.submit(worker.generate, edit(0.5, seed=2, steps=4))
            results = [f.result(120) for f in (first, generation, later)]
        assert results[1].steps_run == 4 and results[2].steps_run == 4
        assert worker.stats().completed == 3
    finally:
        worker.close()


def test_batched_steps_are_counted_in_the_workers_metrics() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    worker = lane_worker(metrics.lane)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(worker.generate, [edit(0.5, seed=1), edit(0.2, seed=2)]))
    finally:
        worker.close()
    count = registry.get_sample_value("argus_worker_edit_batch_size_count")
    total = registry.get_sample_value("argus_worker_edit_batch_size_sum")
    assert count is not None and count >= 6  # at least one request's six steps
    assert total is not None and total >= 12  # both requests' steps


def test_a_bad_batch_bound_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="edit_batch"):
        WorkerConfig(edit_batch=0)
