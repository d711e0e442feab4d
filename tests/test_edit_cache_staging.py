"""The activation cache at the GPU's speed, checked on the CPU for exactness
(argus/worker/editing/masked_blocks.py's RowStager and Replay staging, packed_blocks.py's
batched staging, activation_store.py's DeviceTier and tier sizes, activation_cache.py's use
of the device tier):

* a replay whose rows are staged on the device a step ahead gives the very latents of one that
  copies them in each block (torch.equal), alone and in a batch, and reads the staged rows;
* the device tier serves a template's next edit without a store lookup, evicts by LRU within
  its bytes, skips a record larger than its bound, and shows in the worker's metrics;
* "auto" sizes are shares of memory, disk and free device memory; explicit bytes win;
* on CUDA only (skipped elsewhere): the pinned, side-stream path gives the same latents as the
  synchronous one.

Tiny real pipelines at 128 px and 4 steps (the blocks see 8×8 tokens), as
tests/test_masked_blocks.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock
from prometheus_client import CollectorRegistry

from argus import defaults
from argus.cli.worker import byte_bound
from argus.contracts.generate import GenerateCall
from argus.worker.app import WorkerSettings, build_edit_cache
from argus.worker.editing import masked_blocks
from argus.worker.editing.activation_cache import EditCache
from argus.worker.editing.activation_store import (
    ActivationStore,
    DeviceTier,
    StoreListener,
    Tier,
    auto_device_bytes,
    auto_disk_bytes,
    auto_host_bytes,
    physical_memory_bytes,
    resolve_bytes,
)
from argus.worker.editing.masked_blocks import (
    ActivationRecord,
    RecordingPredictor,
    Replay,
    ReplayPredictor,
    recording,
    transformer_blocks,
)
from argus.worker.editing.packed_blocks import RowPart, RowRecorder, batched_blocks
from argus.worker.engine import Worker, count_in_memory_guard
from argus.worker.metrics import WorkerMetrics
from argus.worker.models.pipelines import DiffusionModel
from argus.worker.models.registry import MemoryGuardError
from argus.worker.models.sources import estimate_bytes
from tests.cuda_marks import needs_cuda
from tests.editing_factories import (
    BLOCK_PROMPT,
    BLOCK_SIZE,
    encode,
    latent_region,
    mask_png,
    pixels,
    region_of,
    template_rgb,
)
from tests.editing_factories import STEPS as BLOCK_STEPS
from tests.editing_factories import STEPS as WORKER_STEPS
from tests.editing_factories import block_edit_spec as edit_spec
from tests.worker_factories import make_registry, make_worker, tiny_model

pytestmark = pytest.mark.unit

SIZE, STEPS, PROMPT = BLOCK_SIZE, BLOCK_STEPS, BLOCK_PROMPT  # block_edit_spec's
GiB = 2**30


def template_record(model: DiffusionModel, **kwargs: Any) -> ActivationRecord:
    """The template's record as the cache keeps it: another seed's run, every token covered."""
    spec = edit_spec(0.25, seed=5)
    recorder = RecordingPredictor(model, torch.zeros_like(latent_region(model, spec)), **kwargs)
    model.denoise(spec, predictor=recorder)
    return recorder.record


class RowsSeen:
    """Counts the dtypes of the recorded rows the blocks fill in (staged rows arrive in the
    blocks' float32, the record's own in float16)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dtypes: list[torch.dtype] = []
        fill = masked_blocks.fill_cached

        def spy(full: torch.Tensor, plan: Any, recorded: torch.Tensor) -> None:
            self.dtypes.append(recorded.dtype)
            fill(full, plan, recorded)

        monkeypatch.setattr(masked_blocks, "fill_cached", spy)


# -- staging: bit for bit ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sdxl", "sd-1.5"])
@pytest.mark.parametrize("keys_values", [False, True])
def test_a_staged_replay_equals_the_unstaged_one_bit_for_bit(
    variant: str, keys_values: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's rows brought to the device and dtype ahead (the next step's while this
    one runs) against each block copying its own: the same latents to the bit, some blocks
    replaying and one computing in full (Algorithm 1's mix), and every replayed row read from
    the staged copy."""
    model = tiny_model(variant)
    spec = edit_spec(0.25, seed=2)
    region = latent_region(model, spec)
    record = template_record(model, keys_values=keys_values)
    use = [True] * len(transformer_blocks(model.pipeline.unet))
    use[1] = False
    seen = RowsSeen(monkeypatch)
    latents = {}
    for stage in (False, True):
        replay = ReplayPredictor(
            model, record, region, use_cache=use, keys_values=keys_values, stage=stage
        )
        latents[stage] = model.denoise(spec, predictor=replay).latents
    assert torch.equal(latents[True], latents[False])
    per_run = len(seen.dtypes) // 2
    assert per_run > 0
    assert set(seen.dtypes[:per_run]) == {torch.float16}  # unstaged: the record's own rows
    assert set(seen.dtypes[per_run:]) == {torch.float32}  # staged: converted ahead


def test_the_next_steps_rows_are_staged_while_a_step_runs() -> None:
    """The first step's rows start at construction; inside a step, the next step's have
    started; after the last step nothing is pending."""
    model = tiny_model("sdxl")
    spec = edit_spec(0.25, seed=2)
    replay = Replay(model.pipeline.unet, template_record(model), latent_region(model, spec))
    assert replay.stager is not None and replay.stager.started == [0]
    seen = []
    for step in range(STEPS):
        with replay.staged(step):
            seen.append(replay.stager.started)
    assert seen == [[1], [2], [3], []]
    unstaged = Replay(model.pipeline.unet, replay.record, latent_region(model, spec), stage=False)
    assert unstaged.stager is None


def small_block() -> BasicTransformerBlock:
    torch.manual_seed(0)
    return BasicTransformerBlock(8, 2, 4, cross_attention_dim=8).eval()


def block_record(block: torch.nn.Module, steps: int) -> ActivationRecord:
    """A record of ``steps`` steps of one block on 8×8 tokens, two rows (CFG)."""
    record = ActivationRecord((8, 8))
    for step in range(steps):
        with torch.inference_mode(), recording(block, record, step, None):
            block(torch.randn(2, 64, 8), encoder_hidden_states=torch.randn(2, 3, 8))
    return record


def regions() -> tuple[torch.Tensor, torch.Tensor]:
    small, large = torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8)
    small[..., :2, :2] = 1
    large[..., 2:6, 1:7] = 1
    return small, large


def test_a_batch_of_staged_replays_equals_the_unstaged_batch_bit_for_bit() -> None:
    """Two replays of different regions and a recording in one block call per step, three
    steps: staged (each replay's next step started inside the call) and unstaged give the same
    outputs to the bit, and the recording keeps the same rows."""
    block = small_block()
    record = block_record(block, 3)
    inputs = [(torch.randn(6, 64, 8), torch.randn(6, 3, 8)) for _ in range(3)]
    outs: dict[bool, list[torch.Tensor]] = {}
    kept: dict[bool, ActivationRecord] = {}
    for stage in (False, True):
        replays = [Replay(block, record, region, stage=stage) for region in regions()]
        recorder = RowRecorder(regions()[0])
        outs[stage] = []
        for step, (x, ehs) in enumerate(inputs):
            parts = [RowPart(2, recorder, step)] + [RowPart(2, r, step) for r in replays]
            with torch.inference_mode(), batched_blocks([block], parts):
                outs[stage].append(block(x, encoder_hidden_states=ehs))
                if stage:
                    assert all(r.stager is not None for r in replays)
                    assert [r.stager.started for r in replays if r.stager] == [
                        [step + 1] if step < 2 else []
                    ] * 2
        kept[stage] = recorder.record
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)
    assert kept[False].outputs.keys() == kept[True].outputs.keys()
    for key, rows in kept[False].outputs.items():
        assert torch.equal(rows, kept[True].outputs[key])


def test_a_collecting_replay_gives_the_whole_record_once_every_step_ran() -> None:
    """``collect`` stages every block's rows, even those the replay does not read, and after
    the last step :meth:`Replay.device_record` is the record, tensor for tensor."""
    block = small_block()
    record = block_record(block, 2)
    replay = Replay(block, record, regions()[1], use_cache=[False], collect=True)
    x, ehs = torch.randn(2, 64, 8), torch.randn(2, 3, 8)
    with torch.inference_mode(), replay.step(0):
        block(x, encoder_hidden_states=ehs)
    assert replay.device_record() is None  # one step of two
    with torch.inference_mode(), replay.step(1):
        block(x, encoder_hidden_states=ehs)
    copied = replay.device_record()
    assert copied is not None
    expected = record.to_tensors()
    assert copied.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(copied[name], tensor), name
    assert Replay(block, record, regions()[1]).device_record() is None  # not collecting


# -- the device tier -----------------------------------------------------------------------


def rows(value: float, elems: int = 8) -> dict[str, torch.Tensor]:
    return {"s0.b0.y": torch.full((elems,), value, dtype=torch.float16)}  # 2 bytes each


class Heard(StoreListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, Tier, int]] = []

    def on_hit(self, tier: Tier, nbytes: int) -> None:
        self.events.append(("hit", tier, nbytes))

    def on_evict(self, tier: Tier, nbytes: int) -> None:
        self.events.append(("evict", tier, nbytes))


def test_the_device_tier_evicts_the_least_recently_used_within_its_bytes() -> None:
    heard = Heard()
    tier = DeviceTier(3 * 16, listener=heard)
    for i, key in enumerate("abc"):
        assert tier.put(key, rows(i))
    assert tier.get("a") is not None  # a is now the most recent, b the least
    assert tier.put("d", rows(3))
    assert "b" not in tier and all(k in tier for k in "acd")
    assert tier.bytes_used == 3 * 16
    assert ("evict", "device", 16) in heard.events and ("hit", "device", 16) in heard.events
    assert tier.make_room(2 * 16)  # room for two beside the rest: c, then a, leave
    assert tier.keys() == ["d"] and tier.bytes_used == 16
    stats = tier.stats()
    assert (stats.hits, stats.puts, stats.evictions, stats.records) == (1, 4, 3, 1)


def test_a_record_larger_than_the_device_tier_is_skipped_and_evicts_nothing() -> None:
    tier = DeviceTier(32)
    assert tier.put("a", rows(0))
    assert not tier.put("big", rows(1, elems=17))  # 34 bytes
    assert not tier.make_room(34) and not tier.fits(34) and tier.fits(32)
    assert "a" in tier and "big" not in tier
    assert tier.stats().skipped == 1 and tier.bytes_used == 16
    assert not DeviceTier(0).put("a", rows(0))  # 0: keeps nothing


def test_an_auto_device_tier_is_sized_once_for_the_models_device() -> None:
    sized: list[Any] = []

    def auto(device: Any) -> int:
        sized.append(device)
        return 64

    tier = DeviceTier(None, auto=auto)
    assert tier.stats().max_bytes is None and not tier.put("a", rows(0))
    assert tier.bound("cuda:0") == 64 and tier.bound("cuda:0") == 64
    assert sized == ["cuda:0"]
    assert DeviceTier(None).bound("cpu") == 0  # a CPU worker's device is host memory


def test_the_device_tier_cedes_its_bound_to_a_model_load() -> None:
    tier = DeviceTier(4 * 16)
    for i, key in enumerate("abc"):
        assert tier.put(key, rows(i))
    assert tier.reserved_bytes == 4 * 16  # the bound, not the 3 records held
    assert tier.cede(2 * 16) == 2 * 16
    assert tier.keys() == ["b", "c"] and tier.stats().max_bytes == 2 * 16 == tier.reserved_bytes
    assert tier.put("d", rows(3)) and tier.put("e", rows(4)) and tier.keys() == ["d", "e"]
    assert tier.cede(10 * 16) == 2 * 16 and tier.keys() == [] and tier.reserved_bytes == 0
    unsized = DeviceTier(None)
    assert unsized.cede(16) == 0 and unsized.reserved_bytes == 0


@pytest.mark.parametrize("yielding", [True, False], ids=["cedes", "cannot-cede"])
def test_a_model_load_that_fits_only_without_the_device_tier_lowers_its_bound(
    yielding: bool,
) -> None:
    """The memory guard counts the device tier's bound beside the models; a load that would
    not fit beside it lowers the bound by what it lacks instead of being refused, and without
    a tier to shrink the same load is refused."""
    xl = estimate_bytes("tiny:sdxl", torch.float32)
    small = estimate_bytes("tiny:tiny-sd", torch.float32)
    budget = xl + small + 400  # room for both models and 400 bytes of the tier's 600
    registry = make_registry(memory_budget_bytes=budget, max_resident=2)
    tier = DeviceTier(600)
    registry.count_outside(lambda: tier.reserved_bytes, tier.cede if yielding else None)
    try:
        registry.activate("sdxl").result(timeout=60)
        assert registry.used_bytes() == xl + 600 <= budget
        assert tier.put("a", rows(0)) and tier.put("b", rows(1))
        if not yielding:
            with pytest.raises(MemoryGuardError, match=r"'tiny-sd'.*budget"):
                registry.activate("tiny-sd")
            return
        registry.activate("tiny-sd").result(timeout=60)
        assert tier.stats().max_bytes == 400 and tier.keys() == ["a", "b"]  # 32 bytes fit
        assert registry.used_bytes() <= budget
    finally:
        registry.close()


def test_a_cuda_worker_counts_its_device_tier_and_a_cpu_worker_its_host_tier() -> None:
    counted: list[tuple[Any, Any]] = []

    class Guard:
        def __init__(self, device: str) -> None:
            self.device = device

        def count_outside(self, held: Any, cede: Any = None) -> None:
            counted.append((held(), cede))

    tier = DeviceTier(4 * 16)
    store = ActivationStore(GiB)
    count_in_memory_guard(Guard("cuda:0"), EditCache(store, device=tier))  # type: ignore[arg-type]
    count_in_memory_guard(Guard("cpu"), EditCache(store, device=tier))  # type: ignore[arg-type]
    assert counted == [(4 * 16, tier.cede), (store.host_bytes_used, None)]


@pytest.fixture
def device_cached() -> Iterator[Worker]:
    cache = EditCache(ActivationStore(GiB), device=DeviceTier(GiB))
    made = make_worker(edit_cache=cache)
    yield made
    made.close()


def worker_edit(ratio: float, seed: int) -> GenerateCall:
    return GenerateCall(
        prompt=PROMPT,
        seed=seed,
        steps=WORKER_STEPS,
        image=encode(template_rgb()),
        mask=mask_png(region_of(ratio)),
    )


def tiers(worker: Worker) -> tuple[DeviceTier, ActivationStore]:
    assert worker.edit_cache is not None and worker.edit_cache.device is not None
    return worker.edit_cache.device, worker.edit_cache.store


def test_the_device_tier_serves_the_templates_next_edit_without_a_store_lookup(
    device_cached: Worker,
) -> None:
    """The recording run keeps its rows on the device: the next edit is a device hit and the
    store is not asked; its answer equals that of the same edit replayed from the store."""
    device, store = tiers(device_cached)
    device_cached.generate(worker_edit(0.5, seed=1))
    device_cached.flush()
    assert device.stats().records == 1 and device.bytes_used > 0
    from_device = device_cached.generate(worker_edit(0.25, seed=2))
    assert device.stats().hits == 1
    assert (store.stats().host_hits, store.stats().misses) == (0, 1)
    assert device_cached.edit_cache is not None
    assert device_cached.edit_cache.counts() == {"hit": 1, "miss": 1, "evicted": 0}
    (key,) = device.keys()
    device.discard(key)  # now only the store has it
    from_store = device_cached.generate(worker_edit(0.25, seed=2))
    assert store.stats().host_hits == 1
    assert from_store.png == from_device.png
    keep = ~region_of(0.25)
    assert np.array_equal(pixels(from_device.png)[keep], template_rgb()[keep])


def test_a_replay_from_the_store_puts_the_record_on_the_device_for_the_next_edit(
    device_cached: Worker,
) -> None:
    device, store = tiers(device_cached)
    device_cached.generate(worker_edit(0.5, seed=1))
    device_cached.flush()
    (key,) = device.keys()
    recorded = dict(device.get(key) or {})  # a hit of the test's own (1)
    device.discard(key)
    device_cached.generate(worker_edit(0.25, seed=2))  # from the store, gathered on the device
    device_cached.flush()
    assert store.stats().host_hits == 1 and key in device
    gathered = device.get(key)  # (2)
    assert gathered is not None and gathered.keys() == recorded.keys()
    assert all(torch.equal(gathered[name], recorded[name]) for name in recorded)
    device_cached.generate(worker_edit(0.25, seed=3))  # the edit's (3)
    assert store.stats().host_hits == 1 and device.stats().hits == 3


def test_in_the_edit_lane_too_a_recording_fills_the_device_tier_and_the_next_edit_reads_it() -> (
    None
):
    """Edits served in step batches: the recording (RowRecorder) keeps its rows on the device,
    the next edit replays them from the device tier, and the edit after that from the store
    gathers them again."""
    device, store = DeviceTier(GiB), ActivationStore(GiB)
    worker = make_worker(edit_cache=EditCache(store, device=device), edit_batch=2)
    try:
        worker.generate(worker_edit(0.5, seed=1))
        worker.flush()
        assert device.stats().records == 1
        from_device = worker.generate(worker_edit(0.25, seed=2))
        assert (device.stats().hits, store.stats().host_hits) == (1, 0)
        (key,) = device.keys()
        device.discard(key)
        from_store = worker.generate(worker_edit(0.25, seed=2))
        worker.flush()
        assert store.stats().host_hits == 1 and device.keys() == [key]
        assert from_store.png == from_device.png
    finally:
        worker.close()


def test_a_record_larger_than_the_device_tier_stays_in_the_store_only() -> None:
    device = DeviceTier(1024)  # a record here is about 100 KiB
    worker = make_worker(edit_cache=EditCache(ActivationStore(GiB), device=device))
    try:
        worker.generate(worker_edit(0.5, seed=1))
        worker.flush()
        worker.generate(worker_edit(0.25, seed=2))
        worker.flush()
        store = tiers(worker)[1]
        assert device.stats().records == 0 and device.bytes_used == 0
        assert store.stats().host_hits == 1 and device.stats().hits == 0
        assert device.stats().skipped == 0  # neither run gathered it: never offered
    finally:
        worker.close()


def test_the_device_tier_shows_in_the_workers_metrics() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg).edit_cache
    cache = EditCache(
        ActivationStore(GiB, listener=metrics), metrics, DeviceTier(GiB, listener=metrics)
    )
    worker = make_worker(edit_cache=cache)
    try:
        worker.generate(worker_edit(0.5, seed=1))
        worker.flush()
        worker.generate(worker_edit(0.25, seed=2))
    finally:
        worker.close()

    def value(name: str, **labels: str) -> float:
        found = reg.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("argus_worker_edit_cache_lookups_total", tier="device") == 1
    assert value("argus_worker_edit_cache_lookups_total", tier="host") == 0
    assert cache.device is not None
    held = cache.device.bytes_used
    assert held > 0 and value("argus_worker_edit_cache_bytes", tier="device") == held


# -- sizes ---------------------------------------------------------------------------------


def test_auto_host_bytes_is_a_share_of_memory_with_a_floor() -> None:
    assert auto_host_bytes(128 * GiB) == 32 * GiB  # one 50-step SDXL record at 1024 px fits
    assert auto_host_bytes(128 * GiB) > 19.5 * GiB
    assert auto_host_bytes(2 * GiB) == defaults.EDIT_CACHE_HOST_FLOOR == GiB
    assert auto_host_bytes() >= GiB


def test_physical_memory_is_capped_by_a_cgroup_limit(tmp_path: Path) -> None:
    unlimited, limited, missing = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    unlimited.write_text("max\n")
    limited.write_text(f"{3 * GiB}\n")
    machine = physical_memory_bytes([missing])
    assert machine > 0 and physical_memory_bytes([unlimited]) == machine
    assert physical_memory_bytes([unlimited, limited]) == min(machine, 3 * GiB)


def test_auto_disk_bytes_is_half_the_free_space_plus_the_records_there(tmp_path: Path) -> None:
    class Usage:
        free = 100 * GiB

    directory = tmp_path / "records"
    assert auto_disk_bytes(directory, usage=lambda path: Usage) == 50 * GiB
    (directory / ("a" * 64 + ".safetensors")).write_bytes(b"x" * 2**20)
    (directory / "notes.txt").write_bytes(b"x" * 2**20)  # not a record
    assert auto_disk_bytes(directory, usage=lambda path: Usage) == 50 * GiB + 2**19
    Usage.free = 0
    assert auto_disk_bytes(directory, usage=lambda path: Usage) == 2**20  # a full disk


def test_auto_device_bytes_is_a_share_of_free_cuda_memory_and_0_elsewhere() -> None:
    assert auto_device_bytes("cpu") == 0
    assert auto_device_bytes("cuda:0", free=lambda device: 132 * GiB) == 33 * GiB


def test_explicit_bytes_override_auto_from_the_flag_to_the_store(tmp_path: Path) -> None:
    assert resolve_bytes(5, lambda: 7) == 5 and resolve_bytes("auto", lambda: 7) == 7
    with pytest.raises(ValueError, match="'lots'"):
        resolve_bytes("lots", lambda: 7)
    assert byte_bound("auto") == "auto" and byte_bound("4096") == 4096
    for bad in ("-1", "4k"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_bound(bad)
    with pytest.raises(ValueError, match="edit_cache_device_bytes"):
        WorkerSettings(edit_cache_device_bytes="lots")
    with pytest.raises(ValueError, match="edit_cache_bytes"):
        WorkerSettings(edit_cache_bytes=-1)
    settings = WorkerSettings(
        edit_cache_bytes=3 * GiB,
        edit_cache_dir=str(tmp_path / "d"),
        edit_cache_disk_bytes=5 * GiB,
        edit_cache_device_bytes=7,
    )
    cache = build_edit_cache(settings, None)
    assert cache is not None and cache.device is not None
    try:
        assert (cache.store.host_bytes, cache.store.disk_bytes) == (3 * GiB, 5 * GiB)
        assert cache.device.bound("cuda:0") == 7
    finally:
        cache.store.close()
    auto = build_edit_cache(WorkerSettings(edit_cache_dir=str(tmp_path / "e")), None)
    assert auto is not None and auto.device is not None
    try:
        assert auto.store.host_bytes == auto_host_bytes()
        assert auto.store.disk_bytes > 0 and auto.device.stats().max_bytes is None
    finally:
        auto.store.close()
    assert build_edit_cache(WorkerSettings(edit_cache_bytes=0), None) is None


# -- CUDA only -----------------------------------------------------------------------------


def cuda_model(variant: str) -> DiffusionModel:
    from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline

    source = TINY_PREFIX + variant
    pipeline = build_tiny_pipeline(source, "euler").to("cuda")  # float32: no fp16 overflow
    return DiffusionModel(variant, pipeline, device="cuda", source=source)


@needs_cuda
@pytest.mark.parametrize("variant", ["sdxl", "sd-1.5"])
def test_on_cuda_the_pinned_side_stream_path_gives_the_synchronous_latents(variant: str) -> None:
    """The record on the host (pageable: staged through pinned memory), replayed with the
    side stream, with plain copies, and copied per block; and the record on the device."""
    model = cuda_model(variant)
    spec = edit_spec(0.25, seed=2)
    region = latent_region(model, spec)
    record = template_record(model)
    assert all(rows.device.type == "cpu" for rows in record.outputs.values())
    results = []
    for stage, streamed in ((False, None), (True, False), (True, True)):
        predictor = ReplayPredictor(model, record, region, stage=stage, streamed=streamed)
        results.append(model.denoise(spec, predictor=predictor).latents)
    on_device = ActivationRecord(
        record.latent_size,
        record.coverage,
        {key: rows.to("cuda") for key, rows in record.outputs.items()},
    )
    predictor = ReplayPredictor(model, on_device, region, streamed=True)
    results.append(model.denoise(spec, predictor=predictor).latents)
    for latents in results[1:]:
        assert torch.equal(latents, results[0])


@needs_cuda
def test_on_cuda_a_recording_keeps_its_rows_on_the_device_equal_to_the_hosts() -> None:
    model = cuda_model("sdxl")
    recorder_spec = edit_spec(0.25, seed=5)
    region = torch.zeros_like(latent_region(model, recorder_spec))
    recorder = RecordingPredictor(model, region, device_bytes=GiB)
    model.denoise(recorder_spec, predictor=recorder)
    copied = recorder.device_copy.tensors()
    assert copied is not None
    for name, tensor in recorder.record.to_tensors().items():
        if name.startswith("s"):
            assert copied[name].device.type == "cuda"
        assert torch.equal(copied[name].cpu(), tensor), name


@needs_cuda
def test_on_cuda_staged_batches_equal_unstaged_ones() -> None:
    block = small_block().to("cuda", torch.float16)
    record = ActivationRecord((8, 8))
    for step in range(3):
        with torch.inference_mode(), recording(block, record, step, None):
            block(
                torch.randn(2, 64, 8, device="cuda", dtype=torch.float16),
                encoder_hidden_states=torch.randn(2, 3, 8, device="cuda", dtype=torch.float16),
            )
    x = torch.randn(4, 64, 8, device="cuda", dtype=torch.float16)
    ehs = torch.randn(4, 3, 8, device="cuda", dtype=torch.float16)
    outs: dict[bool, list[torch.Tensor]] = {}
    for stage in (False, True):
        replays = [Replay(block, record, region, stage=stage) for region in regions()]
        outs[stage] = []
        for step in range(3):
            parts = [RowPart(2, r, step) for r in replays]
            with torch.inference_mode(), batched_blocks([block], parts):
                outs[stage].append(block(x, encoder_hidden_states=ehs))
    torch.cuda.synchronize()
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)
