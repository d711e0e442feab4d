"""The approximate cache's changes, published for routers that mirror what each worker caches.

Every entry the cache creates is an insert (its id, its key's tag and the prompt's embedding,
so a mirror needs no encoder) and every entry it deletes an eviction; :class:`CacheEventLog`
numbers them in one sequence and keeps the latest ``capacity`` of them. A caller sends its
cursor (:class:`~argus.contracts.generate.CacheCursor`: the log's id and the last number it
applied) on a Generate call and the reply carries what followed (:meth:`CacheEventLog.since`),
at most ``per_reply`` events, so a mirror far behind catches up over several replies.

Why a cursor per caller and not a queue drained into the next reply (as the quality scores
are, :mod:`argus.worker.scoring`): a cluster runs several routers, and each needs every
change; a drained queue would give each router a share of them. The log keeps no state per
caller, so any number of routers read it.

When the mirror cannot be complete the reply says ``truncated``: events after the caller's
cursor fell out of the bounded log, or the cache recovered entries from disk at start, which
no event described (a restarted worker's log starts with a gap, numbered 1, that no cursor
of 0 covers). Each log has an id of its own, new at every start, so a cursor of an earlier
process reads as 0. A mirror told ``truncated`` forgets what it held for the worker and
applies the events it got; it then mirrors a subset of the cache, which at worst predicts a
miss where the worker would hit.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from argus.contracts.generate import (
    CacheCursor,
    CacheEvent,
    CacheEvents,
    CacheEvict,
    CacheInsert,
)

DEFAULT_CAPACITY = 4096  # events kept: about 6 MiB of 384-d embeddings
DEFAULT_PER_REPLY = 256  # events on one reply at most: about 400 KB


class CacheEventLog:
    """A bounded, numbered log of a cache's inserts and evictions; thread-safe.

    ``recovered``: the cache started with entries no event describes, so a cursor of 0 is
    told ``truncated``. ``log_id``: None makes a fresh random one (tests pass their own)."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        per_reply: int = DEFAULT_PER_REPLY,
        recovered: bool = False,
        log_id: str | None = None,
    ) -> None:
        if capacity < 1 or per_reply < 1:
            raise ValueError(f"capacity, per_reply: must be >= 1, got {capacity}, {per_reply}")
        self.log_id = log_id or uuid.uuid4().hex
        self.capacity = capacity
        self.per_reply = per_reply
        self._lock = threading.Lock()
        self._events: deque[CacheEvent] = deque()  # numbered _last - len + 1 … _last
        # the last number nobody can read any more (dropped, or the recovered entries' gap)
        self._dropped = 1 if recovered else 0
        self._last = self._dropped

    @property
    def last(self) -> int:
        """The number of the latest event (0: none yet)."""
        with self._lock:
            return self._last

    def inserted(self, entry_id: str, tag: str, vector: npt.NDArray[np.float32]) -> None:
        """The cache created ``entry_id`` under ``tag`` for a prompt embedded as ``vector``."""
        values = np.asarray(vector, dtype=np.float32).tolist()
        self._append([CacheInsert(entry_id, tag, tuple(values))])

    def evicted(self, entry_ids: Iterable[str]) -> None:
        """The cache deleted these entries."""
        self._append([CacheEvict(entry_id) for entry_id in entry_ids])

    def _append(self, events: list[CacheEvent]) -> None:
        with self._lock:
            for event in events:
                self._events.append(event)
                self._last += 1
                if len(self._events) > self.capacity:
                    self._events.popleft()
                    self._dropped = self._last - len(self._events)

    def since(self, cursor: CacheCursor) -> CacheEvents:
        """The events after ``cursor`` (the whole log for another log's cursor), oldest first,
        at most ``per_reply``; truncated when some after it can no longer be read."""
        with self._lock:
            after = cursor.after if cursor.log_id == self.log_id else 0
            if after > self._last:  # a cursor from the future: read it as a fresh one
                after = 0
            first = self._last - len(self._events) + 1  # the number of _events[0]
            start = max(after + 1, first)
            skip = start - first
            taken = list(itertools.islice(self._events, skip, skip + self.per_reply))
            return CacheEvents(
                log_id=self.log_id,
                last=start + len(taken) - 1 if taken else self._last,
                events=tuple(taken),
                truncated=after < self._dropped,
            )
