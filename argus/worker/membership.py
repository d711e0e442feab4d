"""A worker's membership in the cluster: heartbeats to the allocator, and following its plan.

:class:`Membership` runs one daemon thread per worker process. Every heartbeat interval (the
allocator's reply says how long) it sends a ``WorkerHeartbeat`` with the worker's id,
advertised address, class, queue length, current strategy, level and model, the loaded models,
the parts its last model load loaded with their seconds and the parts resident, and
the cache retrievals since the last accepted heartbeat; then it acts on the reply:

1. **Follow the plan.** When the assigned level (or the plan's strategy) differs from what the
   worker serves, call ``Worker.configure(..., wait=False)``: the new model loads in the
   background while the current one keeps serving. A level the worker refuses (unknown, no
   memory) is logged once and retried only when the plan changes it.
2. **Probe retrieval while asked to.** While the allocator runs SM because retrieval was slow
   or down it asks for probes; every ``probe_interval_s`` a single prober thread times one
   vector search of a fixed embedding (off the request path, never two at once; a probe still
   running when the next is due counts as a failure, so a hung vector database shows up).
   Results go into the next heartbeat.
3. **Tolerate the allocator being away.** A failed heartbeat (allocator down, restarting or
   full) is retried with exponential backoff; the worker keeps serving on its last level and
   logs once per state change, never per attempt. Retrievals since the last *accepted*
   heartbeat are kept, so nothing is lost by a failed one.

A worker joins only once it is ready (``Worker.ready``: its first model is loaded and has run
once, see ``Worker.warm_up``): routers must not be sent to a worker that cannot serve yet, nor
to one whose first request would outlast their deadline. ``stop`` ends the thread and sends
``leaving=True`` once, best effort with a short timeout, so the allocator re-plans at once
instead of after 3 missed heartbeats.

Retrieval figures: the cache keeps no per-lookup log, only counters and a window of recent
latencies (``CacheStats``). A heartbeat therefore reports the lookups since the previous one
(difference of the counters) as a summary: their count, the window's p50 and p99 of
search + fetch (a conservative sum), and the ``index-error`` misses as failures. Probes are
exact samples. The decisions (:func:`retrieval_since`, :func:`plan_change`,
:func:`next_backoff`) are pure functions; the class only schedules and acts.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from argus.contracts.wire import MAX_SAMPLES  # retrieval samples per heartbeat, at most
from argus.contracts.worker_control import LoadState
from argus.contracts.workers import (
    HeartbeatAnswer,
    RetrievalReport,
    WorkerReport,
    heartbeat_answer_from_pb,
    heartbeat_to_pb,
)
from argus.plumbing.grpc_server import check_address
from argus.types import Strategy
from argus.worker.engine import Worker

if TYPE_CHECKING:
    from argus.plumbing.internal_tls import InternalTLS
    from argus.worker.approx_cache.cache import CacheStats

log = logging.getLogger(__name__)

MIN_PROBE_INTERVAL_S = 0.01  # a zero interval from the allocator must not spin
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


class HeartbeatClient(Protocol):
    """What membership needs of its allocator connection (:class:`HeartbeatChannel`, or
    :class:`~argus.contracts.allocator_client.AllocatorClient`, or a scripted fake in tests)."""

    timeout_s: float

    def heartbeat(self, report: WorkerReport) -> HeartbeatAnswer: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MembershipConfig:
    """How a worker keeps in touch with the allocator (seconds throughout)."""

    min_backoff_s: float = 0.5
    """First retry delay after a failed heartbeat; doubles per failure up to ``max_backoff_s``."""
    max_backoff_s: float = 10.0
    """Longest retry delay while the allocator is away."""
    rpc_timeout_s: float = 2.0
    """Deadline of one heartbeat call."""
    leave_timeout_s: float = 1.0
    """Deadline of the ``leaving`` heartbeat sent on stop (best effort)."""
    ready_poll_s: float = 0.2
    """How often to check whether the worker is ready before joining."""

    def __post_init__(self) -> None:
        for name in ("min_backoff_s", "max_backoff_s", "rpc_timeout_s", "leave_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value}")
        if not (math.isfinite(self.ready_poll_s) and self.ready_poll_s > 0.0):
            raise ValueError(f"ready_poll_s: must be a finite number > 0, got {self.ready_poll_s}")
        if self.min_backoff_s > self.max_backoff_s:
            raise ValueError(
                f"min_backoff_s: {self.min_backoff_s} exceeds max_backoff_s {self.max_backoff_s}"
            )


class State(enum.Enum):
    """Where the worker stands with the allocator (logged when it changes)."""

    WAITING = "waiting"  # not ready yet (loading or warming up): not joined
    MEMBER = "member"  # the last heartbeat was answered
    UNREACHABLE = "unreachable"  # the last heartbeat failed: retrying with backoff
    STOPPED = "stopped"


@dataclass(frozen=True)
class MembershipStats:
    """A snapshot for logs and tests."""

    state: State
    beats: int  # heartbeats answered
    failures: int  # heartbeats that failed
    plan_version: int  # of the last answer, 0 before one
    epoch: str  # of the last answer, "" before one
    assigned_level: str  # of the last answer
    probing: bool  # the allocator asks for retrieval probes
    probes: int  # probes run
    last_error: str  # the last failure, "" if none


class HeartbeatChannel:
    """Heartbeats to one allocator over a channel that reconnects within ``max_reconnect_s``.

    Like :meth:`~argus.contracts.allocator_client.AllocatorClient.heartbeat` (same
    conversions), but gRPC's own reconnect backoff (by default growing to 120 s, during which
    calls fail at once) is capped: an allocator that restarts is rejoined within
    ``max_reconnect_s`` rather than minutes later, long after it declared the worker dead.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 2.0,
        max_reconnect_s: float = 10.0,
        tls: InternalTLS | None = None,
    ):
        from argus.plumbing import rpc
        from argus.plumbing.grpc_server import reconnect_options
        from argus.plumbing.internal_tls import channel

        options = reconnect_options(max_reconnect_s)
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, tls, options)
        self._stub = rpc.load("allocator_pb2_grpc").AllocatorStub(self._channel)

    def heartbeat(self, report: WorkerReport) -> HeartbeatAnswer:
        """Send one heartbeat; errors are ``grpc.RpcError`` with the service's codes."""
        reply = self._stub.Heartbeat(heartbeat_to_pb(report), timeout=self.timeout_s)
        return heartbeat_answer_from_pb(reply)

    def close(self) -> None:
        self._channel.close()


# -- decisions (pure) ------------------------------------------------------------------------


def default_advertise(host: str, port: int) -> str:
    """The address reported when none is given: the bound one, or this machine's name when the
    worker binds every interface (``0.0.0.0`` is no address a router can reach)."""
    if host in WILDCARD_HOSTS:
        name = socket.gethostname()
        log.warning(
            "worker binds %s: advertising %s:%d; pass --advertise if routers cannot reach it",
            host or "every interface",
            name,
            port,
        )
        return f"{name}:{port}"
    return f"{host}:{port}"


def plan_change(
    answer: HeartbeatAnswer, level: str, strategy: Strategy
) -> tuple[Strategy, str] | None:
    """The (strategy, level) to configure, or None when the worker already follows the plan
    or is not in it (an empty assigned level: keep serving what it serves)."""
    if not answer.assigned_level:
        return None
    if (answer.assigned_level, answer.strategy) == (level, strategy):
        return None
    return answer.strategy, answer.assigned_level


def next_backoff(delay_s: float, config: MembershipConfig) -> float:
    """The retry delay after one more failure."""
    return min(2.0 * delay_s, config.max_backoff_s)


def retrieval_since(
    before: CacheStats | None, after: CacheStats | None, probes: Sequence[float | None] = ()
) -> RetrievalReport:
    """Cache retrievals between two ``CacheStats`` snapshots, plus probe results.

    Without probes: a summary of the lookups in between (count, the window's p50/p99 of
    search + fetch), ``index-error`` misses as failures. With probes: exact samples (the probes,
    then the summary spread as the allocator would: ``ceil(1%)`` at p99, the rest at p50),
    at most :data:`MAX_SAMPLES`; failed probes add to the failures.
    """
    count = failures = 0
    p50 = p99 = 0.0
    if before is not None and after is not None:
        lookups = _lookups(after) - _lookups(before)
        failures = after.misses["index-error"] - before.misses["index-error"]
        count = max(0, lookups - failures)
        if count:
            p50 = after.search_p50_s + after.fetch_p50_s
            p99 = after.search_p99_s + after.fetch_p99_s
    ok = [p for p in probes if p is not None]
    failures = max(0, failures) + sum(p is None for p in probes)
    if not ok:
        return RetrievalReport(count=count, p50_s=p50, p99_s=p99, failures=failures)
    summary = RetrievalReport(count=min(count, max(0, MAX_SAMPLES - len(ok))), p50_s=p50, p99_s=p99)
    spread = [s for s in summary.observations() if s is not None]
    samples = tuple((ok + spread)[:MAX_SAMPLES])
    return RetrievalReport(samples_s=samples, count=count, p50_s=p50, p99_s=p99, failures=failures)


def _lookups(stats: CacheStats) -> int:
    return int(stats.hits) + int(sum(stats.misses.values()))


# -- the agent -------------------------------------------------------------------------------


class Membership:
    """Heartbeats for one worker in a daemon thread; ``start`` it, ``stop`` it (idempotent).

    ``beat_once`` and ``probe_once`` are the loop's steps, public so tests can drive them
    without the thread. ``clock`` (monotonic seconds) only schedules; waits use real time.
    """

    def __init__(
        self,
        worker: Worker,
        client: HeartbeatClient,
        *,
        advertise: str,
        worker_class: str,
        config: MembershipConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.worker = worker
        self.client = client
        self.advertise = check_address(advertise, "advertise")
        self.worker_class = worker_class
        self.config = config or MembershipConfig()
        self.client.timeout_s = self.config.rpc_timeout_s
        self._clock = clock
        self._timer = timer
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval-probe")
        self._probe: Future[float | None] | None = None
        self._probes: deque[float | None] = deque(maxlen=MAX_SAMPLES)
        self._baseline = self._cache_stats()  # lookups before the start are not reported
        self._state = State.WAITING
        self._logged: tuple[State, str] | None = None  # the last (state, epoch) logged
        self._refused_level = ""
        self._answer: HeartbeatAnswer | None = None
        self._counts = {"beats": 0, "failures": 0, "probes": 0}
        self._last_error = ""
        self._backoff_s = self.config.min_backoff_s
        self._next_beat_s = clock()
        self._next_probe_s = math.inf  # inf: not probing
        self._probe_interval_s = MIN_PROBE_INTERVAL_S
        self._warned_no_cache = False
        self._started = self._stopped = False

    @property
    def worker_id(self) -> str:
        return self.worker.config.worker_id

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        self._thread.start()

    def stop(self) -> None:
        """End the loop, then tell the allocator this worker is leaving (once, best effort)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(self.config.rpc_timeout_s + 1.0)
        self._prober.shutdown(wait=False, cancel_futures=True)
        if self._started:
            self._leave()
        self.client.close()
        with self._lock:
            self._state = State.STOPPED

    def _leave(self) -> None:
        report = WorkerReport(self.worker_id, self.advertise, self.worker_class, leaving=True)
        self.client.timeout_s = self.config.leave_timeout_s
        try:
            self.client.heartbeat(report)
            log.info("worker %s left the allocator", self.worker_id)
        except Exception as err:  # the allocator drops it after 3 missed heartbeats anyway
            log.info("worker %s could not say it is leaving: %s", self.worker_id, _describe(err))

    def _run(self) -> None:
        while not self._stopping.is_set():
            now = self._clock()
            if now >= self._next_beat_s:
                try:
                    self.beat_once()
                except Exception:  # a bug here must not end membership: keep beating
                    log.exception("heartbeat step failed")
                    self._next_beat_s = self._clock() + self.config.max_backoff_s
            if now >= self._next_probe_s:
                self._start_probe()
            wake = min(self._next_beat_s, self._next_probe_s)
            self._stopping.wait(max(0.0, wake - self._clock()))

    # -- one heartbeat ---------------------------------------------------------------------

    def beat_once(self) -> HeartbeatAnswer | None:
        """Send one heartbeat and act on the answer; None if none was sent or it failed."""
        if not self.worker.ready:
            self._set_state(State.WAITING, "the first model is loading or warming up")
            self._next_beat_s = self._clock() + self.config.ready_poll_s
            return None
        after = self._cache_stats()
        with self._lock:
            probes = list(self._probes)
        report = self._report(retrieval_since(self._baseline, after, probes))
        try:
            answer = self.client.heartbeat(report)
        except Exception as err:
            self._failed(err)
            return None
        self._baseline = after  # reported: the next heartbeat counts from here
        with self._lock:
            for _ in probes:
                self._probes.popleft()
        self._answered(answer)
        return answer

    def _report(self, retrieval: RetrievalReport) -> WorkerReport:
        worker = self.worker
        level = worker.level
        loaded = tuple(m.name for m in worker.registry.infos() if m.state is LoadState.READY)
        last_model, last_parts = worker.registry.last_load()
        return WorkerReport(
            worker_id=self.worker_id,
            address=self.advertise,
            worker_class=self.worker_class,
            queue_length=worker.queue_length,
            strategy=worker.strategy,
            level=level.name,
            model=worker.registry.active_name or "",
            loaded_models=loaded,
            retrieval=retrieval,
            last_load_model=last_model,
            last_load_parts=tuple(sorted(last_parts.items())),
            resident_parts=tuple(worker.registry.components()),
        )

    def _failed(self, err: Exception) -> None:
        detail = _describe(err)
        with self._lock:
            self._counts["failures"] += 1
            self._last_error = detail
        self._set_state(State.UNREACHABLE, detail)
        self._next_beat_s = self._clock() + self._backoff_s
        self._backoff_s = next_backoff(self._backoff_s, self.config)

    def _answered(self, answer: HeartbeatAnswer) -> None:
        with self._lock:
            self._answer = answer
            self._counts["beats"] += 1
        self._set_state(State.MEMBER, "", answer.epoch)
        self._backoff_s = self.config.min_backoff_s
        interval = answer.heartbeat_interval_s
        self._next_beat_s = self._clock() + (interval if interval > 0 else self._backoff_s)
        self._follow(answer)
        self._schedule_probes(answer)

    def _follow(self, answer: HeartbeatAnswer) -> None:
        """Configure the worker for the plan; a refused level is logged once."""
        change = plan_change(answer, self.worker.level.name, self.worker.strategy)
        if change is None or change[1] == self._refused_level:
            return
        strategy, level = change
        try:
            loading = self.worker.configure(strategy=strategy, level=level, wait=False)
        except Exception as err:
            self._refused_level = level
            log.error("cannot serve assigned level %s (%s): %s", level, strategy, err)
            return
        self._refused_level = ""
        log.info(
            "plan %d: serving %s (%s); loading in the background",
            answer.plan_version,
            level,
            strategy,
        )
        loading.add_done_callback(lambda f: _log_load(f, level))

    # -- retrieval probes ------------------------------------------------------------------

    def _schedule_probes(self, answer: HeartbeatAnswer) -> None:
        """Probe from now on while the allocator asks for it (and there is a cache to probe)."""
        if not answer.probe_retrieval:
            self._next_probe_s = math.inf
            return
        if self.worker.cache is None:
            if not self._warned_no_cache:
                log.warning("the allocator asks for retrieval probes but this worker has no cache")
                self._warned_no_cache = True
            return
        self._probe_interval_s = max(answer.probe_interval_s, MIN_PROBE_INTERVAL_S)
        if self._next_probe_s == math.inf:  # probing starts now
            self._next_probe_s = self._clock()

    def _start_probe(self) -> None:
        """Submit a probe to the prober thread; one still running counts as a failure."""
        self._next_probe_s = self._clock() + self._probe_interval_s
        if self._probe is not None and not self._probe.done():
            with self._lock:
                self._probes.append(None)
            return
        with contextlib.suppress(RuntimeError):  # the prober was shut down by stop()
            self._probe = self._prober.submit(self.probe_once)

    def probe_once(self) -> float | None:
        """Time one vector search of a fixed embedding; record and return its latency, or None
        (recorded as a failure) when the search raised. Needs a cache."""
        cache = self.worker.cache
        assert cache is not None
        vector = np.full(cache.dim, 1.0 / math.sqrt(cache.dim), dtype=np.float32)
        began = self._timer()
        try:
            cache.index.search(vector, self._probe_tag())
            latency: float | None = self._timer() - began
        except Exception as err:
            log.debug("retrieval probe failed: %s", err)
            latency = None
        with self._lock:
            self._probes.append(latency)
            self._counts["probes"] += 1
        return latency

    def _probe_tag(self) -> str:
        """The cache key of the worker's default requests on its active model, so the probe
        searches where requests would."""
        from argus.worker.approx_cache.cache import CacheKey

        model = self.worker.registry.active()
        cfg = self.worker.config
        return CacheKey(
            model=model.name if model is not None else "probe",
            scheduler=model.scheduler_name if model is not None else "probe",
            height=cfg.default_height,
            width=cfg.default_width,
            steps=cfg.default_steps,
        ).tag

    # -- stats and logs --------------------------------------------------------------------

    def stats(self) -> MembershipStats:
        with self._lock:
            answer = self._answer
            return MembershipStats(
                state=self._state,
                beats=self._counts["beats"],
                failures=self._counts["failures"],
                plan_version=answer.plan_version if answer else 0,
                epoch=answer.epoch if answer else "",
                assigned_level=answer.assigned_level if answer else "",
                probing=bool(answer and answer.probe_retrieval),
                probes=self._counts["probes"],
                last_error=self._last_error,
            )

    def _set_state(self, state: State, detail: str, epoch: str = "") -> None:
        """Record the state; log only when it changes (for MEMBER: or the allocator's epoch)."""
        with self._lock:
            self._state = state
        key = (state, epoch)
        if key == self._logged:
            return
        self._logged = key
        if state is State.MEMBER:
            log.info("worker %s joined the allocator (epoch %s)", self.worker_id, epoch)
        elif state is State.UNREACHABLE:
            log.warning("allocator unreachable (%s); retrying with backoff, still serving", detail)
        else:
            log.info("worker %s not joining yet: %s", self.worker_id, detail)

    def _cache_stats(self) -> CacheStats | None:
        cache = self.worker.cache
        stats: CacheStats | None = cache.stats() if cache is not None else None
        return stats


def _describe(err: Exception) -> str:
    code = getattr(err, "code", None)
    if callable(code):
        details = getattr(err, "details", lambda: "")()
        return f"{code().name}: {details}" if details else str(code().name)
    return f"{type(err).__name__}: {err}"


def _log_load(future: Future[Any], level: str) -> None:
    err = future.exception()
    if err is not None:
        log.error("loading the model of level %s failed: %s", level, err)
