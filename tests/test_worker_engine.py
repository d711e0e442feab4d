"""The worker's request path without transport: validation, levels, substitution, the queue
bound, model switching and the memory guard."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest
import torch
from PIL import Image

from argus.contracts.generate import CacheOutcome, GenerateCall
from argus.contracts.worker_control import LoadState
from argus.request_limits import InvalidRequestError
from argus.types import Strategy
from argus.worker.engine import QueueFullError
from argus.worker.gpu_queue import FifoSlot
from argus.worker.models.pipelines import CancelToken
from argus.worker.models.registry import MemoryGuardError, UnknownModelError
from argus.worker.models.sources import estimate_bytes
from tests.worker_factories import STEPS, make_registry, make_worker

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def worker() -> Any:
    w = make_worker()
    yield w
    w.close()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (GenerateCall("x", width=0), "width"),
        (GenerateCall("x", width=-64), "width"),
        (GenerateCall("x", height=60), "height"),
        (GenerateCall("x", width=1 << 20), "width"),
        (GenerateCall("x", width=2048, height=2048 + 8), "height"),
        (GenerateCall("x", steps=0), "steps"),
        (GenerateCall("x", steps=-3), "steps"),
        (GenerateCall("x", steps=1001), "steps"),
        (GenerateCall("x", level="ac-k99"), "level"),
        (GenerateCall("x", level="ac-k10", steps=10), "level"),
        (GenerateCall("x", level="ac-k25", steps=20), "level"),
        (GenerateCall("x", guidance_scale=float("nan")), "guidance_scale"),
        (GenerateCall("x", guidance_scale=-1.0), "guidance_scale"),
        (GenerateCall("x" * (64 * 1024 + 1)), "prompt"),
        (GenerateCall("x", seed=-1), "seed"),
        (GenerateCall("x", adapters=("lora",)), "adapters"),
    ],
)
def test_bad_requests_name_the_field(worker: Any, call: GenerateCall, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        worker.generate(call)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


def test_bad_requests_leave_the_worker_serving(worker: Any) -> None:
    failed_before = worker.stats().failed
    for bad in (GenerateCall("x", width=0), GenerateCall("x", steps=0)):
        with pytest.raises(InvalidRequestError):
            worker.generate(bad)
    result = worker.generate(GenerateCall("a lighthouse at dusk", width=32, height=48))
    image = Image.open(io.BytesIO(result.png))
    assert image.size == (32, 48)
    assert worker.stats().failed == failed_before  # refused before queueing


def test_ac_level_without_a_cache_is_a_full_generation(worker: Any) -> None:
    result = worker.generate(GenerateCall("a fox", level="ac-k5"))
    assert result.level == "ac-k5"
    assert result.strategy is Strategy.AC
    assert result.model == "sdxl"
    assert result.start_step == 0
    assert result.steps_run == STEPS
    assert result.cache is CacheOutcome.NOT_USED


def test_unloaded_level_model_is_served_by_the_active_one(worker: Any) -> None:
    before = worker.stats().substituted
    result = worker.generate(GenerateCall("a fox", level="sm-tiny-sd"))
    assert result.substituted
    assert result.model == "sdxl"
    assert result.level == "sm-tiny-sd"
    assert worker.stats().substituted == before + 1


def test_empty_and_whitespace_prompts_are_refused_naming_prompt(worker: Any) -> None:
    for prompt in ("", "   \n\t"):  # argus.request_limits: as the router refuses them
        with pytest.raises(InvalidRequestError, match=r"^prompt: empty"):
            worker.generate(GenerateCall(prompt))


def test_full_queue_is_refused_not_grown() -> None:
    worker = make_worker(max_queue=1)
    worker._slots.join()  # the "GPU" is busy (the slot is free: the ticket holds it at once)
    busy = True
    done: list[Any] = []
    waiting = threading.Thread(
        target=lambda: done.append(worker.generate(GenerateCall("a"))), daemon=True
    )
    try:
        waiting.start()
        deadline = time.monotonic() + 120.0  # the first request loads the model
        while worker.stats().queue_length < 1:  # until the first request waits for the GPU
            assert time.monotonic() < deadline, "the first request never queued"
            time.sleep(0.005)
        # refused at once; were it queued instead, its deadline ends the wait with Cancelled
        with pytest.raises(QueueFullError, match="queue full"):
            worker.generate(GenerateCall("b"), CancelToken(deadline=time.monotonic() + 30.0))
        worker._slots.release()
        busy = False
        waiting.join(timeout=60)
        assert not waiting.is_alive(), "the queued request was not served once the GPU was free"
        assert len(done) == 1
        assert worker.stats().queue_length == 0
    finally:
        if busy:  # let the waiting request finish (or fail) rather than hang the run
            worker._slots.release()
        worker.close()


def test_every_pipeline_run_is_on_the_one_device_thread() -> None:
    """Torch keeps MKL buffers and an OpenMP team per thread that computes: requests arriving
    on many handler threads must all compute on the worker's one device thread (run on the
    callers' threads, a soak worker's memory crept as each pool thread first won the slot)."""
    worker = make_worker()
    computed_on: list[int] = []
    run = worker._run

    def spy(*args: Any, **kwargs: Any) -> Any:
        computed_on.append(threading.get_ident())
        return run(*args, **kwargs)

    worker._run = spy  # type: ignore[method-assign]
    callers: list[int] = []

    def call(n: int) -> None:
        callers.append(threading.get_ident())
        for i in range(2):
            worker.generate(GenerateCall(f"prompt {n} {i}", seed=n))

    try:
        threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert len(computed_on) == 8
        assert len(set(computed_on)) == 1
        assert computed_on[0] not in callers
    finally:
        worker.close()


def test_the_png_is_encoded_after_the_gpu_slot_is_free() -> None:
    """The next request's run starts while the previous answer's PNG is still being encoded
    on its caller's thread, and each answer is still its own complete PNG."""
    worker = make_worker()
    encoding = threading.Event()
    release = threading.Event()
    save = Image.Image.save
    blocked: list[bool] = []

    def slow_save(image: Image.Image, fp: Any, *args: Any, **kwargs: Any) -> None:
        if not blocked:  # the first PNG waits until the second request has run
            blocked.append(True)
            encoding.set()
            assert release.wait(timeout=30)
        save(image, fp, *args, **kwargs)

    ran_while_encoding: list[bool] = []
    run = worker._run

    def spy(*args: Any, **kwargs: Any) -> Any:
        ran_while_encoding.append(encoding.is_set() and not release.is_set())
        try:
            return run(*args, **kwargs)
        finally:
            if encoding.is_set():
                release.set()

    worker._run = spy  # type: ignore[method-assign]
    results: dict[str, Any] = {}

    def call(name: str) -> None:
        results[name] = worker.generate(GenerateCall(f"prompt {name}", seed=1))

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Image.Image, "save", slow_save)
            a = threading.Thread(target=call, args=("a",))
            a.start()
            assert encoding.wait(timeout=120)
            b = threading.Thread(target=call, args=("b",))
            b.start()
            b.join(timeout=120)
            a.join(timeout=120)
        assert ran_while_encoding == [False, True]
        for name in ("a", "b"):
            image = Image.open(io.BytesIO(results[name].png))
            assert image.size == (64, 64)
            assert results[name].timing.decode_ms > 0
    finally:
        release.set()
        worker.close()


def test_configure_switches_model_in_the_background_and_unloads_the_old() -> None:
    worker = make_worker()
    try:
        future = worker.configure(level="sm-sd-1.5")
        # the old model keeps serving until the new one is ready
        served = worker.generate(GenerateCall("a boat", level="ac-k0"))
        assert served.model in ("sdxl", "sd-1.5")
        future.result(timeout=60)
        states = {m.name: m for m in worker.stats().models}
        assert list(states) == ["sd-1.5"]
        assert states["sd-1.5"].state is LoadState.READY
        assert states["sd-1.5"].active
        assert states["sd-1.5"].load_s > 0
        assert worker.stats().level == "sm-sd-1.5"
        assert worker.stats().strategy is Strategy.SM
        result = worker.generate(GenerateCall("a boat"))
        assert (result.model, result.substituted) == ("sd-1.5", False)
    finally:
        worker.close()


def test_configure_rejects_a_level_of_the_other_strategy(worker: Any) -> None:
    with pytest.raises(InvalidRequestError, match="level"):
        worker.configure(strategy=Strategy.AC, level="sm-sd-1.5")


def test_unknown_variant_is_refused() -> None:
    registry = make_registry()
    try:
        with pytest.raises(UnknownModelError, match="variant 'sd-9'"):
            registry.activate("sd-9")
    finally:
        registry.close()


def test_memory_guard_refuses_a_load_that_does_not_fit() -> None:
    xl = estimate_bytes("tiny:sdxl", torch.float32)
    small = estimate_bytes("tiny:tiny-sd", torch.float32)
    registry = make_registry(memory_budget_bytes=xl + small // 2)
    try:
        registry.activate("sdxl").result(timeout=60)
        # a switch holds both models until the new one is ready: tiny-sd does not fit beside
        with pytest.raises(MemoryGuardError, match=r"'tiny-sd'.*budget"):
            registry.activate("tiny-sd")
        assert [m.name for m in registry.infos()] == ["sdxl"]
        assert registry.active_name == "sdxl"
    finally:
        registry.close()


def test_a_superseded_load_does_not_stay_resident() -> None:
    registry = make_registry()
    try:
        registry.activate("sdxl").result(timeout=60)
        first = registry.activate("sd-1.5")
        second = registry.activate("small-sd")
        first.result(timeout=60)
        second.result(timeout=60)
        assert registry.active_name == "small-sd"
        assert [m.name for m in registry.infos()] == ["small-sd"]
    finally:
        registry.close()


def test_the_gpu_slot_goes_to_waiting_requests_in_their_order_of_arrival() -> None:
    # the router predicts a request's completion from the requests it sent ahead of it, so the
    # worker must serve them in that order however their threads are scheduled
    slot = FifoSlot()
    holder = slot.join()
    assert slot.acquire(holder, timeout=0)
    tickets = [slot.join() for _ in range(20)]
    served: list[int] = []

    def wait(i: int) -> None:
        assert slot.acquire(tickets[i], timeout=60)
        served.append(i)
        slot.release()

    threads = [threading.Thread(target=wait, args=(i,)) for i in reversed(range(20)) if i != 3]
    for thread in threads:  # started newest first: a semaphore would favour them
        thread.start()
    slot.leave(tickets[3])  # one gives up (cancelled) before its turn
    slot.release()
    for thread in threads:
        thread.join(timeout=60)
    assert served == [i for i in range(20) if i != 3]


def test_a_ticket_that_leaves_just_as_its_turn_came_passes_the_slot_on() -> None:
    slot = FifoSlot()
    slot.join()
    first, second = slot.join(), slot.join()
    slot.release()  # the slot goes to first, which is leaving (its deadline passed)
    slot.leave(first)
    assert slot.acquire(second, timeout=0)


def test_cuda_graphs_are_refused_off_cuda() -> None:
    """--cuda-graphs on a CPU worker is a clear error at start, naming the setting, not a
    failure at the first request."""
    with pytest.raises(ValueError, match="cuda_graphs 2: needs a CUDA device"):
        make_registry(cuda_graphs=2)
    with pytest.raises(ValueError, match="cuda_graphs"):
        make_registry(cuda_graphs=-1)
    from argus.worker.models.cuda_graphs import GraphedUNet
    from tests.worker_factories import tiny_model

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphedUNet(tiny_model().pipeline.unet)
