"""The worker's GenerateStream: progress events in order, latent previews, queue positions,
and a cancelled stream that stops denoising at the next step.

A real worker (tiny random pipeline on the CPU) behind its real gRPC server on loopback.
"""

from __future__ import annotations

import io
from typing import Any

import grpc
import pytest
from PIL import Image

from argus.plumbing import rpc
from argus.worker.engine import Worker
from tests.test_worker_deadlines import BOUND_S, LONG_STEPS, wait_until

pytestmark = pytest.mark.integration


worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")
Stage = worker_pb2.Progress.Stage


def cancel_within_one_step(stream: Any, worker: Worker) -> tuple[Any, Any]:
    """Read ``stream`` until its second step is done, cancel it, wait until ``worker``
    stopped the request and check it ran at most the step in progress after the cancel;
    returns the worker's stats before and after."""
    before = worker.stats()
    for event in stream:
        if event.progress.stage == Stage.STEP and event.progress.step >= 2:
            break
    stream.cancel()
    at_cancel = worker.stats().denoise_steps
    wait_until(lambda: worker.stats().cancelled > before.cancelled, "the worker stopped it")
    after = worker.stats()
    assert after.stopped["cancelled"]["running"] == before.cancelled + 1
    assert after.denoise_steps - at_cancel <= 1  # the step in progress, no more
    return before, after


def stages(events: list[Any]) -> list[tuple[str, int]]:
    return [(Stage.Name(e.progress.stage), e.progress.step) for e in events[:-1]]


def test_every_step_is_streamed_in_order_then_the_image(tiny_worker_stub: Any) -> None:
    request = worker_pb2.GenerateRequest(prompt="a red fox", steps=5, width=64, height=64)
    events = list(tiny_worker_stub.GenerateStream(request, timeout=BOUND_S))
    assert stages(events) == [
        ("QUEUED", 0),
        ("RUNNING", 0),
        *[("STEP", k) for k in range(1, 6)],
        ("DECODING", 5),
    ]
    assert all(e.progress.total_steps == 5 for e in events[1:-1])
    assert all(e.progress.worker_id == "worker-0" for e in events[:-1])
    elapsed = [e.progress.elapsed_ms for e in events[:-1]]
    assert elapsed == sorted(elapsed)
    last = events[-1]
    assert last.WhichOneof("event") == "response"
    assert last.response.steps_run == 5
    assert Image.open(io.BytesIO(last.response.png)).size == (64, 64)
    assert not any(e.progress.preview_png for e in events[:-1])  # none asked for


def test_previews_are_spread_over_the_steps_at_latent_resolution(tiny_worker_stub: Any) -> None:
    request = worker_pb2.GenerateRequest(prompt="a blue heron", steps=6, previews=2)
    events = list(tiny_worker_stub.GenerateStream(request, timeout=BOUND_S))
    with_preview = [e.progress.step for e in events[:-1] if e.progress.preview_png]
    assert with_preview == [3, 6]
    preview = next(e.progress.preview_png for e in events[:-1] if e.progress.preview_png)
    image = Image.open(io.BytesIO(preview))
    assert (image.size, image.mode) == ((8, 8), "RGB")  # 64 px / the VAE's factor of 8

    many = worker_pb2.GenerateRequest(prompt="a blue heron", steps=3, previews=50)
    events = list(tiny_worker_stub.GenerateStream(many, timeout=BOUND_S))
    assert [e.progress.step for e in events[:-1] if e.progress.preview_png] == [1, 2, 3]


def test_a_queued_stream_hears_its_position_until_it_runs(
    tiny_worker: Worker, tiny_worker_stub: Any
) -> None:
    before = tiny_worker.stats()
    long_call = tiny_worker_stub.Generate.future(
        worker_pb2.GenerateRequest(prompt="a slow fox", steps=LONG_STEPS), timeout=BOUND_S
    )
    try:
        wait_until(lambda: tiny_worker.stats().denoise_steps > before.denoise_steps, "it runs")
        stream = tiny_worker_stub.GenerateStream(
            worker_pb2.GenerateRequest(prompt="next", steps=2), timeout=BOUND_S
        )
        first = next(stream)
        assert (Stage.Name(first.progress.stage), first.progress.queue_position) == ("QUEUED", 1)
    finally:
        long_call.cancel()
    rest = list(stream)
    running = [e.progress.stage for e in rest].index(Stage.RUNNING)
    positions = [e.progress.queue_position for e in rest[:running]]
    assert positions in ([], [0])  # 0 if the wait polled between the cancel and the slot
    assert rest[-1].response.steps_run == 2


def test_cancelling_a_stream_stops_the_worker_within_one_step(
    tiny_worker: Worker, tiny_worker_stub: Any
) -> None:
    stream = tiny_worker_stub.GenerateStream(
        worker_pb2.GenerateRequest(prompt="a slow fox", steps=LONG_STEPS), timeout=BOUND_S
    )
    before, after = cancel_within_one_step(stream, tiny_worker)
    assert after.failed == before.failed
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() is grpc.StatusCode.CANCELLED


def test_a_bad_request_ends_the_stream_with_invalid_argument(tiny_worker_stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(
            tiny_worker_stub.GenerateStream(
                worker_pb2.GenerateRequest(prompt="x", width=65), timeout=30
            )
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("width")
