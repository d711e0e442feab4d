"""The worker's approximate cache (NIRVANA-style approximate caching, Argus §2.1 and §4.5).

After a full generation the worker stores the intermediate latents at each K of
``cache_steps`` (by default 5, 10, 15, 20, 25) and indexes the prompt's embedding; a later
request at level K embeds its prompt, finds the most similar cached prompt generated with the
same model, scheduler, resolution and step count, fetches that prompt's latent at step K, and
the pipeline denoises only the remaining N−K steps.

Parts and where they live:

* :class:`~argus.worker.approx_cache.vector_index.VectorIndex` — one point per entry: the prompt
embedding
  and a payload with the prompt, the :class:`CacheKey` fields, the digest of the latent per K,
  the entry's bytes and its recency. Requests match entries through one keyword field
  (``CacheKey.tag``) with a keyword payload index. Qdrant Edge in process by default, a Qdrant
  server in production.
* :class:`~argus.worker.approx_cache.latent_store.LatentStore` — fp16 safetensors files named by
their
  sha256, verified on every read.
* :class:`ApproximateCache` (here) — the policy: lookups and inserts, LRU eviction under an
  entry and/or byte bound, miss accounting, recovery after a restart, and the metrics.

Design decisions:

* **Misses are values, not errors.** Every data-dependent failure of a lookup — nothing cached
  for the key, a match below ``min_similarity``, a missing or corrupt latent file, an index
  that raised — returns :class:`CacheMiss` with a reason from :data:`MISS_REASONS`, counted;
  the worker then runs a full generation. Only programming errors raise (an embedding of the
  wrong shape, a K the cache does not keep).
* **Complete entries.** An entry holds a latent for every cached K below its step count, so
  the nearest neighbour of a key can serve every level; an incomplete insert is refused.
* **One entry per (key, prompt).** Inserting a prompt that is already cached for the key only
  refreshes the existing entry: the K = 0 level feeds the cache on every request, and a
  popular prompt would otherwise fill it with copies.
* **LRU by last hit.** A hit moves the entry to the back of the eviction order; inserts evict
  from the front until both bounds hold, deleting the point first and the files after (a
  lookup racing an eviction sees a missing file: a counted miss, never wrong data). ``bytes``
  counts every entry's files, so a file shared by two entries counts twice (conservative).
* **Recency is persisted lazily.** Hits bump a logical clock in memory; the writer path
  (:meth:`ApproximateCache.insert`) and :meth:`ApproximateCache.close` write the changed
  ``last_used`` values to the index in one batch, so a hit costs no index write. After a crash
  the order is as of the last insert: approximately LRU, as intended.
* **Broken entries are purged off the request path.** A missing or corrupt latent marks its
  entry; the next insert deletes it (the request itself only counts the miss).
* **Restart recovery** scrolls the index, rebuilds entries, bytes, recency order and the
  store's reference counts from the payloads, deletes files nothing references, and evicts if
  the bounds shrank.
* **One owner.** One cache owns its index collection and store directory (single writer);
  sharing a collection between workers would need cross-worker eviction, which this does not do.

Thread safety: lookups run on gRPC threads and inserts on the engine's writer thread. One lock
guards the in-memory state (entries in recency order, counters, latency windows); index and
store calls run outside it (both are thread-safe), so a lookup never waits for an insert's
file writes. Host memory is about 1.2 KB per entry (entry, digests, reference counts; measured
with tracemalloc), about 120 MB for the worker's default bound of 100k entries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from argus.worker.approx_cache.latent_store import (
    LatentCorruptError,
    LatentMissingError,
    LatentStore,
    StoredLatent,
    is_digest,
)
from argus.worker.approx_cache.vector_index import (
    KEY_FIELD,
    EdgeIndexConfig,
    EdgeVectorIndex,
    IndexMatch,
    QdrantServerIndex,
    VectorIndex,
    check_vector,
)

__all__ = [
    "DEFAULT_CACHE_STEPS",
    "MISS_REASONS",
    "ApproximateCache",
    "CacheHit",
    "CacheKey",
    "CacheMetrics",
    "CacheMiss",
    "CacheStats",
    "EdgeIndexConfig",
    "EdgeVectorIndex",
    "LatentStore",
    "QdrantServerIndex",
    "VectorIndex",
]

log = logging.getLogger(__name__)

DEFAULT_CACHE_STEPS: Final = (5, 10, 15, 20, 25)
MISS_REASONS: Final = (
    "empty",  # the cache holds no entry at all
    "no-match",  # entries exist, none with this request's key
    "below-threshold",  # the nearest entry is less similar than min_similarity
    "missing-latent",  # the entry's latent file (or its digest) is gone
    "corrupt-latent",  # the latent file does not match its hash or does not parse
    "index-error",  # the vector index raised (server down, closed cache)
)
PHASES: Final = ("search", "fetch")
PAYLOAD_SCHEMA = 1  # bumped when the payload layout changes
# retrieval histogram buckets: 50 µs (Edge top-1 on a small cache) to 1 s (a struggling server)
RETRIEVAL_BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
)

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class CacheKey:
    """What must be equal for a cached latent to be usable: entries only match requests with
    the same key."""

    model: str  # model name of the profile, e.g. "sd-xl"
    scheduler: str  # scheduler name, e.g. "euler"
    height: int  # pixels
    width: int  # pixels
    steps: int  # N, total denoising steps

    def __post_init__(self) -> None:
        if not self.model or not self.scheduler:
            raise ValueError(f"cache key needs a model and a scheduler: {self}")
        if min(self.height, self.width, self.steps) <= 0:
            raise ValueError(f"cache key needs positive height, width and steps: {self}")

    @property
    def tag(self) -> str:
        """The keyword the index filters on: an unambiguous encoding of all five fields."""
        return json.dumps([self.model, self.scheduler, self.height, self.width, self.steps])


@dataclass(frozen=True)
class CacheHit:
    latent: torch.Tensor  # float32 on CPU, shape as stored (1, C, h, w)
    step: int  # K: the latent is the scheduler's sample after K steps
    similarity: float  # cosine similarity of the matched prompt
    entry_id: str
    search_s: float  # time in the vector index
    fetch_s: float  # time reading and verifying the latent file


@dataclass(frozen=True)
class CacheMiss:
    reason: str  # one of MISS_REASONS
    search_s: float  # 0 when no search ran
    fetch_s: float  # 0 when no fetch ran


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache; latency percentiles are over the last ``window`` lookups that
    searched (search) or fetched (fetch), 0 when there were none."""

    entries: int
    bytes: int  # latent bytes of all entries
    hits: int
    misses: dict[str, int]  # by reason, every reason present
    evictions: int
    inserts: int  # entries created (refreshes of an existing prompt not included)
    search_p50_s: float
    search_p99_s: float
    fetch_p50_s: float
    fetch_p99_s: float
    window: int  # searches the percentiles cover


class CacheMetrics:
    """The Prometheus adapter of one cache; the only part of it that touches
    prometheus_client. Label values are fixed (``phase``: search|fetch; ``reason``: MISS_REASONS)
    and created up front so every series exists from the start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.retrieval = Histogram(
            "argus_worker_cache_retrieval_seconds",
            "Approximate-cache retrieval time by phase: search (vector index), fetch (latent file)",
            ["phase"],
            buckets=RETRIEVAL_BUCKETS,
            registry=registry,
        )
        self.hits = Counter(
            "argus_worker_cache_hits", "Lookups served from a cached latent", registry=registry
        )
        self.misses = Counter(
            "argus_worker_cache_misses",
            "Lookups that fell back to a full generation, by reason",
            ["reason"],
            registry=registry,
        )
        self.evictions = Counter(
            "argus_worker_cache_evictions", "Entries evicted by the LRU bound", registry=registry
        )
        self.entries = Gauge("argus_worker_cache_entries", "Cached prompts", registry=registry)
        self.bytes = Gauge("argus_worker_cache_bytes", "Bytes of cached latents", registry=registry)
        for phase in PHASES:
            self.retrieval.labels(phase)
        for reason in MISS_REASONS:
            self.misses.labels(reason)
        self._collectors = (
            self.retrieval,
            self.hits,
            self.misses,
            self.evictions,
            self.entries,
            self.bytes,
        )

    def unregister(self) -> None:
        for collector in self._collectors:
            with contextlib.suppress(KeyError):  # already unregistered
                self.registry.unregister(collector)


@dataclass(slots=True)
class _Entry:
    latents: dict[int, str]  # K → digest
    nbytes: int  # bytes of its latent files
    last_used: int  # logical clock of its insert or last hit


@dataclass
class _Counts:
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    evictions: int = 0
    inserts: int = 0


class ApproximateCache:
    """Prompt-embedding → intermediate latents, bounded, LRU by last hit. See the module
    docstring for the design; ``lookup`` is the request path, ``insert`` the writer path."""

    def __init__(
        self,
        index: VectorIndex,
        store: LatentStore,
        *,
        max_entries: int | None,
        max_bytes: int | None,
        min_similarity: float = 0.0,
        cache_steps: Iterable[int] = DEFAULT_CACHE_STEPS,
        registry: CollectorRegistry | None = None,
        window: int = 1000,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        steps = tuple(sorted(set(cache_steps)))
        if not steps or steps[0] <= 0:
            raise ValueError(f"cache_steps {tuple(cache_steps)} must be positive step numbers")
        for name, bound in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if bound is not None and bound <= 0:
                raise ValueError(f"{name} {bound} must be positive or None")
        if not -1.0 <= min_similarity <= 1.0:
            raise ValueError(f"min_similarity {min_similarity} outside [-1, 1]")
        if window <= 0:
            raise ValueError(f"window {window} must be positive")
        self.index = index
        self.store = store
        self.dim = index.dim
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_similarity = min_similarity
        self.cache_steps: tuple[int, ...] = steps
        self._timer = timer
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._clock = 0
        self._counts = _Counts()
        self._dirty: set[str] = set()  # entries whose last_used the index does not know yet
        self._broken: set[str] = set()  # entries with a missing or corrupt latent
        self._search_window: deque[float] = deque(maxlen=window)
        self._fetch_window: deque[float] = deque(maxlen=window)
        self._closed = False
        self.metrics = CacheMetrics(registry if registry is not None else REGISTRY)
        self._recover()

    # -- the request path ------------------------------------------------------------------

    def lookup(self, embedding: npt.ArrayLike, key: CacheKey, step: int) -> CacheHit | CacheMiss:
        """The latent at step ``step`` of the cached prompt nearest to ``embedding`` among the
        entries of ``key``, or why there is none. Never raises for data-dependent failures."""
        vector = check_vector(embedding, self.dim)
        self._check_step(key, step)
        began = self._timer()
        match: IndexMatch | None = None
        error = False
        try:
            if self._closed:
                raise RuntimeError("the cache is closed")
            match = self.index.search(vector, key.tag)
        except Exception:
            log.warning("approximate cache: index search failed", exc_info=True)
            error = True
        search_s = self._timer() - began
        self._observe("search", search_s)
        if error:
            return self._miss("index-error", search_s)
        if match is None:
            with self._lock:
                empty = not self._entries
            return self._miss("empty" if empty else "no-match", search_s)
        if match.score < self.min_similarity:
            return self._miss("below-threshold", search_s)
        return self._fetch(match, step, search_s)

    def _fetch(self, match: IndexMatch, step: int, search_s: float) -> CacheHit | CacheMiss:
        digest = _latent_digests(match.payload).get(step)
        if digest is None:
            self._mark_broken(match.id)
            return self._miss("missing-latent", search_s)
        began = self._timer()
        reason = ""
        try:
            latent = self.store.get(digest)
        except LatentMissingError:
            reason = "missing-latent"
        except LatentCorruptError as err:
            log.warning("approximate cache: entry %s: %s", match.id, err)
            reason = "corrupt-latent"
        fetch_s = self._timer() - began
        self._observe("fetch", fetch_s)
        if reason:
            self._mark_broken(match.id)
            return self._miss(reason, search_s, fetch_s)
        with self._lock:
            entry = self._entries.get(match.id)
            if entry is not None:
                self._touch(match.id, entry)
            self._counts.hits += 1
        self.metrics.hits.inc()
        return CacheHit(latent, step, match.score, match.id, search_s, fetch_s)

    def _check_step(self, key: CacheKey, step: int) -> None:
        if step not in self.cache_steps:
            raise ValueError(f"step {step} is not cached; the cache keeps {self.cache_steps}")
        if step >= key.steps:
            raise ValueError(f"step {step} is not below the request's {key.steps} steps")

    def _miss(self, reason: str, search_s: float, fetch_s: float = 0.0) -> CacheMiss:
        with self._lock:
            self._counts.misses[reason] += 1
        self.metrics.misses.labels(reason).inc()
        return CacheMiss(reason, search_s, fetch_s)

    def _observe(self, phase: str, seconds: float) -> None:
        with self._lock:
            (self._search_window if phase == "search" else self._fetch_window).append(seconds)
        self.metrics.retrieval.labels(phase).observe(seconds)

    def _touch(self, entry_id: str, entry: _Entry) -> None:
        """Make an entry the most recently used (lock held)."""
        self._clock += 1
        entry.last_used = self._clock
        self._entries.move_to_end(entry_id)
        self._dirty.add(entry_id)

    def _mark_broken(self, entry_id: str) -> None:
        """Queue a point with a missing or corrupt latent for deletion by the writer path. An
        id this cache does not know is an orphan (its eviction's delete failed) or was just
        evicted; deleting it again is harmless."""
        with self._lock:
            self._broken.add(entry_id)

    # -- the writer path -------------------------------------------------------------------

    def insert(
        self,
        embedding: npt.ArrayLike,
        key: CacheKey,
        prompt: str,
        latents: Mapping[int, torch.Tensor],
    ) -> str | None:
        """Cache the latents of a full generation of ``prompt``; returns the entry id, or
        ``None`` when nothing is cached (no cached K below ``key.steps``, or the entry alone
        exceeds ``max_bytes``). Latents at steps the cache does not keep are ignored.

        Called off the request path (the engine's writer thread): it writes files, updates the
        index, evicts, purges broken entries and persists recency. Raises ``ValueError`` for
        an incomplete or non-finite entry and whatever the index raises (the files written are
        released first).
        """
        vector = check_vector(embedding, self.dim)
        steps = self._steps_to_store(key, latents)
        if self._closed:
            raise RuntimeError("the cache is closed")
        self._maintain()
        if not steps:
            return None
        existing = self._same_prompt(vector, key, prompt)
        if existing is not None:
            return existing
        stored: dict[int, StoredLatent] = {}
        try:
            for step in steps:
                stored[step] = self.store.put(latents[step])
        except BaseException:
            self._release(s.digest for s in stored.values())
            raise
        nbytes = sum(s.nbytes for s in stored.values())
        if self.max_bytes is not None and nbytes > self.max_bytes:
            self._release(s.digest for s in stored.values())
            log.warning("approximate cache: an entry of %d bytes exceeds max_bytes", nbytes)
            return None
        return self._add(vector, key, prompt, {k: s.digest for k, s in stored.items()}, nbytes)

    def _steps_to_store(self, key: CacheKey, latents: Mapping[int, torch.Tensor]) -> list[int]:
        wanted = [k for k in self.cache_steps if k < key.steps]
        missing = [k for k in wanted if k not in latents]
        if missing:
            raise ValueError(
                f"latents at steps {missing} missing; a {key.steps}-step entry needs {wanted}"
            )
        return wanted

    def _same_prompt(self, vector: FloatArray, key: CacheKey, prompt: str) -> str | None:
        """The id of this key's entry for exactly ``prompt`` (refreshed), if there is one."""
        try:
            match = self.index.search(vector, key.tag)
        except Exception:
            return None  # the upsert will fail loudly if the index is really down
        if match is None or match.payload.get("prompt") != prompt:
            return None
        with self._lock:
            entry = self._entries.get(match.id)
            if entry is None or match.id in self._broken:
                return None
            self._touch(match.id, entry)
        return match.id

    def _add(
        self, vector: FloatArray, key: CacheKey, prompt: str, digests: dict[int, str], nbytes: int
    ) -> str:
        entry_id = str(uuid.uuid4())
        with self._lock:
            self._clock += 1
            entry = _Entry(digests, nbytes, self._clock)
        try:
            self.index.upsert(entry_id, vector, _payload(key, prompt, entry))
        except BaseException:
            self._release(digests.values())
            raise
        with self._lock:
            self._entries[entry_id] = entry
            self._bytes += nbytes
            self._counts.inserts += 1
            victims = self._pop_victims(keep=entry_id)
        self._drop(victims, evicted=True)
        return entry_id

    def _pop_victims(self, keep: str | None = None) -> list[tuple[str, _Entry]]:
        """Take least recently used entries out until both bounds hold (lock held)."""
        victims: list[tuple[str, _Entry]] = []
        while self._entries and self._over_bounds():
            entry_id = next(iter(self._entries))
            if entry_id == keep:
                break
            victims.append((entry_id, self._entries.pop(entry_id)))
            self._bytes -= victims[-1][1].nbytes
            self._dirty.discard(entry_id)
            self._broken.discard(entry_id)
        return victims

    def _over_bounds(self) -> bool:
        too_many = self.max_entries is not None and len(self._entries) > self.max_entries
        too_big = self.max_bytes is not None and self._bytes > self.max_bytes
        return too_many or too_big

    def _drop(self, victims: list[tuple[str, _Entry]], *, evicted: bool) -> None:
        """Delete entries already taken out of memory: the points first, then the files."""
        if victims:
            try:
                self.index.delete([entry_id for entry_id, _ in victims])
            except Exception:
                log.warning(
                    "approximate cache: deleting %d points failed", len(victims), exc_info=True
                )
            for _, entry in victims:
                self._release(entry.latents.values())
            if evicted:
                with self._lock:
                    self._counts.evictions += len(victims)
                self.metrics.evictions.inc(len(victims))
        self._update_gauges()

    def _release(self, digests: Iterable[str]) -> None:
        for digest in digests:
            self.store.release(digest)

    def _maintain(self) -> None:
        """Purge broken entries and write changed recency to the index (writer path)."""
        with self._lock:
            orphans = [i for i in self._broken if i not in self._entries]
            broken = [(i, self._entries.pop(i)) for i in self._broken if i in self._entries]
            self._broken.clear()
            for entry_id, entry in broken:
                self._bytes -= entry.nbytes
                self._dirty.discard(entry_id)
            dirty = {i: self._entries[i].last_used for i in self._dirty if i in self._entries}
            self._dirty.clear()
        if broken:
            self._drop(broken, evicted=False)
        if orphans:
            try:
                self.index.delete(orphans)
            except Exception:
                log.warning("approximate cache: deleting orphan points failed", exc_info=True)
        if dirty:
            try:
                self.index.set_payload({i: {"last_used": t} for i, t in dirty.items()})
            except Exception:
                log.warning("approximate cache: persisting recency failed", exc_info=True)

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the in-memory state from the index after a (re)start; see the module
        docstring."""
        found: list[tuple[int, str, _Entry]] = []
        malformed: list[str] = []
        for record in self.index.scroll():
            entry = _entry_from_payload(record.payload)
            if entry is None:
                malformed.append(record.id)
            else:
                found.append((entry.last_used, record.id, entry))
        if malformed:
            log.warning("approximate cache: deleting %d malformed points", len(malformed))
            self.index.delete(malformed)
        found.sort(key=lambda item: item[0])
        for _, entry_id, entry in found:
            self._entries[entry_id] = entry
            self._bytes += entry.nbytes
            for digest in entry.latents.values():
                self.store.retain(digest)
        self._clock = found[-1][0] if found else 0
        swept = self.store.sweep()
        if swept:
            log.info("approximate cache: removed %d unreferenced latent files", swept)
        with self._lock:
            victims = self._pop_victims()
        self._drop(victims, evicted=True)

    # -- stats and shutdown ----------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            search = np.array(self._search_window, dtype=np.float64)
            fetch = np.array(self._fetch_window, dtype=np.float64)
            counts = self._counts
            entries, nbytes = len(self._entries), self._bytes
            hits, misses = counts.hits, dict(counts.misses)
            evictions, inserts = counts.evictions, counts.inserts
        search_p50, search_p99 = _percentiles(search)
        fetch_p50, fetch_p99 = _percentiles(fetch)
        return CacheStats(
            entries=entries,
            bytes=nbytes,
            hits=hits,
            misses=misses,
            evictions=evictions,
            inserts=inserts,
            search_p50_s=search_p50,
            search_p99_s=search_p99,
            fetch_p50_s=fetch_p50,
            fetch_p99_s=fetch_p99,
            window=len(search),
        )

    def recency_order(self) -> list[str]:
        """Entry ids, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._entries)

    def _update_gauges(self) -> None:
        with self._lock:
            entries, nbytes = len(self._entries), self._bytes
        self.metrics.entries.set(entries)
        self.metrics.bytes.set(nbytes)

    def close(self) -> None:
        """Persist recency, purge broken entries, close the index and unregister the metrics;
        idempotent. Lookups after close are ``index-error`` misses."""
        if self._closed:
            return
        try:
            self._maintain()
        finally:
            self._closed = True
            self.index.close()
            self.metrics.unregister()


# -- payloads --------------------------------------------------------------------------------


def _payload(key: CacheKey, prompt: str, entry: _Entry) -> dict[str, Any]:
    return {
        KEY_FIELD: key.tag,
        "prompt": prompt,
        "model": key.model,
        "scheduler": key.scheduler,
        "height": key.height,
        "width": key.width,
        "steps": key.steps,
        "latents": {str(k): digest for k, digest in entry.latents.items()},  # K → sha256
        "latent_bytes": entry.nbytes,
        "last_used": entry.last_used,
        "schema": PAYLOAD_SCHEMA,
    }


def _latent_digests(payload: Mapping[str, Any]) -> dict[int, str]:
    raw = payload.get("latents")
    if not isinstance(raw, dict):
        return {}
    digests: dict[int, str] = {}
    for k, digest in raw.items():
        if isinstance(k, str) and k.isdigit() and isinstance(digest, str):
            digests[int(k)] = digest
    return digests


def _entry_from_payload(payload: Mapping[str, Any]) -> _Entry | None:
    """The entry a point's payload describes, or ``None`` if it is not one of ours."""
    digests = _latent_digests(payload)
    nbytes, last_used = payload.get("latent_bytes"), payload.get("last_used")
    if payload.get("schema") != PAYLOAD_SCHEMA or not digests:
        return None
    if not isinstance(nbytes, int) or not isinstance(last_used, int):
        return None
    if not all(is_digest(d) for d in digests.values()):
        return None
    return _Entry(digests, nbytes, last_used)


def _percentiles(samples: npt.NDArray[np.float64]) -> tuple[float, float]:
    if samples.size == 0:
        return 0.0, 0.0
    p50, p99 = np.percentile(samples, [50, 99])
    return float(p50), float(p99)
