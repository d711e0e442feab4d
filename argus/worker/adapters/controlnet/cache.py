"""A device-resident model cache: popular ControlNets stay loaded, the rest load on demand.

Katz §3.1 finds ControlNet popularity heavily skewed (5–8 ControlNets take 95–98 % of the
calls) and a small LRU or LFU cache enough to remove nearly all loads; §5 has the service
"track the popularity of each ControlNet and cache a small number of top popular ones".
:class:`ModelCache` is that cache, generic over what it holds:

* **policy**: ``lru`` evicts the entry used longest ago; ``lfu`` the entry requested least
  often, counting every request for a key since the cache started, resident or not (the
  popularity Katz tracks), ties broken by recency. Evicted keys keep their counts, so a
  popular ControlNet that was pushed out by a burst wins its place back.
* **bounds**: at most ``max_entries`` entries and/or ``max_bytes`` bytes (sizes from
  ``size_of`` once loaded; ``estimate`` lets the cache make room before a load, so device
  memory holds the budget plus at most one model in flight).
* **leases**: :meth:`ModelCache.acquire` returns a :class:`Lease`; leased entries are never
  evicted. When everything resident is leased and a new model is needed, it is loaded anyway
  (a request is never refused for memory the cache itself holds) and the cache shrinks back
  within its bounds as leases end.
* **single flight**: concurrent misses on the same key load it once; the others wait for
  that load and count as misses, not loads. A failed load is not cached: every waiter gets
  the error and the next request tries again.

The lock is held only for bookkeeping, never while a model loads. Counters are a
:class:`~argus.contracts.controlnet.CacheStats` value (the contract the service reports it
in); Prometheus reads it through
:mod:`argus.worker.adapters.controlnet.metrics`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from argus.contracts.controlnet import CacheStats

V = TypeVar("V")


class Policy(Enum):
    LRU = "lru"
    LFU = "lfu"

    @classmethod
    def parse(cls, text: str) -> Policy:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(f"cache policy {text!r}: expected lru or lfu") from None


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    last_used: int
    leases: int = 0


class Lease(Generic[V]):
    """A resident entry in use; :meth:`release` (or ``with``) gives it back to the cache."""

    def __init__(self, cache: ModelCache[V], key: str, value: V, hit: bool) -> None:
        self.key = key
        self.value = value
        self.hit = hit  # the entry was resident when acquired
        self._cache = cache
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self.key)

    def __enter__(self) -> Lease[V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelCache(Generic[V]):
    """Keys → loaded models, bounded by count and/or bytes, evicting by LRU or LFU."""

    def __init__(
        self,
        load: Callable[[str], V],
        *,
        size_of: Callable[[V], int],
        estimate: Callable[[str], int] | None = None,
        policy: Policy = Policy.LRU,
        max_entries: int | None = None,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries {max_entries}: must be at least 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes {max_bytes}: must be positive")
        self._load = load
        self._size_of = size_of
        self._estimate = estimate
        self.policy = policy
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[V]] = {}
        self._loading: dict[str, Future[V]] = {}
        self._requests: Counter[str] = Counter()  # popularity, for LFU
        self._tick = 0  # a logical clock for recency: no two uses share a tick
        self._hits = self._misses = self._loads = self._failures = self._evictions = 0
        self._load_seconds = 0.0

    # -- the request path ------------------------------------------------------------------

    def acquire(self, key: str) -> Lease[V]:
        """The model for ``key``, loading it if needed; hold the lease while using it."""
        with self._lock:
            self._requests[key] += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._hits += 1
                entry.last_used = self._next_tick()
                entry.leases += 1
                return Lease(self, key, entry.value, hit=True)
            self._misses += 1
            pending = self._loading.get(key)
            leader = pending is None
            if pending is None:
                pending = self._loading[key] = Future()
                self._loads += 1
        if leader:
            self._run_load(key, pending)  # inserts the entry already leased to the leader
        value = pending.result()  # re-raises the loader's error for every waiter
        if not leader:
            with self._lock:
                entry = self._entries.get(key)
                if entry is None:  # evicted since the load finished: hold it again
                    entry = self._entries[key] = _Entry(value, self._size_of(value), 0)
                entry.last_used = self._next_tick()
                entry.leases += 1
        return Lease(self, key, value, hit=False)

    def _run_load(self, key: str, pending: Future[V]) -> None:
        began = self._clock()
        try:
            extra = self._estimate(key) if self._estimate is not None else 0
            with self._lock:  # make room first: the device holds the budget plus this load
                self._evict(extra_bytes=extra, extra_entries=1)
            value = self._load(key)
            size = self._size_of(value)
        except BaseException as err:
            with self._lock:
                self._failures += 1
                self._load_seconds += self._clock() - began
                del self._loading[key]
            pending.set_exception(err)
            return
        with self._lock:
            self._load_seconds += self._clock() - began
            self._entries[key] = _Entry(value, size, self._next_tick(), leases=1)
            del self._loading[key]
            self._evict()
        pending.set_result(value)

    def _release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.leases > 0:
                entry.leases -= 1
            self._evict()

    # -- eviction --------------------------------------------------------------------------

    def _over(self, extra_bytes: int, extra_entries: int) -> bool:
        count = len(self._entries) + extra_entries
        size = sum(e.size for e in self._entries.values()) + extra_bytes
        return (self.max_entries is not None and count > self.max_entries) or (
            self.max_bytes is not None and size > self.max_bytes
        )

    def _victim(self) -> str | None:
        free = [(k, e) for k, e in self._entries.items() if e.leases == 0]
        if not free:
            return None
        if self.policy is Policy.LFU:
            key, _ = min(free, key=lambda ke: (self._requests[ke[0]], ke[1].last_used))
        else:
            key, _ = min(free, key=lambda ke: ke[1].last_used)
        return key

    def _evict(self, extra_bytes: int = 0, extra_entries: int = 0) -> None:
        """Drop unleased entries, by policy, until the bounds hold (or only leased remain)."""
        while self._over(extra_bytes, extra_entries):
            victim = self._victim()
            if victim is None:
                return
            del self._entries[victim]
            self._evictions += 1

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # -- inspection ------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._lock:
            ordered = sorted(self._entries.items(), key=lambda ke: ke[1].last_used)
            return CacheStats(
                policy=self.policy.value,
                hits=self._hits,
                misses=self._misses,
                loads=self._loads,
                load_failures=self._failures,
                evictions=self._evictions,
                load_seconds=self._load_seconds,
                resident=tuple(k for k, _ in ordered),
                resident_bytes=sum(e.size for e in self._entries.values()),
                leased=sum(1 for e in self._entries.values() if e.leases > 0),
            )

    def clear(self) -> None:
        """Drop every unleased entry (the service's shutdown)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.leases == 0]:
                del self._entries[key]
