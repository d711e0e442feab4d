"""Fan-out of the latest plan to any number of watchers, in constant memory per watcher.

Plans are whole snapshots: a watcher that missed a plan loses nothing by taking the newer
one. So the feed keeps no queue at all, only the latest item and a publish counter; each
reader remembers the counter of the item it last returned. A fast reader sees every item, a
slow one skips to the latest, and no reader can make the allocator hold more than one plan.
This is the "bounded per-watcher queue" with a bound of one that overwrites, without copies.

The number of readers is bounded too (``max_readers``): in the synchronous gRPC server each
open watch stream holds a thread, and heartbeats must always find one free.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class FeedClosedError(RuntimeError):
    """The feed or the reader was closed: no more items will come."""


class FeedFullError(RuntimeError):
    """``max_readers`` readers are already open."""


class LatestFeed(Generic[T]):
    """Publishes items; readers take the newest one they have not seen yet."""

    def __init__(self, max_readers: int) -> None:
        if max_readers < 1:
            raise ValueError(f"max_readers: must be >= 1, got {max_readers}")
        self.max_readers = max_readers
        self._cond = threading.Condition()
        self._item: T | None = None
        self._seq = 0  # publishes so far; the item's number
        self._readers = 0
        self._closed = False

    @property
    def readers(self) -> int:
        with self._cond:
            return self._readers

    def publish(self, item: T) -> None:
        """Make ``item`` the latest and wake every reader."""
        with self._cond:
            self._item = item
            self._seq += 1
            self._cond.notify_all()

    def latest(self) -> T | None:
        with self._cond:
            return self._item

    def reader(self) -> FeedReader[T]:
        """A new reader; its first :meth:`FeedReader.next` returns the current item at once."""
        with self._cond:
            if self._closed:
                raise FeedClosedError("the feed is closed")
            if self._readers >= self.max_readers:
                raise FeedFullError(f"the feed already has its maximum of {self.max_readers}")
            self._readers += 1
        return FeedReader(self)

    def close(self) -> None:
        """End every reader's wait (they raise :class:`FeedClosedError`); idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class FeedReader(Generic[T]):
    """One watcher's position in a :class:`LatestFeed`; close it when done."""

    def __init__(self, feed: LatestFeed[T]) -> None:
        self._feed = feed
        self._seen = 0
        self._closed = False

    def next(self, timeout_s: float | None = None) -> T | None:
        """The newest item not returned yet, waiting up to ``timeout_s`` for one (None then).

        Raises :class:`FeedClosedError` once the feed or this reader is closed.
        """
        feed = self._feed
        with feed._cond:
            ready = feed._cond.wait_for(
                lambda: self._closed or feed._closed or feed._seq > self._seen, timeout_s
            )
            if self._closed or feed._closed:
                raise FeedClosedError("the plan feed is closed")
            if not ready or feed._item is None:
                return None
            self._seen = feed._seq
            return feed._item

    def close(self) -> None:
        """Stop reading (wakes a waiting :meth:`next`); idempotent, safe from any thread."""
        feed = self._feed
        with feed._cond:
            if not self._closed:
                self._closed = True
                feed._readers -= 1
                feed._cond.notify_all()
