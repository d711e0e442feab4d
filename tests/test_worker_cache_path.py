"""The AC request path end to end in one process: tiny SDXL, MiniLM prompt embeddings, Qdrant
Edge and the latent store. A second request for the same prompt and seed resumes at K and
reproduces the first image; misses and bad latent files fall back to full generations."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from argus.contracts.generate import CacheOutcome, GenerateCall
from argus.embedding import PromptEmbedder
from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore
from tests.worker_factories import STEPS, make_worker

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def encoder() -> PromptEmbedder:
    return PromptEmbedder()


@pytest.fixture
def cached_worker(tmp_path: Path, encoder: PromptEmbedder) -> Iterator[Any]:
    cache = ApproximateCache(
        EdgeVectorIndex(tmp_path / "edge", encoder.dim, optimize_after=None),
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
