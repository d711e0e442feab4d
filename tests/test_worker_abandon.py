"""Abandoned work stops at once and work that cannot finish is not done (issue 29, point 2).

Checkpoints inside a step (the UNet's attention and ResNet blocks) and between the tiles of a
large decode, the decode skipped when it cannot finish before the deadline, the GPU slot free
for the next request, and the reply's timings. Real tiny pipelines on the CPU; the clock is a
fake where a test needs the deadline to pass at a chosen point, and nothing asserts a
wall-clock upper bound: counts of blocks, tiles, steps and decodes say where a request
stopped.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from PIL import Image

from argus.contracts.generate import GenerateCall, GenerateResult, Progress, Stage
from argus.worker.decode_times import DecodeSkipped, DecodeTimes
from argus.worker.engine import Worker
from argus.worker.models.pipelines import (
    CHECKPOINT_MODULES,
    Cancelled,
    CancelToken,
    DiffusionModel,
    decode_tiled,
)
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline
from tests.worker_factories import make_worker, spec

pytestmark = pytest.mark.unit


BOUND_S = 120.0  # the most a wait here takes on a loaded machine; never reached when green


class FakeClock:
    """A ``time.monotonic`` stand-in that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fresh_model(variant: str = "sdxl") -> DiffusionModel:
    """A tiny model of its own (tests here hook its modules; the shared one stays clean)."""
    source = TINY_PREFIX + variant
    return DiffusionModel(variant, build_tiny_pipeline(source), device="cpu", source=source)


def checkpointed(root: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in root.modules() if type(m).__name__ in CHECKPOINT_MODULES]


def spy_blocks(root: torch.nn.Module, on_block: Callable[[int], None]) -> Callable[[], None]:
    """Call ``on_block`` with the running count before each checkpointed block of ``root``
    runs (after the model's own checkpoint); returns the function that removes the spies."""
    count = 0

    def spy(module: torch.nn.Module, args: Any) -> None:
        nonlocal count
        count += 1
        on_block(count)

    handles = [m.register_forward_pre_hook(spy) for m in checkpointed(root)]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


# -- inside a step and inside a decode -----------------------------------------------------


def test_a_cancel_inside_a_step_stops_before_the_next_block() -> None:
    model = fresh_model()
    unet = model.pipeline.unet
    per_step = len(checkpointed(unet))
    assert model.checkpoints >= per_step > 3
    token = CancelToken()
    blocks: list[int] = []

    def on_block(count: int) -> None:
        blocks.append(count)
        if count == 3:
            token.cancel()

    remove = spy_blocks(unet, on_block)
    steps: list[int] = []
    try:
        with pytest.raises(Cancelled) as stop:
            model.denoise(spec(steps=5), cancel=token, on_step=steps.append)
    finally:
        remove()
    assert stop.value.reason == "cancelled"
    assert blocks == [1, 2, 3]  # the block that saw the cancel ran; the next one did not
    assert steps == []  # the first step never finished
    model.denoise(spec(steps=2))  # the checkpoints let an uncancelled run through


def cancel_at_block(model: DiffusionModel, token: CancelToken, at: int) -> tuple[list[int], Any]:
    """Cancel ``token`` as the ``at``-th checkpointed block of the model's UNet starts;
    returns the list of blocks started and the spies' remover."""
    blocks: list[int] = []

    def on_block(count: int) -> None:
        blocks.append(count)
        if count == at:
            token.cancel()

    return blocks, spy_blocks(model.pipeline.unet, on_block)


def test_the_controlnet_path_stops_inside_a_step() -> None:
    """ControlNet's split UNet runs the same blocks, so their checkpoints stop it too, and the
    session ends."""
    from argus.contracts.controlnet import ControlUnit
    from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
    from argus.worker.adapters.controlnet.models import ControlNetCatalog
    from argus.worker.adapters.controlnet.predictor import ControlNetPredictor

    model = fresh_model("sd-1.5")
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    control = io.BytesIO()
    Image.new("RGB", (64, 64)).save(control, format="PNG")
    token = CancelToken()
    blocks, remove = cancel_at_block(model, token, 3)
    try:
        unit = ControlUnit("canny", 1.0, control.getvalue())
        predictor = ControlNetPredictor(model, executor, [unit])
        with pytest.raises(Cancelled):
            model.denoise(spec(steps=4), predictor=predictor, cancel=token)
        assert blocks == [1, 2, 3]
        assert executor.stats().sessions_open == 0
    finally:
        remove()
        executor.close()


def test_the_latent_parallel_path_stops_inside_a_step_and_the_peer_stays_usable() -> None:
    """Rank 0's branch runs this model's UNet; a checkpoint that stops it mid-step leaves the
    peer's channels in step (its answer is drained), so the next request runs in parallel."""
    from argus.worker.adapters.latent_parallel import LatentParallelConfig, LatentParallelGroup

    config = LatentParallelConfig(
        peer_threads=1, start_timeout_s=120.0, load_timeout_s=120.0, step_timeout_s=60.0
    )
    model = fresh_model("sd-1.5")
    with LatentParallelGroup.start(config) as group:
        group.prepare(model)
        token = CancelToken()
        blocks, remove = cancel_at_block(model, token, 3)
        try:
            with pytest.raises(Cancelled):
                model.denoise(spec(steps=4), predictor=group.predictor(model), cancel=token)
        finally:
            remove()
        assert blocks == [1, 2, 3]
        assert group.healthy
        steps: list[int] = []
        model.denoise(spec(steps=2), predictor=group.predictor(model), on_step=steps.append)
        assert steps == [0, 1]
        assert group.stats().steps >= 2


def test_a_cancel_during_a_large_decode_stops_before_the_next_tile() -> None:
    model = fresh_model()
    vae = model.pipeline.vae
    tile = model.decode_tile()
    assert tile is not None
    latents = torch.randn(1, 4, 3 * tile, 3 * tile)  # nine tiles and more with the overlap
    token = CancelToken()
    tiles: list[int] = []

    def tile_done(module: torch.nn.Module, args: Any, out: Any) -> None:
        tiles.append(len(tiles) + 1)
        token.cancel()

    handle = vae.decoder.register_forward_hook(tile_done)
    try:
        with pytest.raises(Cancelled):
            model.decode(latents, token)
    finally:
        handle.remove()
    assert tiles == [1]


def test_a_deadline_passing_in_the_vae_stops_before_its_next_block() -> None:
    """An image up to one tile is decoded whole; the decoder's blocks are checkpoints too."""
    model = fresh_model()
    clock = FakeClock()
    token = CancelToken(deadline=1.0, clock=clock)
    decoder = model.pipeline.vae.decoder
    blocks: list[int] = []

    def on_block(count: int) -> None:
        blocks.append(count)
        clock.now = 2.0  # the deadline passes while the first block runs

    remove = spy_blocks(decoder, on_block)
    try:
        with pytest.raises(Cancelled) as stop:
            model.decode(torch.randn(1, 4, 8, 8), token)
    finally:
        remove()
    assert stop.value.reason == "expired"
    assert blocks == [1]


def test_tiled_decode_is_diffusers_tiled_decode_with_our_tile() -> None:
    model = fresh_model()
    vae = model.pipeline.vae
    z = torch.randn(1, 4, 80, 72)
    own = vae.tile_latent_min_size, vae.tile_sample_min_size
    with torch.inference_mode():
        got = decode_tiled(vae, z, 32, model.vae_scale_factor)
        vae.tile_latent_min_size, vae.tile_sample_min_size = 32, 32 * model.vae_scale_factor
        try:
            want = vae.tiled_decode(z, return_dict=False)[0]
        finally:
            vae.tile_latent_min_size, vae.tile_sample_min_size = own
    assert torch.equal(got, want)
    image = model.decode(z)
    assert image.size == (72 * 8, 80 * 8)


# -- the decode's prediction ---------------------------------------------------------------


def test_decode_times_learn_the_rate_of_images_of_about_the_size() -> None:
    times = DecodeTimes(seed_s_per_pixel=1e-6)
    assert times.predict_s(1000) == pytest.approx(1e-3)  # the seed before any decode
    times.observe(100, 1.0)  # a small image's rate, 0.01 s/px: a fixed cost dominates it
    assert times.predict_s(10_000) == pytest.approx(1e-2)  # the seed is lower: kept
    for _ in range(10):
        times.observe(10_000, 0.5)  # 5e-5 s/px at about the size asked
    assert times.predict_s(10_000) == pytest.approx(0.5)
    times.observe(10_000, 2.0)  # a slow one now weighs most: the high quantile follows it
    assert times.predict_s(10_000) == pytest.approx(2.0)
    for _ in range(10):
        times.observe(10_000, 0.5)  # and is forgotten as it ages
    assert times.predict_s(10_000) == pytest.approx(0.5)


def test_a_decode_that_cannot_finish_before_the_deadline_is_skipped() -> None:
    clock = FakeClock()
    # a 64×64 decode predicted at 5 s; the deadline at 10 s; each step takes 1.5 s of it
    worker = make_worker(decode_seed_s_per_pixel=5.0 / (64 * 64))
    try:
        token = CancelToken(deadline=10.0, clock=clock)

        def step(event: Progress) -> None:
            if event.stage is Stage.STEP:
                clock.now += 1.5

        before = worker.stats()
        with pytest.raises(DecodeSkipped) as skipped:
            worker.generate(GenerateCall("a red bus", width=64, height=64, steps=4), token, step)
        after = worker.stats()
        assert skipped.value.steps_done == 4  # all of them: 4 s left, 5 s of decode
        assert skipped.value.reason == "expired"
        assert after.denoise_steps - before.denoise_steps == 4
        assert after.decodes == before.decodes
        assert after.decodes_skipped == before.decodes_skipped + 1
        assert after.stopped["expired"] == {"running": 1}
        served = worker.generate(GenerateCall("next", width=64, height=64, steps=2))
        assert served.steps_run == 2
        assert worker.stats().decodes == before.decodes + 1
    finally:
        worker.close()


def test_a_request_whose_decode_cannot_fit_its_deadline_is_refused_at_once() -> None:
    """The issue's case: 2048×2048 with a 2 s deadline on a worker that knows no decode that
    large. Its decode alone is predicted at 8.4 s, so it never queues, denoises or decodes."""
    worker = make_worker()
    try:
        before = worker.stats()
        token = CancelToken(deadline=time.monotonic() + 2.0)
        with pytest.raises(DecodeSkipped) as skipped:
            worker.generate(GenerateCall("a huge bus", width=2048, height=2048), token)
        assert skipped.value.predicted_s > skipped.value.left_s
        after = worker.stats()
        assert after.stopped["expired"] == {"queued": 1}
        assert after.decodes_skipped == before.decodes_skipped + 1
        assert (after.denoise_runs, after.decodes) == (before.denoise_runs, before.decodes)
        assert worker.generate(GenerateCall("next", width=64, height=64, steps=2)).steps_run == 2
        assert worker.queue_length == 0
    finally:
        worker.close()


# -- the acceptance: a large request past its deadline, and the request behind it -----------


def test_a_large_request_past_its_deadline_stops_and_the_next_one_is_served() -> None:
    """The issue's case: 2048×2048 at 50 steps (one step of it is 8 s on two idle cores) with
    a 1 s deadline, and a 64×64 request queued behind it. The decode prediction is off (seed
    0), so the large request runs until its deadline; then at most one block of its UNet
    starts after the deadline, it is never decoded, and the small request is served."""
    worker = make_worker(decode_seed_s_per_pixel=0.0)
    large_steps = 50
    model = worker.registry.active()
    assert model is not None
    token = CancelToken(deadline=time.monotonic() + BOUND_S)  # set when the request starts
    late_blocks = 0

    def on_block(count: int) -> None:
        nonlocal late_blocks
        # the run being served is the model's watch's (private: the test looks inside)
        late_blocks += model._watch.token is token and token.reason() is not None

    remove = spy_blocks(model.pipeline.unet, on_block)
    try:
        before = worker.stats()
        outcome: list[BaseException | GenerateResult] = []

        def large() -> None:
            token.deadline = time.monotonic() + 1.0
            try:
                call = GenerateCall("a huge bus", width=2048, height=2048, steps=large_steps)
                outcome.append(worker.generate(call, token))
            except BaseException as err:
                outcome.append(err)

        thread = threading.Thread(target=large)
        thread.start()
        deadline = time.monotonic() + BOUND_S
        while worker.stats().denoise_runs == before.denoise_runs:
            assert time.monotonic() < deadline, "the large request never started"
            time.sleep(0.01)
        small = worker.generate(GenerateCall("next", width=64, height=64, steps=3))
        thread.join(BOUND_S)
        after = worker.stats()

        assert [type(o) for o in outcome] == [Cancelled]
        stop = outcome[0]
        assert isinstance(stop, Cancelled)
        assert (stop.reason, stop.stage) == ("expired", "running")
        assert late_blocks <= 1  # the block whose checkpoint passed just before the deadline
        assert stop.steps_done < large_steps
        assert after.stopped["expired"] == {"running": 1}
        large_run = after.denoise_steps - before.denoise_steps - small.steps_run
        assert large_run == stop.steps_done
        assert after.decodes == before.decodes + 1  # the small request's alone
        assert small.steps_run == 3 and Image.open(io.BytesIO(small.png)).size == (64, 64)
        assert small.timing.queue_ms > 0.0  # it waited behind the large one
        assert worker.queue_length == 0
    finally:
        remove()
        worker.close()


# -- the reply's timing --------------------------------------------------------------------


class SlowWorker:
    """The engine as the servicer calls it, taking ``busy_s`` in ``generate``."""

    class config:  # the one attribute the servicer reads
        worker_id = "w1"

    def __init__(self, result: GenerateResult, busy_s: float) -> None:
        self.result = result
        self.busy_s = busy_s
        self.took_s = 0.0

    def generate(self, call: Any, token: Any = None, progress: Any = None) -> GenerateResult:
        began = time.perf_counter()
        time.sleep(self.busy_s)
        self.took_s = time.perf_counter() - began
        return self.result


class FakeContext:
    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True


def test_the_reply_total_covers_the_call_from_its_arrival_to_the_reply(
    tiny_worker: Worker,
) -> None:
    from argus.worker.service import WorkerServicer, worker_pb2

    served = tiny_worker.generate(GenerateCall("a bus", steps=2))
    served = replace(served, timing=replace(served.timing, total_ms=0.0))  # no longer counts
    slow = SlowWorker(served, busy_s=0.05)
    servicer = WorkerServicer(slow, health_servicer=None)  # type: ignore[arg-type]
    request = worker_pb2.GenerateRequest(prompt="a bus")
    reply = servicer.Generate(request, FakeContext())  # type: ignore[arg-type]
    assert reply.timing.total_ms >= slow.took_s * 1e3
    assert reply.timing.queue_ms == served.timing.queue_ms


def test_queue_ms_is_the_wait_for_the_slot_and_the_rest_is_service(tiny_worker: Worker) -> None:
    """A request queued behind another waited (queue_ms) within its total, and for both
    total_ms − queue_ms holds each phase of the request's own run."""
    replies: list[GenerateResult] = []
    running = threading.Event()

    def first() -> None:
        def sink(event: Progress) -> None:
            if event.stage is Stage.STEP:
                running.set()

        replies.append(tiny_worker.generate(GenerateCall("first", steps=20), progress=sink))

    thread = threading.Thread(target=first)
    thread.start()
    assert running.wait(BOUND_S)
    second = tiny_worker.generate(GenerateCall("second", steps=2))
    thread.join(BOUND_S)
    (one,) = replies
    t1, t2 = one.timing, second.timing
    assert 0.0 < t2.queue_ms < t2.total_ms
    for t in (t1, t2):
        phases = t.encode_ms + t.denoise_ms + t.decode_ms
        assert t.total_ms - t.queue_ms >= phases
