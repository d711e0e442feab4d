"""Deadlines and cancellation on the worker: expired work is dropped before it runs, a
cancelled call stops at the next step boundary and frees the GPU, and both are counted.

A real worker (tiny random pipeline on the CPU) behind its real gRPC server on loopback; the
long request asks for 1000 steps, far more than any test waits for, so it only ends early.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from argus.contracts.generate import GenerateCall
from argus.plumbing import rpc
from argus.worker.engine import Worker
from argus.worker.models.pipelines import Cancelled, CancelToken
from tests.worker_factories import spec, tiny_model

pytestmark = pytest.mark.integration


worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

BOUND_S = 120.0  # the most any wait here takes on a loaded machine; never reached when green
LONG_STEPS = 1000


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def test_denoise_stops_before_the_next_step_once_cancelled() -> None:
    model = tiny_model()
    steps: list[int] = []
    token = CancelToken()

    def count(step: int) -> None:
        steps.append(step)
        if len(steps) == 2:
            token.cancel()

    with pytest.raises(Cancelled) as stop:
        model.denoise(spec(steps=50), cancel=token, on_step=count)
    assert stop.value.reason == "cancelled"
    assert steps == [0, 1]  # not one step after the one that saw the cancellation


def test_denoise_past_its_deadline_runs_no_step() -> None:
    steps: list[int] = []
    token = CancelToken(deadline=time.monotonic() - 1.0)
    with pytest.raises(Cancelled) as stop:
        tiny_model().denoise(spec(steps=5), cancel=token, on_step=steps.append)
    assert stop.value.reason == "expired"
    assert steps == []


def test_engine_stops_within_one_step_of_a_cancel_and_counts_it(tiny_worker: Worker) -> None:
    before = tiny_worker.stats()
    token = CancelToken()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            tiny_worker.generate(GenerateCall("a slow fox", steps=LONG_STEPS), token)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: tiny_worker.stats().denoise_steps > before.denoise_steps, "a step ran")
    token.cancel()
    at_cancel = tiny_worker.stats().denoise_steps
    thread.join(BOUND_S)
    after = tiny_worker.stats()
    assert [type(e) for e in errors] == [Cancelled]
    assert after.denoise_steps - at_cancel <= 1  # the step in progress, no more
    assert after.stopped["cancelled"]["running"] == before.cancelled + 1
    assert after.failed == before.failed  # a cancellation is not a failure
    assert tiny_worker.queue_length == 0


def test_a_call_whose_deadline_passes_in_the_queue_never_runs(
    tiny_worker: Worker, tiny_worker_stub: Any
) -> None:
    before = tiny_worker.stats()
    long_call = tiny_worker_stub.Generate.future(
        worker_pb2.GenerateRequest(prompt="a slow fox", steps=LONG_STEPS), timeout=BOUND_S
    )
    try:
        wait_until(lambda: tiny_worker.stats().denoise_steps > before.denoise_steps, "it runs")
        with pytest.raises(grpc.RpcError) as info:
            tiny_worker_stub.Generate(
                worker_pb2.GenerateRequest(prompt="queued", steps=2), timeout=0.5
            )
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: tiny_worker.stats().expired > before.expired, "the worker dropped it")
        stats = tiny_worker.stats()
        assert stats.stopped["expired"] == {"queued": before.expired + 1}
        assert stats.denoise_runs == before.denoise_runs + 1  # the long call's alone
        reply = tiny_worker_stub.Stats(worker_pb2.StatsRequest(), timeout=BOUND_S)
        assert reply.expired_queued == stats.stopped["expired"]["queued"]
    finally:
        long_call.cancel()
    wait_until(lambda: tiny_worker.queue_length == 0, "the long call stopped")


def test_a_cancelled_call_frees_the_worker_for_the_next(
    tiny_worker: Worker, tiny_worker_stub: Any
) -> None:
    before = tiny_worker.stats()
    long_call = tiny_worker_stub.Generate.future(
        worker_pb2.GenerateRequest(prompt="a slow fox", steps=LONG_STEPS), timeout=BOUND_S
    )
    wait_until(lambda: tiny_worker.stats().denoise_steps > before.denoise_steps, "it runs")
    long_call.cancel()
    wait_until(lambda: tiny_worker.stats().cancelled > before.cancelled, "the worker stopped it")
    stopped = tiny_worker.stats()
    assert stopped.stopped["cancelled"]["running"] == before.cancelled + 1
    long_steps = stopped.denoise_steps - before.denoise_steps
    assert long_steps < LONG_STEPS
    reply = tiny_worker_stub.Generate(
        worker_pb2.GenerateRequest(prompt="next", steps=2), timeout=BOUND_S
    )
    assert reply.steps_run == 2
    assert tiny_worker.stats().denoise_steps == stopped.denoise_steps + 2
    assert tiny_worker_stub.Stats(worker_pb2.StatsRequest(), timeout=BOUND_S).cancelled_running >= 1
