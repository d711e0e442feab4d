"""The approximate cache: lookups and inserts, misses by reason, LRU eviction under entry and
byte bounds, restart recovery, metrics, threads; the latent store; Edge's background rebuild.

The behavioural tests run on both index implementations: Qdrant Edge in process and
qdrant-client's local mode (``QdrantClient(path=...)``), which stands in for a Qdrant server
since none can run here: the same client calls, a different engine behind them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from qdrant_client import QdrantClient

from argus.contracts.generate import (
    Adapter,
    AdapterKind,
    CacheCursor,
    CacheEvents,
    CacheEvict,
    CacheInsert,
    adapters_digest,
)
from argus.profiles.cache_evidence import KRule
from argus.worker.approx_cache.cache import (
    MISS_REASONS,
    ApproximateCache,
    CacheHit,
    CacheKey,
    CacheMiss,
)
from argus.worker.approx_cache.events import CacheEventLog
from argus.worker.approx_cache.latent_store import (
    LatentCorruptError,
    LatentMissingError,
    LatentStore,
    encode_latent,
)
from argus.worker.approx_cache.vector_index import (
    CURRENT,
    LOCK_FILE,
    EdgeIndexConfig,
    EdgeVectorIndex,
    IndexMatch,
    QdrantServerIndex,
    VectorIndex,
)

pytestmark = pytest.mark.unit


DIM = 16
LORA = AdapterKind.LORA
KEY = CacheKey("sd-1.5", "euler", 64, 64, 30)
STEPS = (5, 10, 15, 20, 25)
SHAPE = (1, 4, 8, 8)
ENTRY_BYTES = 5 * len(encode_latent(torch.zeros(SHAPE)))  # five latent files per entry


def unit(seed: int) -> np.ndarray[Any, Any]:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def near(vector: np.ndarray[Any, Any], seed: int, scale: float = 0.05) -> np.ndarray[Any, Any]:
    return vector + scale * unit(10_000 + seed)


def latents(seed: int, steps: tuple[int, ...] = STEPS) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 3 * torch.randn(SHAPE, generator=g) for k in steps}


def latent_files(root: Path) -> set[str]:
    return {p.name for p in (root / "latents").rglob("*.safetensors")}


class Backend:
    """Opens indexes of one kind over ``root``; reopening is a worker restart."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind, self.root = kind, root
        self._clients: list[Any] = []

    def index(self, dim: int = DIM) -> VectorIndex:
        if self.kind == "edge":
            return EdgeVectorIndex(self.root / "edge", dim, optimize_after=None)
        self.close_clients()  # local mode holds a file lock on its directory
        client = QdrantClient(path=str(self.root / "qdrant"), force_disable_check_same_thread=True)
        self._clients.append(client)
        return QdrantServerIndex(client, "prompts", dim)

    def cache(self, **kwargs: Any) -> ApproximateCache:
        kwargs.setdefault("max_entries", 100)
        kwargs.setdefault("max_bytes", None)
        kwargs.setdefault("registry", CollectorRegistry())
        store = LatentStore(self.root / "latents", fsync=False)
        return ApproximateCache(self.index(), store, **kwargs)

    def close_clients(self) -> None:
        while self._clients:
            self._clients.pop().close()


@pytest.fixture(params=["edge", "qdrant-local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b = Backend(request.param, tmp_path)
    yield b
    b.close_clients()


@pytest.fixture
def cache(backend: Backend) -> Iterator[ApproximateCache]:
    c = backend.cache()
    yield c
    c.close()


# -- lookups ----------------------------------------------------------------------------------


def test_round_trip_returns_the_stored_fp16_values(cache: ApproximateCache) -> None:
    stored = latents(1)
    entry = cache.insert(unit(1), KEY, "a red bus in the snow", stored)
    assert entry is not None
    for k in STEPS:
        found = cache.lookup(unit(1), KEY, k)
        assert isinstance(found, CacheHit)
        assert (found.step, found.entry_id) == (k, entry)
        assert found.similarity == pytest.approx(1.0, abs=1e-5)
        assert found.latent.dtype is torch.float32 and found.latent.shape == SHAPE
        assert torch.equal(found.latent, stored[k].half().float())
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.hits, stats.inserts) == (1, ENTRY_BYTES, 5, 1)


def test_the_nearest_entry_of_the_key_wins(cache: ApproximateCache) -> None:
    ids = [cache.insert(unit(s), KEY, f"prompt {s}", latents(s)) for s in range(5)]
    for s in range(5):
        found = cache.lookup(near(unit(s), s), KEY, 10)
        assert isinstance(found, CacheHit)
        assert found.entry_id == ids[s]
        assert 0.9 < found.similarity < 1.0


def test_an_empty_cache_misses_as_empty(cache: ApproximateCache) -> None:
    found = cache.lookup(unit(1), KEY, 5)
    assert isinstance(found, CacheMiss)
    assert (found.reason, found.fetch_s) == ("empty", 0.0)


@pytest.mark.parametrize(
    "other",
    [
        CacheKey("sd-xl", "euler", 64, 64, 30),
        CacheKey("sd-1.5", "ddim", 64, 64, 30),
        CacheKey("sd-1.5", "euler", 64, 32, 30),
        CacheKey("sd-1.5", "euler", 32, 64, 30),
        CacheKey("sd-1.5", "euler", 64, 64, 50),
        CacheKey("sd-1.5", "euler", 64, 64, 30, adapters_digest([Adapter(LORA, "ink", 1.0)])),
    ],
    ids=["model", "scheduler", "width", "height", "steps", "lora"],
)
def test_entries_only_match_requests_with_the_same_key(
    cache: ApproximateCache, other: CacheKey
) -> None:
    cache.insert(unit(1), KEY, "a lighthouse", latents(1))
    found = cache.lookup(unit(1), other, 5)
    assert isinstance(found, CacheMiss) and found.reason == "no-match"
    assert isinstance(cache.lookup(unit(1), KEY, 5), CacheHit)


def at_similarity(vector: np.ndarray[Any, Any], s: float, seed: int = 7) -> np.ndarray[Any, Any]:
    """A unit vector whose cosine similarity to the unit ``vector`` is exactly ``s``."""
    other = unit(20_000 + seed)
    other = other - float(other @ vector) * vector
    other /= np.linalg.norm(other)
    return (s * vector + np.sqrt(1.0 - s * s) * other).astype(np.float32)


def test_a_neighbour_below_the_floor_is_a_miss_with_its_similarity(backend: Backend) -> None:
    cache = backend.cache()  # DEFAULT_RULE: K = 5 needs 0.65
    try:
        cache.insert(unit(1), KEY, "a lighthouse", latents(1))
        far = cache.lookup(at_similarity(unit(1), 0.6), KEY, 25)
        assert isinstance(far, CacheMiss) and far.reason == "below-floor"
        assert far.similarity == pytest.approx(0.6, abs=1e-4)
        assert far.fetch_s == 0.0  # nothing was read
        assert cache.stats().misses["below-floor"] == 1 and cache.stats().hits == 0
    finally:
        cache.close()


@pytest.mark.parametrize(
    ("similarity", "ceiling", "step"),
    [
        (0.70, 25, 5),  # same subject: only the layout steps
        (0.80, 25, 10),
        (0.85, 25, 15),
        (0.90, 25, 20),
        (0.95, 25, 25),  # a near paraphrase may skip all the level asks
        (0.95, 10, 10),  # never above the routed K
        (0.80, 12, 10),  # a ceiling between cached steps: the cached step below it
    ],
)
def test_the_rule_resumes_where_the_similarity_allows_never_above_the_ceiling(
    cache: ApproximateCache, similarity: float, ceiling: int, step: int
) -> None:
    stored = latents(1)
    cache.insert(unit(1), KEY, "a lighthouse at dusk", stored)
    found = cache.lookup(at_similarity(unit(1), similarity), KEY, ceiling)
    assert isinstance(found, CacheHit)
    assert found.step == step and found.similarity == pytest.approx(similarity, abs=1e-4)
    assert torch.equal(found.latent, stored[step].half().float())
    largest = max(k for k in STEPS if k <= ceiling)
    assert cache.stats().k_reduced == (1 if step < largest else 0)


def test_each_model_has_its_own_rule(backend: Backend) -> None:
    strict = KRule(((5, 0.99), (10, 0.995)))
    cache = backend.cache(rules={"sd-1.5": strict}, default_rule=KRule(((5, -1.0),)))
    try:
        other_model = CacheKey("tiny-sd", "euler", 64, 64, 30)
        for key in (KEY, other_model):
            cache.insert(unit(1), key, "a lighthouse", latents(1))
        near_one = at_similarity(unit(1), 0.95)
        found = cache.lookup(near_one, KEY, 10)
        assert isinstance(found, CacheMiss) and found.reason == "below-floor"
        lenient = cache.lookup(near_one, other_model, 10)  # the default rule: K = 5 only
        assert isinstance(lenient, CacheHit) and lenient.step == 5
    finally:
        cache.close()


def test_the_workers_rules_come_from_the_profile_and_min_similarity_only_raises_them() -> None:
    from argus.profiles.cache_evidence import DEFAULT_RULE
    from argus.worker.app import WorkerSettings, cache_rules

    rules, default = cache_rules(WorkerSettings())
    assert rules["sdxl"].floors == DEFAULT_RULE.floors and default is DEFAULT_RULE
    strict, _ = cache_rules(WorkerSettings(min_similarity=0.8))
    assert strict["sdxl"].floors == ((5, 0.8), (10, 0.8), (15, 0.82), (20, 0.88), (25, 0.93))
    assert cache_rules(WorkerSettings(min_similarity=-1.0))[0]["sdxl"] == rules["sdxl"]
    with pytest.raises(ValueError, match="min_similarity"):
        WorkerSettings(min_similarity=1.5)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x01]) + data[-2:])
    elif how == "emptied":
        path.write_bytes(b"")


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("deleted", "missing-latent"),
        ("truncated", "corrupt-latent"),
        ("flipped", "corrupt-latent"),
        ("emptied", "corrupt-latent"),
    ],
)
def test_a_damaged_latent_is_a_counted_miss_and_its_entry_is_purged(
    backend: Backend, cache: ApproximateCache, how: str, reason: str
) -> None:
    stored = latents(1)
    entry = cache.insert(unit(1), KEY, "a bowl of ramen", stored)
    assert entry is not None
    damage(cache.store.path(_digest_of(cache, stored[10])), how)

    found = cache.lookup(unit(1), KEY, 10)  # never raises
    assert isinstance(found, CacheMiss) and found.reason == reason
    assert isinstance(cache.lookup(unit(1), KEY, 15), CacheHit)  # other K of the entry are fine
    stats = cache.stats()
    assert stats.misses[reason] == 1
    assert sum(stats.misses.values()) == 1 and stats.hits == 1

    # the next insert (the writer path) purges the broken entry and its files
    cache.insert(unit(2), KEY, "a kite", latents(2))
    assert cache.recency_order() == [cid for cid in cache.recency_order() if cid != entry]
    assert len(cache) == 1 and cache.index.count() == 1
    assert len(latent_files(backend.root)) == 5
    # re-caching the same prompt writes a sound file again
    cache.insert(unit(1), KEY, "a bowl of ramen", stored)
    again = cache.lookup(unit(1), KEY, 10)
    assert isinstance(again, CacheHit) and torch.equal(again.latent, stored[10].half().float())


def test_a_point_the_cache_does_not_know_is_deleted_once_found_broken(
    cache: ApproximateCache,
) -> None:
    # an eviction whose point delete failed leaves a point whose files are gone
    orphan = "00000000-0000-0000-0000-00000000beef"
    payload = {"key": KEY.tag, "latents": {"5": "ab" * 32}, "latent_bytes": 1, "last_used": 1}
    cache.index.upsert(orphan, unit(1), payload | {"schema": 1})
    found = cache.lookup(unit(1), KEY, 5)
    assert isinstance(found, CacheMiss) and found.reason == "missing-latent"
    cache.insert(unit(2), KEY, "a kite", latents(2))  # the writer path deletes the orphan
    assert cache.index.count() == 1
    assert isinstance(cache.lookup(unit(2), KEY, 5), CacheHit)


def _digest_of(cache: ApproximateCache, latent: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(encode_latent(latent)).hexdigest()


class FailingIndex:
    """A VectorIndex whose searches fail, as a Qdrant server that went away."""

    dim = DIM

    def search(self, vector: Any, key: str) -> IndexMatch | None:
        raise ConnectionError("qdrant unreachable")

    def upsert(self, point_id: str, vector: Any, payload: Any) -> None:
        raise ConnectionError("qdrant unreachable")

    def set_payload(self, updates: Any) -> None: ...

    def delete(self, point_ids: Any) -> None: ...

    def scroll(self, batch: int = 1024) -> Iterator[Any]:
        return iter(())

    def count(self) -> int:
        return 0

    def close(self) -> None: ...


def test_an_index_failure_is_a_miss_and_a_failed_insert_leaves_no_files(tmp_path: Path) -> None:
    cache = ApproximateCache(
        FailingIndex(),
        LatentStore(tmp_path / "latents", fsync=False),
        max_entries=10,
        max_bytes=None,
        registry=CollectorRegistry(),
    )
    found = cache.lookup(unit(1), KEY, 5)
    assert isinstance(found, CacheMiss) and found.reason == "index-error"
    with pytest.raises(ConnectionError):
        cache.insert(unit(1), KEY, "a kite", latents(1))
    assert latent_files(tmp_path) == set()
    assert cache.stats().misses["index-error"] == 1
    cache.close()


def test_lookups_after_close_are_index_errors(backend: Backend) -> None:
    cache = backend.cache()
    cache.insert(unit(1), KEY, "a kite", latents(1))
    cache.close()
    cache.close()  # idempotent
    found = cache.lookup(unit(1), KEY, 5)
    assert isinstance(found, CacheMiss) and found.reason == "index-error"


def test_programming_errors_raise(cache: ApproximateCache) -> None:
    with pytest.raises(ValueError, match="shape"):
        cache.lookup(np.ones(DIM + 1, np.float32), KEY, 5)
    with pytest.raises(ValueError, match="zero vector"):
        cache.lookup(np.zeros(DIM, np.float32), KEY, 5)
    with pytest.raises(ValueError, match="no cached step"):
        cache.lookup(unit(1), KEY, 3)
    with pytest.raises(ValueError, match="K < N"):
        cache.lookup(unit(1), CacheKey("m", "euler", 64, 64, 10), 10)
    with pytest.raises(ValueError, match="K < N"):
        cache.lookup(unit(1), KEY, 0)
    with pytest.raises(ValueError, match="missing"):
        cache.insert(unit(1), KEY, "a kite", latents(1, (5, 10)))
    with pytest.raises(ValueError, match="finite"):
        cache.insert(unit(1), KEY, "a kite", {k: torch.full(SHAPE, 1e6) for k in STEPS})
    with pytest.raises(ValueError, match="positive"):
        CacheKey("m", "euler", 0, 64, 10)
    assert latent_files(Path(cache.store.root).parent) == set()


# -- inserts -----------------------------------------------------------------------------------


def test_insert_keeps_only_cached_steps_below_n(backend: Backend, cache: ApproximateCache) -> None:
    short = CacheKey("sd-1.5", "euler", 64, 64, 12)  # N = 12: K = 5 and 10 only
    entry = cache.insert(unit(1), short, "a kite", latents(1, (1, 5, 7, 10, 11)))
    assert entry is not None
    assert len(latent_files(backend.root)) == 2
    assert isinstance(cache.lookup(unit(1), short, 10), CacheHit)
    tiny = CacheKey("sd-1.5", "euler", 64, 64, 5)  # N = 5: no cached K below it
    assert cache.insert(unit(2), tiny, "a bus", latents(2)) is None
    assert len(cache) == 1


def test_a_cached_prompt_is_refreshed_not_duplicated(cache: ApproximateCache) -> None:
    first = cache.insert(unit(1), KEY, "a kite", latents(1))
    cache.insert(unit(2), KEY, "a bus", latents(2))
    again = cache.insert(unit(1), KEY, "a kite", latents(3))
    assert again == first
    assert (len(cache), cache.stats().inserts) == (2, 2)
    assert cache.recency_order()[-1] == first
    # another prompt with the same embedding is its own entry
    assert cache.insert(unit(1), KEY, "a kite!", latents(4)) != first


def test_identical_latents_share_files_until_the_last_entry_goes(backend: Backend) -> None:
    cache = backend.cache(max_entries=2)
    try:
        same = latents(1)
        cache.insert(unit(1), KEY, "a kite", same)
        cache.insert(unit(2), KEY, "a kite, again", same)
        assert len(latent_files(backend.root)) == 5
        assert cache.stats().bytes == 2 * ENTRY_BYTES  # each entry counts its files
        cache.insert(unit(3), KEY, "a bus", latents(3))  # evicts the first kite
        assert len(latent_files(backend.root)) == 10  # still used by the second
        cache.insert(unit(4), KEY, "a boat", latents(4))  # evicts the second
        assert len(latent_files(backend.root)) == 10
        assert isinstance(cache.lookup(unit(3), KEY, 5), CacheHit)
    finally:
        cache.close()


# -- eviction ----------------------------------------------------------------------------------


def test_lru_eviction_with_an_entry_bound(backend: Backend) -> None:
    cache = backend.cache(max_entries=3)
    try:
        a, b, c = (cache.insert(unit(s), KEY, f"prompt {s}", latents(s)) for s in (1, 2, 3))
        assert isinstance(cache.lookup(unit(1), KEY, 5), CacheHit)  # a is now the most recent
        assert cache.recency_order() == [b, c, a]
        d = cache.insert(unit(4), KEY, "prompt 4", latents(4))
        assert cache.recency_order() == [c, a, d]  # b was least recently used
        stats = cache.stats()
        assert (stats.entries, stats.evictions, stats.bytes) == (3, 1, 3 * ENTRY_BYTES)
        assert len(latent_files(backend.root)) == 15  # b's files are gone
        assert cache.index.count() == 3
        found = cache.lookup(unit(2), KEY, 5)  # b's own embedding now finds another entry
        assert not isinstance(found, CacheHit) or found.entry_id != b
    finally:
        cache.close()


def test_lru_eviction_with_a_byte_bound(backend: Backend) -> None:
    cache = backend.cache(max_entries=None, max_bytes=int(2.5 * ENTRY_BYTES))
    try:
        ids = [cache.insert(unit(s), KEY, f"prompt {s}", latents(s)) for s in range(3)]
        assert cache.recency_order() == ids[1:]
        assert cache.stats().bytes == 2 * ENTRY_BYTES <= cache.max_bytes  # type: ignore[operator]
        assert len(latent_files(backend.root)) == 10
        cache.lookup(unit(1), KEY, 5)  # refresh the older of the two
        cache.insert(unit(3), KEY, "prompt 3", latents(3))
        assert cache.recency_order() == [ids[1], cache.recency_order()[-1]]
        assert cache.stats().evictions == 2
    finally:
        cache.close()


def test_an_entry_larger_than_the_byte_bound_is_not_cached(backend: Backend) -> None:
    cache = backend.cache(max_bytes=ENTRY_BYTES - 1)
    try:
        assert cache.insert(unit(1), KEY, "a kite", latents(1)) is None
        assert len(cache) == 0 and latent_files(backend.root) == set()
    finally:
        cache.close()


# -- restart -----------------------------------------------------------------------------------


def test_restart_recovers_entries_bytes_and_recency(backend: Backend) -> None:
    cache = backend.cache(max_entries=10)
    ids = [cache.insert(unit(s), KEY, f"prompt {s}", latents(s)) for s in range(4)]
    cache.lookup(unit(0), KEY, 5)
    cache.lookup(unit(2), KEY, 5)
    order = cache.recency_order()
    assert order == [ids[1], ids[3], ids[0], ids[2]]
    cache.close()  # persists last_used
    # an orphan file (written before a crash, never indexed) and a stray temporary file
    store = LatentStore(backend.root / "latents")
    orphan = store.put(torch.ones(SHAPE)).digest
    (store.path(orphan).parent / ".tmp-stray").write_bytes(b"partial")

    reopened = backend.cache(max_entries=10)
    try:
        assert reopened.recency_order() == order
        stats = reopened.stats()
        assert (stats.entries, stats.bytes) == (4, 4 * ENTRY_BYTES)
        assert not store.path(orphan).exists()
        assert len(list((backend.root / "latents").rglob(".tmp-*"))) == 0
        assert len(latent_files(backend.root)) == 20
        hit = reopened.lookup(unit(3), KEY, 20)
        assert isinstance(hit, CacheHit) and hit.entry_id == ids[3]
        assert torch.equal(hit.latent, latents(3)[20].half().float())
        reopened.insert(unit(9), KEY, "prompt 9", latents(9))
        assert reopened.recency_order()[-2:] == [ids[3], reopened.recency_order()[-1]]
    finally:
        reopened.close()

    smaller = backend.cache(max_entries=2)  # a tighter bound evicts at open, LRU first
    try:
        assert smaller.recency_order()[0] == ids[3]
        assert smaller.stats().evictions == 3
        assert len(latent_files(backend.root)) == 10
    finally:
        smaller.close()


def test_reopening_with_another_dimension_fails(backend: Backend) -> None:
    backend.cache().close()
    with pytest.raises(Exception, match=r"16|dim|size"):  # the engines raise differently
        backend.index(dim=DIM * 2)


# -- the event log for routers' mirrors -------------------------------------------------------


def test_inserts_and_evictions_are_published_in_order(backend: Backend) -> None:
    cache = backend.cache(max_entries=2)
    try:
        start = CacheCursor()
        assert cache.events.since(start).events == ()
        a, b, c = (cache.insert(unit(s), KEY, f"prompt {s}", latents(s)) for s in (1, 2, 3))
        got = cache.events.since(start)
        assert [type(e) for e in got.events] == [CacheInsert, CacheInsert, CacheInsert, CacheEvict]
        assert [e.entry_id for e in got.events] == [a, b, c, a]  # c's insert evicted a
        first = got.events[0]
        assert isinstance(first, CacheInsert) and first.tag == KEY.tag
        assert np.array_equal(np.array(first.embedding, np.float32), unit(1))
        assert (got.last, got.truncated) == (4, False)
        # a caller up to date gets nothing more; a refresh of a cached prompt is no change
        cursor = CacheCursor(got.log_id, got.last)
        cache.insert(unit(2), KEY, "prompt 2", latents(2))
        assert cache.events.since(cursor) == CacheEvents(got.log_id, 4)
        # an entry purged for a bad latent file leaves the mirror too
        damage(cache.store.path(_digest_of(cache, latents(3)[5])), "deleted")
        assert isinstance(cache.lookup(unit(3), KEY, 5), CacheMiss)
        cache.insert(unit(4), KEY, "prompt 4", latents(4))
        later = cache.events.since(cursor).events
        assert [(type(e), e.entry_id) for e in later][:1] == [(CacheEvict, c)]
    finally:
        cache.close()


def test_a_log_past_its_bound_says_truncated_and_pages_replies() -> None:
    log = CacheEventLog(3, per_reply=2, log_id="log-a")
    log.evicted(f"e{i}" for i in range(1, 6))  # numbers 1 … 5; 1 and 2 fall out
    behind = log.since(CacheCursor("log-a", 0))
    assert behind.truncated and [e.entry_id for e in behind.events] == ["e3", "e4"]
    assert behind.last == 4
    rest = log.since(CacheCursor("log-a", behind.last))
    assert not rest.truncated and [e.entry_id for e in rest.events] == ["e5"]
    assert rest.last == 5
    assert log.since(CacheCursor("log-a", 5)) == CacheEvents("log-a", 5)
    # a cursor of another log (an earlier process) reads as 0
    assert log.since(CacheCursor("log-b", 5)) == behind


def test_a_recovered_cache_starts_its_log_with_a_gap(backend: Backend) -> None:
    cache = backend.cache()
    cache.insert(unit(1), KEY, "a kite", latents(1))
    before = cache.events.log_id
    cache.close()
    reopened = backend.cache()
    try:
        assert reopened.events.log_id != before
        fresh = reopened.events.since(CacheCursor())
        assert fresh.truncated and fresh.events == ()  # the kite was never published
        entry = reopened.insert(unit(2), KEY, "a bus", latents(2))
        after = reopened.events.since(CacheCursor(fresh.log_id, fresh.last))
        assert not after.truncated and [e.entry_id for e in after.events] == [entry]
    finally:
        reopened.close()


# -- metrics, stats, threads -------------------------------------------------------------------


def test_metrics_appear_in_the_registry_with_both_phases(backend: Backend) -> None:
    registry = CollectorRegistry()
    ticks = itertools.count()
    cache = backend.cache(registry=registry, max_entries=1, timer=lambda: next(ticks) * 1e-3)
    sample = registry.get_sample_value
    for phase in ("search", "fetch"):
        assert sample("argus_worker_cache_retrieval_seconds_count", {"phase": phase}) == 0
    for reason in MISS_REASONS:
        assert sample("argus_worker_cache_misses_total", {"reason": reason}) == 0

    cache.lookup(unit(1), KEY, 5)  # empty
    cache.insert(unit(1), KEY, "a kite", latents(1))
    cache.lookup(unit(1), KEY, 5)  # hit
    cache.insert(unit(2), KEY, "a bus", latents(2))  # evicts the kite

    assert sample("argus_worker_cache_retrieval_seconds_count", {"phase": "search"}) == 2
    assert sample("argus_worker_cache_retrieval_seconds_count", {"phase": "fetch"}) == 1
    assert sample("argus_worker_cache_hits_total") == 1
    assert sample("argus_worker_cache_misses_total", {"reason": "empty"}) == 1
    assert sample("argus_worker_cache_evictions_total") == 1
    assert sample("argus_worker_cache_entries") == 1
    assert sample("argus_worker_cache_bytes") == ENTRY_BYTES
    assert sample("argus_worker_cache_similarity_count") == 1  # the empty lookup found none
    assert sample("argus_worker_cache_similarity_bucket", {"le": "0.99"}) == 0  # it was 1.0
    assert sample("argus_worker_cache_k_reduced_total") == 0
    stats = cache.stats()
    # the fake timer advances 1 ms per reading: every search and fetch took 1 ms
    assert (stats.search_p50_s, stats.search_p99_s, stats.window) == (1e-3, 1e-3, 2)
    assert (stats.fetch_p50_s, stats.fetch_p99_s) == (1e-3, 1e-3)
    assert (stats.hits, sum(stats.misses.values())) == (1, 1)
    cache.close()
    assert sample("argus_worker_cache_hits_total") is None  # unregistered
    backend.cache(registry=registry).close()  # so a new cache can register again


def test_concurrent_lookups_and_inserts(backend: Backend) -> None:
    cache = backend.cache(max_entries=8)
    errors: list[BaseException] = []
    results: list[CacheHit | CacheMiss] = []
    done = threading.Event()

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)

        return run

    def writer() -> None:
        for s in range(24):
            cache.insert(unit(s), KEY, f"prompt {s}", latents(s))
        done.set()

    def reader(offset: int) -> None:
        s = offset
        while not done.is_set() or s < offset + 30:
            results.append(cache.lookup(near(unit(s % 24), s), KEY, STEPS[s % 5]))
            s += 1

    threads = [threading.Thread(target=guarded(writer))]
    threads += [threading.Thread(target=guarded(lambda o=o: reader(o))) for o in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        stats = cache.stats()
        assert stats.hits + sum(stats.misses.values()) == len(results)
        assert stats.hits == sum(isinstance(r, CacheHit) for r in results) > 0
        assert all(r.reason in MISS_REASONS for r in results if isinstance(r, CacheMiss))
        assert (stats.entries, stats.evictions) == (8, 16)
        assert cache.index.count() == 8
        assert len(latent_files(backend.root)) == 8 * 5
    finally:
        cache.close()


# -- the latent store --------------------------------------------------------------------------


def test_store_is_content_addressed_with_a_two_level_fanout(tmp_path: Path) -> None:
    store = LatentStore(tmp_path)
    latent = torch.randn(SHAPE)
    stored = store.put(latent)
    path = store.path(stored.digest)
    assert (
        path == tmp_path / stored.digest[:2] / stored.digest[2:4] / f"{stored.digest}.safetensors"
    )
    assert path.stat().st_size == stored.nbytes
    assert torch.equal(store.get(stored.digest), latent.half().float())
    assert store.put(latent.clone()).digest == stored.digest  # same bytes, same file
    assert store.release(stored.digest) is False and path.exists()  # one reference is left
    assert store.release(stored.digest) is True and not path.exists()
    with pytest.raises(LatentMissingError):
        store.get(stored.digest)


def test_store_rejects_digests_that_are_not_sha256(tmp_path: Path) -> None:
    store = LatentStore(tmp_path)
    for bad in ("../../etc/passwd", "ab" * 31, "AB" * 32, ""):
        with pytest.raises(LatentCorruptError):
            store.get(bad)


def test_store_replaces_a_damaged_file_instead_of_sharing_it(tmp_path: Path) -> None:
    store = LatentStore(tmp_path)
    latent = torch.randn(SHAPE)
    digest = store.put(latent).digest
    damage(store.path(digest), "flipped")
    with pytest.raises(LatentCorruptError):
        store.get(digest)
    assert store.put(latent).digest == digest
    assert torch.equal(store.get(digest), latent.half().float())


def test_store_never_unpickles(tmp_path: Path) -> None:
    import hashlib
    import pickle

    store = LatentStore(tmp_path)
    data = pickle.dumps({"latent": torch.ones(SHAPE)})
    digest = hashlib.sha256(data).hexdigest()  # a file whose name matches its bytes
    store.path(digest).parent.mkdir(parents=True)
    store.path(digest).write_bytes(data)
    with pytest.raises(LatentCorruptError, match="safetensors"):
        store.get(digest)


# -- Qdrant Edge: background rebuild -----------------------------------------------------------


def edge_points(index: EdgeVectorIndex, seeds: range) -> None:
    for s in seeds:
        index.upsert(f"00000000-0000-0000-0000-{s:012d}", unit(s), {"key": "k", "n": s})


def test_edge_rebuilds_in_a_child_and_keeps_updates_made_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = EdgeVectorIndex(
        tmp_path / "edge",
        DIM,
        optimize_after=40,
        config=EdgeIndexConfig(indexing_threshold_kb=1),
    )
    gate = threading.Event()
    real = index._optimize_in_child

    def held(target: Path) -> None:
        gate.wait(30)
        real(target)

    monkeypatch.setattr(index, "_optimize_in_child", held)
    edge_points(index, range(40))  # the 40th update starts a rebuild on a copy
    first = index.generation_dir
    edge_points(index, range(40, 50))  # during the rebuild: the live shard and the journal
    index.delete(["00000000-0000-0000-0000-000000000003"])
    index.set_payload({"00000000-0000-0000-0000-000000000004": {"hit": True}})
    gate.set()
    assert index.wait_for_rebuild(60)
    assert index.rebuilds == 1
    assert index.generation_dir != first and not first.exists()
    assert (tmp_path / "edge" / CURRENT).read_text() == index.generation_dir.name
    assert index.info().indexed_vectors_count > 0  # the child built an HNSW graph
    assert index.count() == 49
    for s in (0, 3, 4, 45):
        match = index.search(unit(s), "k")
        assert match is not None
        assert (match.payload["n"] == s) == (s != 3)
    four = index.search(unit(4), "k")
    assert four is not None and four.payload.get("hit") is True
    index.close()

    reopened = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=None)
    assert reopened.count() == 49
    assert sorted(p.name for p in (tmp_path / "edge").iterdir()) == sorted(
        [CURRENT, LOCK_FILE, reopened.generation_dir.name]
    )
    reopened.close()


def test_edge_refuses_a_second_opener_without_touching_the_first(tmp_path: Path) -> None:
    index = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=None)
    edge_points(index, range(3))
    (tmp_path / "edge" / "gen-000001").mkdir()  # as a running rebuild's copy would be
    with pytest.raises(Exception, match=r"WAL|lock|WouldBlock"):
        EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=None)
    assert (tmp_path / "edge" / "gen-000001").exists()
    assert index.count() == 3
    index.close()


def test_edge_close_during_a_rebuild_keeps_the_live_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=10)
    started = threading.Event()
    real = index._optimize_in_child

    def held(target: Path) -> None:
        started.set()
        real(target)

    monkeypatch.setattr(index, "_optimize_in_child", held)
    edge_points(index, range(10))
    assert started.wait(30)
    index.close()
    reopened = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=None)
    assert reopened.count() == 10
    assert [p.name for p in (tmp_path / "edge").glob("gen-*")] == ["gen-000000"]
    reopened.close()


def test_edge_rebuilds_when_dead_points_reach_a_share_of_the_live_ones(tmp_path: Path) -> None:
    """A full cache evicts one entry per insert: the dead points must be dropped by a rebuild
    long before ``optimize_after`` updates (the soak's workers grew until the first one)."""
    index = EdgeVectorIndex(
        tmp_path / "edge", DIM, optimize_after=10_000, vacuum_ratio=2.0, vacuum_min=20
    )
    edge_points(index, range(10))  # 10 live points: 10 changes, no rebuild
    assert index.rebuilds == 0 and index.wait_for_rebuild(0)
    for s in range(10, 16):  # churn: each insert evicts the oldest point (2 changes)
        edge_points(index, range(s, s + 1))
        index.delete([f"00000000-0000-0000-0000-{s - 10:012d}"])
    assert index.wait_for_rebuild(60)  # the 20th change (2 x 10 live) started one
    assert index.rebuilds == 1
    assert index.count() == 10
    assert index.info().points_count == 10  # recounted from the rebuilt shard
    index.close()


def test_edge_shards_keep_no_write_ahead_log_across_rebuilds(tmp_path: Path) -> None:
    """Edge's log is two preallocated, memory-mapped 32 MB files that a rebuild's copy
    carried from generation to generation, its mapped pages growing in the worker's memory
    by about 2 KB an update: shards the index creates, and the rebuilds of them, have none."""
    index = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=10)
    first = index.generation_dir
    assert not (first / "wal").exists()
    edge_points(index, range(10))
    assert index.wait_for_rebuild(60) and index.rebuilds == 1
    assert index.generation_dir != first
    assert not (index.generation_dir / "wal").exists()
    assert index.count() == 10
    index.close()


CRASHING_OPENER = """
import os, sys
import numpy as np
from argus.worker.approx_cache.vector_index import EdgeVectorIndex

def unit(seed):
    v = np.random.default_rng(seed).standard_normal({dim}).astype(np.float32)
    return v / np.linalg.norm(v)

index = EdgeVectorIndex(sys.argv[1], {dim}, optimize_after=None)
for s in range(10):
    index.upsert(f"00000000-0000-0000-0000-{{s:012d}}", unit(s), {{"key": "k", "n": s}})
index.flush()
for s in range(10, 15):
    index.upsert(f"00000000-0000-0000-0000-{{s:012d}}", unit(s), {{"key": "k", "n": s}})
os._exit(0)  # killed: no close, no flush
"""


def test_edge_reopens_after_its_process_died_with_every_flushed_update(tmp_path: Path) -> None:
    """Without a log an update is durable once flushed: a process that dies without closing
    leaves a directory the next opener loads (its lock died with the process), holding at
    least what was flushed."""
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(CRASHING_OPENER.format(dim=DIM))
    subprocess.run([sys.executable, str(script), str(tmp_path / "edge")], check=True, timeout=120)
    reopened = EdgeVectorIndex(tmp_path / "edge", DIM, optimize_after=None)
    assert 10 <= reopened.count() <= 15
    for s in range(10):
        match = reopened.search(unit(s), "k")
        assert match is not None and match.payload["n"] == s
    reopened.close()


def test_edge_vacuum_needs_a_positive_ratio_and_floor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vacuum_ratio"):
        EdgeVectorIndex(tmp_path / "a", DIM, vacuum_ratio=0.0)
    with pytest.raises(ValueError, match="vacuum_min"):
        EdgeVectorIndex(tmp_path / "b", DIM, vacuum_min=0)
