"""The worker's approximate cache (NIRVANA-style approximate caching, Argus §2.1 and §4.5).

After a full generation the worker stores the intermediate latents at each K of
``cache_steps`` (5, 10, 15, 20, 25 by default) and indexes the prompt's embedding. A later
request at a level of K embeds its prompt and finds the nearest cached prompt of its
:class:`~argus.contracts.generate.CacheKey` (model, scheduler, size, steps, adapters); the
level's K is a ceiling and the neighbour's similarity decides how much of it is used: the
model's :class:`~argus.profiles.cache_evidence.KRule` gives the largest cached step at most K
that the similarity allows, the pipeline resumes there, and below the rule's lowest floor the
lookup is a miss (``below-floor``) served in full.

Parts: the :class:`~.vector_index.VectorIndex` (one point per entry: the embedding and a payload
with the prompt, the key, the digest of the latent per K, the bytes and the recency, matched
through the key's tag; Qdrant Edge in process, a Qdrant server in production); the
:class:`~.latent_store.LatentStore` (fp16 safetensors named by their sha256, verified on every
read); :class:`ApproximateCache` (here: lookups, inserts, LRU eviction, recovery, metrics);
and the :class:`~.events.CacheEventLog` of its inserts and evictions, for routers' mirrors.

Design decisions:

* **Misses are values, not errors.** Nothing cached for the key, a neighbour below the floor,
  a missing or corrupt latent, an index that raised: each is a :class:`CacheMiss` with a
  reason from :data:`MISS_REASONS` (and the neighbour's similarity when there was one),
  counted; the worker runs in full. Only programming errors raise.
* **Complete entries, one per (key, prompt).** An entry holds a latent for every cached K
  below its step count, so the neighbour can serve any K the rule allows; inserting a cached
  prompt again only refreshes it.
* **LRU by last hit**, persisted lazily (hits bump a clock in memory; the writer path writes
  the changed recency in one batch). Evictions delete the point first and the files after,
  so a lookup racing one sees a missing file: a counted miss, never wrong data.
* **Broken entries are purged off the request path**, by the next insert.
* **Restart recovery** rebuilds entries, bytes, recency and the store's reference counts from
  the payloads, deletes unreferenced files, and evicts if the bounds shrank.
* **One owner**: one cache owns its collection and directory (single writer).

Thread safety: lookups run on gRPC threads, inserts on the engine's writer thread; one lock
guards the in-memory state and index and store calls run outside it. About 1.2 KB of host
memory per entry (tracemalloc), 120 MB at the worker's default bound of 100k entries.
"""

from __future__ import annotations

import contextlib
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

from argus.contracts.generate import MISS_INDEX_ERROR, CacheKey
from argus.profiles.cache_evidence import DEFAULT_RULE, KRule
from argus.worker.approx_cache.events import DEFAULT_CAPACITY, CacheEventLog
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
    "below-floor",  # the nearest entry is less similar than the rule's floor at any K allowed
    "missing-latent",  # the entry's latent file (or its digest) is gone
    "corrupt-latent",  # the latent file does not match its hash or does not parse
    MISS_INDEX_ERROR,  # the vector index raised (server down, closed cache)
)
PHASES: Final = ("search", "fetch")
VECTOR_SOURCES: Final = ("router", "worker")  # where a lookup's or insert's prompt vector came from
# similarity histogram buckets: the default rule's floors (0.65 … 0.93) and room around them
SIMILARITY_BUCKETS = (
    0.0,
    0.3,
    0.5,
    0.6,
    0.65,
    0.7,
    0.75,
    0.8,
    0.82,
    0.85,
    0.88,
    0.9,
    0.93,
    0.96,
    0.99,
)
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
class CacheHit:
    latent: torch.Tensor  # float32 on CPU, shape as stored (1, C, h, w)
    step: int  # K resumed at: the latent is the scheduler's sample after K steps
    similarity: float  # cosine similarity of the matched prompt
    entry_id: str
    search_s: float  # time in the vector index
    fetch_s: float  # time reading and verifying the latent file


@dataclass(frozen=True)
class CacheMiss:
    reason: str  # one of MISS_REASONS
    search_s: float  # 0 when no search ran
    fetch_s: float  # 0 when no fetch ran
    similarity: float | None = None  # of the neighbour found (below-floor, bad latent); None: none


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
    k_reduced: int = 0  # hits the rule resumed below the largest cached step of their ceiling


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
        self.k_reduced = Counter(
            "argus_worker_cache_k_reduced",
            "Hits the similarity rule resumed below the largest cached step of their level's K "
            "(the routed ceiling): the neighbour allowed fewer skipped steps",
            registry=registry,
        )
        self.similarity = Histogram(
            "argus_worker_cache_similarity",
            "Cosine similarity of the nearest cached prompt a lookup found (hits and misses)",
            buckets=SIMILARITY_BUCKETS,
            registry=registry,
        )
        self.prompt_vectors = Counter(
            "argus_worker_cache_prompt_vectors",
            "Prompts whose embedding the cache's lookup or insert used, by source (router: "
            "the vector the router sent with the call; worker: embedded here)",
            ["source"],
            registry=registry,
        )
        for phase in PHASES:
            self.retrieval.labels(phase)
        for source in VECTOR_SOURCES:
            self.prompt_vectors.labels(source)
        for reason in MISS_REASONS:
            self.misses.labels(reason)
        self._collectors = (
            self.retrieval,
            self.hits,
            self.misses,
            self.evictions,
            self.entries,
            self.bytes,
            self.k_reduced,
            self.similarity,
            self.prompt_vectors,
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
    k_reduced: int = 0


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
        rules: Mapping[str, KRule] | None = None,
        default_rule: KRule = DEFAULT_RULE,
        cache_steps: Iterable[int] = DEFAULT_CACHE_STEPS,
        registry: CollectorRegistry | None = None,
        window: int = 1000,
        events: int = DEFAULT_CAPACITY,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``rules``: the similarity → K rule of each model (the profile's
        ``[models.X.cache]``); a model without one uses ``default_rule``. ``events``: the
        changes the event log keeps for routers' mirrors (:mod:`.events`)."""
        steps = tuple(sorted(set(cache_steps)))
        if not steps or steps[0] <= 0:
            raise ValueError(f"cache_steps {tuple(cache_steps)} must be positive step numbers")
        for name, bound in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if bound is not None and bound <= 0:
                raise ValueError(f"{name} {bound} must be positive or None")
        if window <= 0:
            raise ValueError(f"window {window} must be positive")
        self.index = index
        self.store = store
        self.dim = index.dim
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.rules: dict[str, KRule] = dict(rules or {})
        self.default_rule = default_rule
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
        # after recovery: the entries it found were never published, so the log starts with
        # a gap (its evictions, if the bounds shrank, went nowhere)
        self.events = CacheEventLog(events, recovered=bool(self._entries))

    def rule_for(self, model: str) -> KRule:
        """The similarity → K rule of ``model``."""
        return self.rules.get(model, self.default_rule)

    # -- the request path ------------------------------------------------------------------

    def count_vector(self, source: str) -> None:
        """One prompt vector used, from ``source`` (:data:`VECTOR_SOURCES`)."""
        self.metrics.prompt_vectors.labels(source).inc()

    def lookup(self, embedding: npt.ArrayLike, key: CacheKey, ceiling: int) -> CacheHit | CacheMiss:
        """The latent of the cached prompt nearest to ``embedding`` among the entries of
        ``key``, at the largest cached step at most ``ceiling`` (the routed level's K) that
        its similarity allows under ``key.model``'s rule, or why there is none. Never raises
        for data-dependent failures."""
        vector = check_vector(embedding, self.dim)
        steps = self._steps_up_to(key, ceiling)
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
            return self._miss(MISS_INDEX_ERROR, search_s)
        if match is None:
            with self._lock:
                empty = not self._entries
            return self._miss("empty" if empty else "no-match", search_s)
        similarity = float(match.score)
        self.metrics.similarity.observe(similarity)
        step = self.rule_for(key.model).allowed_step(similarity, ceiling, steps)
        if step == 0:
            return self._miss("below-floor", search_s, similarity=similarity)
        return self._fetch(match, step, search_s, reduced=step < steps[-1])

    def _fetch(
        self, match: IndexMatch, step: int, search_s: float, *, reduced: bool
    ) -> CacheHit | CacheMiss:
        """Read the neighbour's latent at ``step``; ``reduced``: the rule chose a step below
        the largest the ceiling allows (counted on a hit)."""
        similarity = float(match.score)
        digest = _latent_digests(match.payload).get(step)
        if digest is None:
            self._mark_broken(match.id)
            return self._miss("missing-latent", search_s, similarity=similarity)
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
            return self._miss(reason, search_s, fetch_s, similarity)
        with self._lock:
            entry = self._entries.get(match.id)
            if entry is not None:
                self._touch(match.id, entry)
            self._counts.hits += 1
            self._counts.k_reduced += reduced
        self.metrics.hits.inc()
        if reduced:
            self.metrics.k_reduced.inc()
        return CacheHit(latent, step, similarity, match.id, search_s, fetch_s)

    def _steps_up_to(self, key: CacheKey, ceiling: int) -> tuple[int, ...]:
        """The cached steps at most ``ceiling`` (and below ``key.steps``), ascending; raises
        ValueError when there is none (a level whose K the cache cannot serve)."""
        if not 0 < ceiling < key.steps:
            raise ValueError(f"ceiling {ceiling} is not in 1 … {key.steps - 1} (K < N)")
        steps = tuple(k for k in self.cache_steps if k <= ceiling)
        if not steps:
            raise ValueError(
                f"no cached step at most {ceiling}; the cache keeps {self.cache_steps}"
            )
        return steps

    def _miss(
        self,
        reason: str,
        search_s: float,
        fetch_s: float = 0.0,
        similarity: float | None = None,
    ) -> CacheMiss:
        with self._lock:
            self._counts.misses[reason] += 1
        self.metrics.misses.labels(reason).inc()
        return CacheMiss(reason, search_s, fetch_s, similarity)

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
        self.events.inserted(entry_id, key.tag, vector)
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

    def _drop(
        self, victims: list[tuple[str, _Entry]], *, evicted: bool, publish: bool = True
    ) -> None:
        """Delete entries already taken out of memory: the points first, then the files; with
        ``publish``, the event log says they are gone (routers' mirrors drop them)."""
        if victims:
            if publish:
                self.events.evicted(entry_id for entry_id, _ in victims)
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
        self._drop(victims, evicted=True, publish=False)  # no log yet: nothing was published

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
            evictions, inserts, k_reduced = counts.evictions, counts.inserts, counts.k_reduced
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
            k_reduced=k_reduced,
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
        "adapters": key.adapters,
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
