"""The mask-aware activation cache on the worker's request path
(argus/worker/editing/activation_cache.py):
the first inpainting edit of a template records its transformer blocks' outputs, later edits
of it replay them; img2img and adapters never use it; a record evicted while its edit waited
makes a full run, counted; the host tier counts in the memory guard.

Tiny real pipelines at 64 px and 4 steps (tests/editing_factories.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from argus.contracts.generate import GenerateCall
from argus.worker.editing.activation_cache import EditCache
from argus.worker.editing.activation_store import ActivationStore
from argus.worker.engine import Worker
from argus.worker.metrics import WorkerMetrics
from tests.editing_factories import STEPS, encode, mask_png, pixels, region_of, template_rgb
from tests.worker_factories import make_worker

pytestmark = pytest.mark.integration

PROMPT = "a red boat on a lake"


def edit_call(ratio: float, seed: int, template_seed: int = 7, **fields: Any) -> GenerateCall:
    fields.setdefault("steps", STEPS)
    return GenerateCall(
        prompt=PROMPT,
        seed=seed,
        image=encode(template_rgb(seed=template_seed)),
        mask=mask_png(region_of(ratio)),
        **fields,
    )


@pytest.fixture
def cached() -> Iterator[Worker]:
    made = make_worker(edit_cache=EditCache(ActivationStore(2**30)))
    yield made
    made.close()


def counts(worker: Worker) -> dict[str, int]:
    assert worker.edit_cache is not None
    return worker.edit_cache.counts()


def psnr(one: bytes, other: bytes) -> float:
    a, b = pixels(one).astype(np.float64), pixels(other).astype(np.float64)
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0.0 else 10.0 * np.log10(255.0**2 / mse)


def test_the_first_edit_of_a_template_records_and_the_next_replays(cached: Worker) -> None:
    cached.generate(edit_call(0.5, seed=1))
    cached.flush()
    assert counts(cached) == {"hit": 0, "miss": 1, "evicted": 0}
    assert cached.edit_cache is not None and cached.edit_cache.store.host_bytes_used > 0
    replayed = cached.generate(edit_call(0.25, seed=2))
    assert counts(cached) == {"hit": 1, "miss": 1, "evicted": 0}
    template = template_rgb()
    keep = ~region_of(0.25)
    assert np.array_equal(pixels(replayed.png)[keep], template[keep])
    full = make_worker()
    try:
        computed = full.generate(edit_call(0.25, seed=2))
    finally:
        full.close()
    assert replayed.png != computed.png  # replayed, not run in full
    # the tiny random models' error is an upper figure (tests/test_masked_blocks.py)
    assert psnr(replayed.png, computed.png) > 25.0


def test_another_template_step_count_or_cfg_mode_is_another_record(cached: Worker) -> None:
    cached.generate(edit_call(0.5, seed=1))
    cached.generate(edit_call(0.5, seed=1, template_seed=8))
    cached.generate(edit_call(0.5, seed=1, steps=STEPS + 1))
    cached.generate(edit_call(0.5, seed=1, guidance_scale=1.0))  # one CFG branch, not two
    assert counts(cached)["miss"] == 4 and counts(cached)["hit"] == 0


def test_img2img_and_adapters_never_use_it(cached: Worker) -> None:
    img2img = GenerateCall(
        prompt=PROMPT, steps=STEPS, image=encode(template_rgb()), strength=0.5, seed=1
    )
    cached.generate(img2img)
    cached.generate(img2img)
    assert counts(cached) == {"hit": 0, "miss": 0, "evicted": 0}


class EvictedInQueue(EditCache):
    """The record is there when the edit joins the queue and gone when it runs."""

    def queued(self, key: str) -> bool:
        present = super().queued(key)
        self.store.discard(key)
        return present


def test_an_edit_whose_record_was_evicted_in_the_queue_runs_in_full_counted() -> None:
    worker = make_worker(edit_cache=EvictedInQueue(ActivationStore(2**30)))
    try:
        worker.generate(edit_call(0.5, seed=1))
        worker.flush()
        answer = worker.generate(edit_call(0.25, seed=2))
        worker.flush()
        assert counts(worker) == {"hit": 0, "miss": 1, "evicted": 1}
        keep = ~region_of(0.25)
        assert np.array_equal(pixels(answer.png)[keep], template_rgb()[keep])
        assert worker.edit_cache is not None and worker.edit_cache.store.host_bytes_used > 0
    finally:
        worker.close()


def test_the_host_tier_counts_in_the_memory_guard(cached: Worker) -> None:
    models = cached.registry.used_bytes()
    cached.generate(edit_call(0.5, seed=1))
    cached.flush()
    assert cached.edit_cache is not None
    held = cached.edit_cache.store.host_bytes_used
    assert held > 0 and cached.registry.used_bytes() == models + held


def test_the_cache_is_visible_in_the_workers_metrics() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg).edit_cache
    worker = make_worker(edit_cache=EditCache(ActivationStore(2**30, listener=metrics), metrics))
    try:
        worker.generate(edit_call(0.5, seed=1))
        worker.flush()
        worker.generate(edit_call(0.25, seed=2))
    finally:
        worker.close()

    def value(name: str, **labels: str) -> float:
        found = reg.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("argus_worker_edit_cache_requests_total", outcome="miss") == 1
    assert value("argus_worker_edit_cache_requests_total", outcome="hit") == 1
    assert value("argus_worker_edit_cache_lookups_total", tier="host") == 1
    assert value("argus_worker_edit_cache_lookups_total", tier="miss") == 1
    held = value("argus_worker_edit_cache_bytes", tier="host")
    assert held > 0 and value("argus_worker_edit_cache_record_bytes_sum") == held
    assert value("argus_worker_edit_cache_record_bytes_count") == 1
