"""One simulated worker's approximate cache: which prompts it holds, and the nearest one.

The simulator's counterpart of the live worker's cache (:mod:`argus.worker.approx_cache`):
entries are prompt embeddings under a key (what must be equal for a latent to be usable: the
model, and the adapters when the simulation draws them), one entry per (key, prompt) as live
(a prompt cached again only refreshes its entry), at most ``capacity`` entries over all keys.
The latents themselves are not modelled: an entry stands for a full generation's latents at
every cached step.

A lookup is exact: the cosine similarity of the query with every entry of its key (unit
vectors, one matrix product), the largest wins (the first on a tie). The live index is
approximate (HNSW); at the sizes a simulated run reaches the exact answer is cheap and leaves
no doubt about what the rule saw.

Eviction, when an insert would pass the bound:

* ``lru`` (the live worker's): the entry used least recently, a hit or an insert being a use;
* ``lcbfu``: NIRVANA's Least Computationally Beneficial and Frequently Used: the entry whose
  hits saved the fewest denoising steps in all (each hit adds the K it resumed at, so a
  frequent entry and one that serves large K are both kept), the least recently used first
  among equals; an entry never hit has saved nothing and goes first, oldest first.

Both orders use a logical clock (one tick per use), so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]


class Eviction(StrEnum):
    LRU = "lru"
    LCBFU = "lcbfu"


@dataclass(frozen=True)
class Neighbour:
    """The nearest entry of a key to a query."""

    entry: int  # the entry's id in its cache
    prompt: int  # the cached prompt's id
    similarity: float  # cosine similarity to the query


@dataclass
class _Entry:
    key: Hashable
    prompt: int
    slot: int  # its row in its key's shelf
    used: int  # logical time of its last use
    saved: int = 0  # denoising steps its hits saved, all together (LCBFU)


class _Shelf:
    """The entries of one key: their vectors as rows of one matrix, grown by doubling."""

    def __init__(self, dim: int) -> None:
        self.vectors: FloatArray = np.zeros((8, dim), dtype=np.float32)
        self.entries: list[int] = []

    def add(self, entry: int, vector: FloatArray) -> int:
        slot = len(self.entries)
        if slot == len(self.vectors):
            self.vectors = np.concatenate([self.vectors, np.zeros_like(self.vectors)])
        self.vectors[slot] = vector
        self.entries.append(entry)
        return slot

    def remove(self, slot: int) -> int | None:
        """Drop the entry at ``slot`` by moving the last one into it; returns the moved
        entry's id (its slot is now ``slot``), or None when the last one was dropped."""
        last = len(self.entries) - 1
        moved = None
        if slot != last:
            self.vectors[slot] = self.vectors[last]
            moved = self.entries[slot] = self.entries[last]
        self.entries.pop()
        return moved


class WorkerCache:
    """A bounded cache of prompt embeddings under keys (see the module docstring)."""

    def __init__(self, capacity: int, dim: int, eviction: Eviction | str = Eviction.LRU) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self.dim = dim
        self.eviction = Eviction(eviction)
        self._clock = 0
        self._next_id = 0
        self._entries: dict[int, _Entry] = {}
        self._by_prompt: dict[tuple[Hashable, int], int] = {}
        self._shelves: dict[Hashable, _Shelf] = {}
        self._recency: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._benefit: list[tuple[int, int, int]] = []  # (saved, used, id), stale rows skipped
        self.inserts = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: Hashable, prompt: int) -> bool:
        """Whether prompt ``prompt`` is cached under ``key``."""
        return (key, prompt) in self._by_prompt

    def nearest(self, key: Hashable, vector: FloatArray) -> Neighbour | None:
        """The entry of ``key`` most similar to ``vector`` (a unit vector), or None when the
        key has none. A lookup alone is no use: :meth:`use` records a hit."""
        shelf = self._shelves.get(key)
        if shelf is None or not shelf.entries:
            return None
        similarities = shelf.vectors[: len(shelf.entries)] @ vector
        slot = int(np.argmax(similarities))
        entry = shelf.entries[slot]
        return Neighbour(entry, self._entries[entry].prompt, float(similarities[slot]))

    def use(self, entry: int, step: int) -> None:
        """A request resumed from ``entry`` at ``step``: it is used now and saved ``step``
        steps."""
        found = self._entries[entry]
        found.saved += step
        self._touch(entry, found)

    def insert(self, key: Hashable, prompt: int, vector: FloatArray) -> None:
        """Cache ``prompt`` under ``key`` after a full generation; a prompt cached already
        is only refreshed. Evicts first when the cache is full."""
        self.inserts += 1
        existing = self._by_prompt.get((key, prompt))
        if existing is not None:
            self._touch(existing, self._entries[existing])
            return
        while len(self._entries) >= self.capacity:
            self._evict()
        entry = self._next_id
        self._next_id += 1
        shelf = self._shelves.setdefault(key, _Shelf(self.dim))
        slot = shelf.add(entry, vector)
        found = _Entry(key, prompt, slot, self._clock)
        self._entries[entry] = found
        self._by_prompt[(key, prompt)] = entry
        self._touch(entry, found)

    def _touch(self, entry: int, found: _Entry) -> None:
        self._clock += 1
        found.used = self._clock
        self._recency[entry] = None
        self._recency.move_to_end(entry)
        if self.eviction is Eviction.LCBFU:
            heapq.heappush(self._benefit, (found.saved, found.used, entry))

    def _victim(self) -> int:
        if self.eviction is Eviction.LRU:
            return next(iter(self._recency))
        while True:
            saved, used, entry = heapq.heappop(self._benefit)
            found = self._entries.get(entry)
            if found is not None and found.saved == saved and found.used == used:
                return entry

    def _evict(self) -> None:
        entry = self._victim()
        found = self._entries.pop(entry)
        del self._recency[entry]
        del self._by_prompt[(found.key, found.prompt)]
        moved = self._shelves[found.key].remove(found.slot)
        if moved is not None:
            self._entries[moved].slot = found.slot
        self.evictions += 1
