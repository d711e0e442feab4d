"""SLO-aware admission and idempotent request ids for the router (LegoDiffusion §5.3).

Pure control-plane code: no grpc. A request is priced by :func:`request_cost`: pixels ×
steps relative to the profile's reference request, so a level's profiled latency times the
cost is what the request takes there (a 2048 × 2048, 1000-step request costs 80 reference
requests). The service checks twice. Before classifying, :func:`earliest_completion_s` over
the live workers (each at the cheapest level it could serve the request at, with its queue)
refuses what cannot finish in time anyway, so a refusal never waits for the classifier.
After routing, :func:`admit` gets the chosen worker's predicted completion time
(``RouteDecision.score``: (queue + 1) × t_proc, scaled by the cost) and rejects at once what
cannot finish before the deadline instead of queueing it without bound.

:class:`RequestLedger` remembers request ids for a window so a client's retry returns
the first call's result (or joins it while it runs) and the worker runs once. Its memory is
bounded twice under any load: at most ``max_entries`` ids, and at most ``max_bytes`` of kept
answers (images vary in size, so a count alone bounds nothing); an answer dropped for the byte
budget leaves its id behind, and a retry of it is refused (:class:`AnswerDroppedError`) rather
than run a second time.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from argus.quoting import quoted
from argus.types import ReferenceRequest

R = TypeVar("R")


@dataclass(frozen=True)
class AdmissionDecision:
    """Whether a routed request may go to its worker."""

    admitted: bool
    predicted_s: float  # predicted completion time on the chosen worker, seconds
    budget_s: float  # time left before the request's deadline, seconds
    retry_after_s: float  # when rejected: the predicted excess, a hint for the client's retry


def predicted_completion_s(queue_length: int, t_proc_s: float) -> float:
    """Seconds until a request routed now to a worker would finish there: ``(queue_length + 1)
    × t_proc_s``, the requests ahead of it plus itself, each taking the level's profiled
    latency on that worker's class.

    This is the scheduler's Eq. 3 score (``RouteDecision.score``); the simulator calls it to
    predict what the router predicts, so both admit the same requests.
    """
    return (queue_length + 1) * t_proc_s


@dataclass(frozen=True)
class AdmissionRule:
    """How sure the router must be that a request finishes in time before admitting it.

    The prediction ``(queue + 1) × t_proc`` charges the request in service a whole
    ``t_proc`` although part of it has run, and it is a mean: under overload admission fills
    every queue up to the deadline, so a request admitted on the mean finishes late whenever
    the services ahead of it run long. With adapters (ControlNet, LoRA loads) service times at
    one level spread enough that 8% of the admitted requests came in late in simulation at
    1.5 × capacity. The rule predicts the completion from what is known and admits on a
    quantile:

    * the request in service has ``t_proc − elapsed`` left (at least 0), where ``elapsed`` is
      how long it has run (a worker serves its queue in order, so it started when the one
      before it finished, which the router sees);
    * the ``n = queue + 1`` services still to run, each with squared coefficient of variation
      ``service_scv``, add a standard deviation of ``t_proc·√(scv·n)``, and the completion must
      fit the budget at the ``confidence`` quantile of the normal with those moments.
    """

    service_scv: float = 0.05
    """Squared coefficient of variation of one request's service time at a level (Katz's
    adapter mix on the default profile gives 0.02 to 0.07, most of it the rare LoRA load)."""

    confidence: float = 0.9
    """Probability the admitted request's completion fits the budget, by the normal model."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.service_scv) and self.service_scv >= 0.0):
            raise ValueError(f"service_scv: must be a finite number >= 0, got {self.service_scv}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence: must be in [0.5, 1), got {self.confidence}")

    @functools.cached_property
    def _z(self) -> float:
        """The normal quantile of ``confidence``, once per rule (admission runs per request)."""
        return statistics.NormalDist().inv_cdf(self.confidence)

    def completion_s(
        self, queue_length: int, t_proc_s: float, head_elapsed_s: float = 0.0
    ) -> float:
        """The ``confidence`` quantile of the completion time of a request routed now to a
        worker with ``queue_length`` requests (the one in service included, which has run for
        ``head_elapsed_s``), each taking ``t_proc_s``."""
        n = queue_length + 1
        done = min(max(head_elapsed_s, 0.0), t_proc_s) if queue_length else 0.0
        spread = self._z * t_proc_s * math.sqrt(self.service_scv * n)
        return predicted_completion_s(queue_length, t_proc_s) - done + spread


def admit(
    predicted_s: float, budget_s: float, *, min_retry_after_s: float = 0.05
) -> AdmissionDecision:
    """Admit when ``predicted_s`` fits in ``budget_s``; otherwise reject with a retry hint.

    The hint is the predicted excess (the queue must drain that much before the request
    would fit), at least ``min_retry_after_s``.
    """
    if predicted_s <= budget_s:
        return AdmissionDecision(True, predicted_s, budget_s, 0.0)
    excess = max(predicted_s - max(budget_s, 0.0), min_retry_after_s)
    return AdmissionDecision(False, predicted_s, budget_s, excess)


def request_cost(
    width: int | None, height: int | None, steps: int | None, reference: ReferenceRequest
) -> float:
    """What one request costs in units of the profile's reference request: its pixels × its
    steps over the reference's. A field the request leaves to the worker's default is priced
    at the reference's value (cost 1 in that dimension): the profile's latencies are what the
    router knows of a default request."""
    pixels = (width or reference.width) * (height or reference.height)
    return (
        pixels / (reference.width * reference.height) * (steps or reference.steps) / reference.steps
    )


@dataclass(frozen=True)
class WorkerLoad:
    """One live worker as the pre-classification check sees it (a snapshot, under the
    router's lock)."""

    queue_length: int  # the router's requests waiting or running there
    t_proc_s: float  # this request's service time there: the cheapest level it can serve × cost
    head_elapsed_s: float = 0.0  # how long the request in service has run


def earliest_completion_s(
    rule: AdmissionRule, workers: Sequence[WorkerLoad], ahead: int = 0
) -> tuple[float, float]:
    """``(loaded, idle)``: the earliest completion of a request over ``workers`` by ``rule``
    with their queues, and with every queue empty (what no wait can beat). ``ahead`` requests
    already passed this check and are being classified: they will take about
    ``ahead / len(workers)`` services of the cheapest worker first. ``(inf, inf)`` without
    workers."""
    if not workers:
        return math.inf, math.inf
    idle = min(rule.completion_s(0, w.t_proc_s) for w in workers)
    loaded = min(rule.completion_s(w.queue_length, w.t_proc_s, w.head_elapsed_s) for w in workers)
    cheapest = min(w.t_proc_s for w in workers)
    return loaded + ahead * cheapest / len(workers), idle


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
