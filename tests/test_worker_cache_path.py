"""The AC request path end to end in one process: tiny SDXL, MiniLM prompt embeddings, Qdrant
Edge and the latent store. A second request for the same prompt and seed resumes at K and
reproduces the first image; the neighbour's similarity caps K below the routed level's, and
below the rule's floor it is not resumed at all; misses, bad latent files and an index that
is down fall back to full generations; the cache's changes ride on later replies."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from argus.contracts.generate import (
    CacheCursor,
    CacheEvict,
    CacheInsert,
    CacheOutcome,
    GenerateCall,
)
from argus.embedding import PromptEmbedder
from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore
from argus.worker.approx_cache.vector_index import OutageSwitch
from tests.worker_factories import STEPS, make_worker

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def encoder() -> PromptEmbedder:
    return PromptEmbedder()


@pytest.fixture
def cached_worker(tmp_path: Path, encoder: PromptEmbedder) -> Iterator[Any]:
    edge = EdgeVectorIndex(tmp_path / "edge", encoder.dim, optimize_after=None)
    cache = ApproximateCache(
        OutageSwitch(edge, tmp_path / "index-down"),  # the index is down while the file exists
        LatentStore(tmp_path / "latents", fsync=False),
        max_entries=100,
        max_bytes=None,
        registry=CollectorRegistry(),
    )
    worker = make_worker(cache=cache, encoder=encoder)
    yield worker
    worker.close()


def pixels(png: bytes) -> np.ndarray[Any, Any]:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def generate(worker: Any, prompt: str, level: str = "ac-k5", **kw: Any) -> Any:
    return worker.generate(GenerateCall(prompt, seed=kw.pop("seed", 4), level=level, **kw))


def test_a_repeat_prompt_resumes_at_k_and_reproduces_the_image(cached_worker: Any) -> None:
    first = generate(cached_worker, "a red bus in the snow")
    assert (first.cache, first.cache_miss_reason) == (CacheOutcome.MISS, "empty")
    assert (first.start_step, first.steps_run) == (0, STEPS)
    cached_worker.flush()
    stats = cached_worker.stats().cache
    assert stats.entries == 1
    assert stats.inserts == 1

    again = generate(cached_worker, "a red bus in the snow")
    assert again.cache is CacheOutcome.HIT
    assert (again.start_step, again.steps_run) == (5, STEPS - 5)
    assert again.similarity == pytest.approx(1.0, abs=1e-4)
    # resumed from the fp16 latent at K = 5: the same image up to a rounding step
    assert np.abs(pixels(again.png) - pixels(first.png)).max() <= 2
    assert cached_worker.stats().cache.hits == 1


def test_a_similar_prompt_reuses_the_neighbour(cached_worker: Any) -> None:
    generate(cached_worker, "a red bus in the snow", level="ac-k0")
    cached_worker.flush()
    near = generate(cached_worker, "a red bus driving through snow", level="ac-k5", seed=9)
    assert near.cache is CacheOutcome.HIT
    assert 0.5 < near.similarity < 1.0


def test_other_resolution_or_steps_do_not_match(cached_worker: Any) -> None:
    generate(cached_worker, "a lighthouse", level="ac-k0")
    cached_worker.flush()
    other_size = generate(cached_worker, "a lighthouse", width=32, height=32)
    assert (other_size.cache, other_size.cache_miss_reason) == (CacheOutcome.MISS, "no-match")
    other_steps = generate(cached_worker, "a lighthouse", steps=12)
    assert other_steps.cache is CacheOutcome.MISS


def test_corrupt_or_missing_latents_fall_back_and_are_counted(
    cached_worker: Any, tmp_path: Path
) -> None:
    generate(cached_worker, "a bowl of ramen", level="ac-k0")
    cached_worker.flush()
    files = sorted((tmp_path / "latents").rglob("*.safetensors"))
    assert len(files) == 1  # K = 5 only, since N = 10
    files[0].write_bytes(files[0].read_bytes()[:-7] + b"garbage")
    bad = generate(cached_worker, "a bowl of ramen")
    assert (bad.cache, bad.cache_miss_reason) == (CacheOutcome.MISS, "corrupt-latent")
    assert bad.steps_run == STEPS
    assert bad.png.startswith(b"\x89PNG")
    cached_worker.flush()  # the fallback's full generation re-stores the prompt
    files = sorted((tmp_path / "latents").rglob("*.safetensors"))
    for f in files:
        f.unlink()
    gone = generate(cached_worker, "a bowl of ramen")
    assert (gone.cache, gone.cache_miss_reason) == (CacheOutcome.MISS, "missing-latent")
    misses = cached_worker.stats().cache.misses
    assert misses["corrupt-latent"] == 1
    assert misses["missing-latent"] == 1
    assert cached_worker.stats().failed == 0


def test_k0_and_sm_levels_do_not_search(cached_worker: Any) -> None:
    full = generate(cached_worker, "a kite", level="ac-k0")
    assert full.cache is CacheOutcome.NOT_USED
    sm = generate(cached_worker, "a kite", level="sm-sd-xl")
    assert sm.cache is CacheOutcome.NOT_USED
    assert cached_worker.stats().cache.hits + sum(cached_worker.stats().cache.misses.values()) == 0


def test_a_full_run_of_sms_level_on_the_base_model_feeds_the_cache(cached_worker: Any) -> None:
    sm = generate(cached_worker, "a paper boat on a pond", level="sm-sd-xl")
    assert sm.cache is CacheOutcome.NOT_USED  # SM never looks up...
    cached_worker.flush()
    assert cached_worker.stats().cache.inserts == 1  # ...but its SDXL run is a K = 0 run
    again = generate(cached_worker, "a paper boat on a pond")
    assert (again.cache, again.start_step) == (CacheOutcome.HIT, 5)


def test_a_neighbour_below_the_floor_is_never_resumed(cached_worker: Any) -> None:
    generate(cached_worker, "a red bus in the snow", level="ac-k0")
    cached_worker.flush()
    far = generate(cached_worker, "a bowl of ramen", level="ac-k5")  # MiniLM cosine ≈ 0.1
    assert (far.cache, far.cache_miss_reason) == (CacheOutcome.MISS, "below-floor")
    assert (far.start_step, far.steps_run, far.routed_step) == (0, STEPS, 5)
    assert far.similarity is not None and 0.0 < far.similarity < 0.65  # the evidence, shown
    cached_worker.flush()  # a full generation: it feeds the cache as any miss does
    assert cached_worker.stats().cache.entries == 2


def test_the_neighbours_similarity_caps_k_below_the_routed_level(cached_worker: Any) -> None:
    n = 12  # the cache keeps K = 5 and 10 of 12 steps
    generate(cached_worker, "a lighthouse at dusk", level="ac-k0", steps=n)
    cached_worker.flush()
    # same subject, another scene (cosine ≈ 0.67): the default rule allows K = 5, not 10
    storm = generate(cached_worker, "a lighthouse on a cliff in a storm", level="ac-k10", steps=n)
    assert storm.cache is CacheOutcome.HIT
    assert (storm.start_step, storm.steps_run, storm.routed_step) == (5, n - 5, 10)
    assert storm.similarity is not None and 0.65 <= storm.similarity < 0.75
    # one attribute changed (cosine ≈ 0.86): the whole routed K
    dawn = generate(cached_worker, "a lighthouse at dawn", level="ac-k10", steps=n)
    assert (dawn.cache, dawn.start_step, dawn.routed_step) == (CacheOutcome.HIT, 10, 10)
    assert cached_worker.stats().cache.k_reduced == 1


def test_an_index_that_is_down_serves_in_full_as_a_counted_miss(
    cached_worker: Any, tmp_path: Path
) -> None:
    generate(cached_worker, "a red bus in the snow", level="ac-k0")
    cached_worker.flush()
    (tmp_path / "index-down").touch()
    down = generate(cached_worker, "a red bus in the snow")
    assert (down.cache, down.cache_miss_reason) == (CacheOutcome.MISS, "index-error")
    assert down.steps_run == STEPS and down.similarity is None and down.png.startswith(b"\x89PNG")
    assert cached_worker.stats().cache.misses["index-error"] == 1
    assert cached_worker.stats().failed == 0
    (tmp_path / "index-down").unlink()
    assert generate(cached_worker, "a red bus in the snow").cache is CacheOutcome.HIT


def test_inserts_and_evictions_ride_on_later_replies(
    cached_worker: Any, encoder: PromptEmbedder
) -> None:
    cursor = CacheCursor()
    first = generate(cached_worker, "a kite", level="ac-k0", cache_cursor=cursor)
    assert first.cache_events is not None and first.cache_events.events == ()  # not yet written
    cached_worker.flush()
    assert generate(cached_worker, "a boat", level="ac-k0").cache_events is None  # no cursor
    cached_worker.flush()
    cursor = CacheCursor(first.cache_events.log_id, first.cache_events.last)
    later = generate(cached_worker, "a kite", cache_cursor=cursor)  # a hit: changes nothing
    assert later.cache_events is not None and not later.cache_events.truncated
    kite, boat = later.cache_events.events
    assert isinstance(kite, CacheInsert) and isinstance(boat, CacheInsert)
    assert kite.tag == '["sdxl", "euler", 64, 64, 10]'  # the key: model, scheduler, size, N
    assert np.allclose(kite.embedding, encoder.embed_one("a kite"), atol=1e-6)

    cached_worker.cache.max_entries = 2  # the next insert evicts the least recently used
    cursor = CacheCursor(later.cache_events.log_id, later.cache_events.last)
    generate(cached_worker, "a bicycle", level="ac-k0")
    cached_worker.flush()
    evicting = generate(cached_worker, "a kite", cache_cursor=cursor).cache_events
    assert evicting is not None
    assert [type(e) for e in evicting.events] == [CacheInsert, CacheEvict]
    assert evicting.events[1].entry_id == boat.entry_id  # the kite was hit since
