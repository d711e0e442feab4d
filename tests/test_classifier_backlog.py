"""The classifier's micro-batcher under overload: its queue is bounded, a caller that gave
up is left out of its batch, and it says how long a new prompt would wait."""

from __future__ import annotations

import threading

import pytest

from argus.classifier.serving import BatcherFull, MicroBatcher

pytestmark = pytest.mark.unit


BOUND_S = 30.0


class GatedBatches:
    """run_batch that blocks on ``gate`` and records every batch it was given."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        self.gate.wait(BOUND_S)
        return items


def test_a_full_queue_refuses_at_once() -> None:
    run = GatedBatches()
    batcher = MicroBatcher(run, max_batch=1, max_wait_s=0.0, max_pending=2)
    try:
        first = batcher.submit(0)
        run.started.wait(BOUND_S)  # the first is running; two more may wait
        waiting = [batcher.submit(1), batcher.submit(2)]
        with pytest.raises(BatcherFull):
            batcher.submit(3)
        run.gate.set()
        assert [f.result(BOUND_S) for f in (first, *waiting)] == [0, 1, 2]
        assert batcher.submit(4).result(BOUND_S) == 4  # room again
    finally:
        run.gate.set()
        batcher.close(BOUND_S)


def test_a_caller_that_timed_out_is_left_out_of_its_batch() -> None:
    run = GatedBatches()
    batcher = MicroBatcher(run, max_batch=4, max_wait_s=0.0)
    try:
        first = batcher.submit(0)
        run.started.wait(BOUND_S)
        with pytest.raises(TimeoutError):
            batcher(1, timeout=0.01)  # gives up while the first batch runs
        later = batcher.submit(2)
        run.gate.set()
        assert later.result(BOUND_S) == 2 and first.result(BOUND_S) == 0
        assert [1 in batch for batch in run.batches] == [False] * len(run.batches)
    finally:
        run.gate.set()
        batcher.close(BOUND_S)


def test_backlog_counts_the_batches_ahead() -> None:
    run = GatedBatches()
    run.gate.set()
    batcher = MicroBatcher(run, max_batch=2, max_wait_s=0.0)
    try:
        assert batcher.backlog_s() == 0.0  # nothing measured yet
        batcher.submit(0).result(BOUND_S)
        for _ in range(1000):  # until the batcher has put the finished batch down and timed it
            if batcher.backlog_s() > 0.0:
                break
            threading.Event().wait(0.001)
        one = batcher.backlog_s()  # a prompt now waits for its own batch alone
        assert one > 0.0
        run.gate.clear()
        run.started.clear()
        running = batcher.submit(1)
        run.started.wait(BOUND_S)
        queued = [batcher.submit(i) for i in range(2, 7)]  # 5 waiting: 2 full batches ahead
        assert batcher.backlog_s() == pytest.approx(one * (5 // 2 + 1 + 1))  # + running + own
        run.gate.set()
        for future in (running, *queued):
            future.result(BOUND_S)
    finally:
        run.gate.set()
        batcher.close(BOUND_S)
