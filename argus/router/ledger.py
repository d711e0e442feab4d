"""The router's request-id ledger: a client's retry returns the first call's answer.

:class:`RequestLedger` remembers request ids for a window so a client's retry returns
the first call's result (or joins it while it runs) and the worker runs once. Its memory is
bounded twice under any load: at most ``max_entries`` ids, and at most ``max_bytes`` of kept
answers (images vary in size, so a count alone bounds nothing); an answer dropped for the byte
budget leaves its id behind, and a retry of it is refused (:class:`AnswerDroppedError`) rather
than run a second time.

Pure control-plane code (no grpc). The router's core claims a request's id after checking it
and before serving it, apart from admission (``argus/router/admission.py``), which decides
whether the request runs at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from argus.plumbing.quoting import quoted

R = TypeVar("R")


class IdConflictError(ValueError):
    """A request id was reused with a different request inside the window."""


class AnswerDroppedError(LookupError):
    """A retried request id finished inside the window, but its answer was dropped to keep
    the ledger within its byte budget: the request is not run twice."""


@dataclass(slots=True)
class _Entry(Generic[R]):
    fingerprint: Hashable
    future: Future[R] | None  # while the first call runs: what retries join
    done_at: float | None = None  # clock time the call finished; None while it runs
    # once finished: (result,) while kept, None once dropped for the byte budget (kept bare,
    # not in its Future: a Future brings a Condition, a lock and a deque, ten objects per id)
    answer: tuple[R] | None = None
    nbytes: int = 0  # the kept answer's size, by the ledger's ``size_of``


@dataclass(frozen=True)
class LedgerStats:
    """What a ledger holds now, and the answers it dropped since it was made."""

    running: int  # ids whose first call runs
    answers: int  # finished ids whose answer is kept
    dropped: int  # finished ids whose answer was dropped (retries are refused)
    bytes: int  # size of the kept answers
    evicted: int  # answers dropped for the byte budget, in all


class RequestLedger(Generic[R]):
    """Request id → the call's future, for ``window_s`` after it finished.

    ``claim(id, fingerprint)`` returns ``(future, owner)``: ``owner`` is True for the first
    call, which must run the request and ``finish`` it; a retry while it runs gets the same
    future, and one after it finished a done future with its answer. Failed calls are
    forgotten at once, so a retry after an error runs again.

    Two bounds keep the memory bounded under any load. ``max_bytes`` (by ``size_of`` of each
    answer; None: no byte bound): when the kept answers exceed it, the oldest are dropped
    first (``on_evict`` is called for each, a metric's ``inc``); the id stays, and its retry
    raises :class:`AnswerDroppedError` until the window ends, since running it again would
    break the promise that a retry never runs twice. An answer larger than the whole budget is
    never kept. ``max_entries`` counts every id held: when full, the oldest finished ids are
    forgotten (those without an answer first), and a retry of a forgotten id runs again; when
    every id is still running, ``claim`` raises ``LedgerFullError`` (the in-flight bound
    normally rejects earlier).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        window_s: float,
        max_entries: int,
        max_bytes: int | None = None,
        size_of: Callable[[R], int] | None = None,
        on_evict: Callable[[], object] | None = None,
    ) -> None:
        if window_s < 0.0:
            raise ValueError(f"window_s: must be >= 0, got {window_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        if max_bytes is not None and (max_bytes < 0 or size_of is None):
            raise ValueError(f"max_bytes: must be >= 0 and come with size_of, got {max_bytes}")
        self._clock = clock
        self.window_s = window_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._running: dict[str, _Entry[R]] = {}
        # finished ids in finishing order: with their answer, and without (dropped for bytes)
        self._finished: OrderedDict[str, _Entry[R]] = OrderedDict()
        self._dropped: OrderedDict[str, _Entry[R]] = OrderedDict()
        self._bytes = 0
        self._evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._running) + len(self._finished) + len(self._dropped)

    def stats(self) -> LedgerStats:
        with self._lock:
            return LedgerStats(
                len(self._running),
                len(self._finished),
                len(self._dropped),
                self._bytes,
                self._evicted,
            )

    def claim(self, request_id: str, fingerprint: Hashable) -> tuple[Future[R], bool]:
        with self._lock:
            self._expire()
            entry = (
                self._running.get(request_id)
                or self._finished.get(request_id)
                or self._dropped.get(request_id)
            )
            if entry is not None:
                if entry.fingerprint != fingerprint:
                    raise IdConflictError(
                        f"request_id: {quoted(request_id)} was used for a different request"
                    )
                if entry.future is not None:
                    return entry.future, False
                if entry.answer is None:
                    raise AnswerDroppedError(
                        f"request_id: {quoted(request_id)} was served, but its answer is no "
                        f"longer kept (the router keeps {self.max_bytes} bytes of answers); "
                        "send the request again with a new request_id to run it again"
                    )
                done: Future[R] = Future()
                done.set_result(entry.answer[0])
                return done, False
            if len(self._running) >= self.max_entries:
                raise LedgerFullError(f"{len(self._running)} request ids in flight")
            future: Future[R] = Future()
            self._running[request_id] = _Entry(fingerprint, future)
            return future, True

    def finish(self, request_id: str, result: R) -> None:
        """The owner's call succeeded: retries within the window get ``result``, while it
        fits the byte budget."""
        nbytes = self._size_of(result) if self._size_of is not None else 0
        with self._lock:
            entry = self._running.pop(request_id, None)
            future = entry.future if entry is not None else None
            if entry is not None:
                entry.done_at, entry.future = self._clock(), None
                if self.max_bytes is not None and nbytes > self.max_bytes:
                    self._drop_answer(request_id, entry)
                else:
                    entry.answer, entry.nbytes = (result,), nbytes
                    self._finished[request_id] = entry
                    self._bytes += nbytes
                    while self.max_bytes is not None and self._bytes > self.max_bytes:
                        self._drop_answer(*self._finished.popitem(last=False))
        if future is not None:
            future.set_result(result)

    def fail(self, request_id: str, error: BaseException) -> None:
        """The owner's call failed: joined retries get ``error``; later ones run again."""
        with self._lock:
            entry = self._running.pop(request_id, None)
        if entry is not None and entry.future is not None:
            entry.future.set_exception(error)

    def _drop_answer(self, request_id: str, entry: _Entry[R]) -> None:
        """Keep the finished id without its answer (under the lock)."""
        self._bytes -= entry.nbytes
        entry.answer, entry.nbytes = None, 0
        self._dropped[request_id] = entry
        self._evicted += 1
        if self._on_evict is not None:
            self._on_evict()

    def _expire(self) -> None:
        """Forget finished ids older than the window, and the oldest finished ones when full
        (those without an answer first).

        Finished ids are kept in finishing order, so this stops at the first one that stays:
        the cost is the number dropped, not the number held. (An answer too large for the
        whole budget goes to ``_dropped`` when it finishes, possibly ahead of older ids
        dropped later; it is then forgotten a little late, never early.)"""
        now = self._clock()
        for held in (self._dropped, self._finished):
            while held:
                oldest = next(iter(held.values()))
                assert oldest.done_at is not None
                full = (
                    len(self._running) + len(self._finished) + len(self._dropped)
                    >= self.max_entries
                )
                if not full and now - oldest.done_at <= self.window_s:
                    break
                held.popitem(last=False)
                self._bytes -= oldest.nbytes


class LedgerFullError(RuntimeError):
    """Every remembered request id is still running."""
