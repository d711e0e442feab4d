"""``argus replay --live``: replay a workload against a running cluster, report like the simulator.

The live load generator sends the same :class:`~argus.sim.workloads.Workload` the simulator
replays to a router (``argus.v1.Router/Generate``), open loop: request ``i`` leaves at
``arrival_s[i] / speedup`` seconds after the start, whether or not earlier ones have answered.
Each request carries a unique ``request_id`` (``<run id>-<i>``), the workload's prompt, the seed
``seed + i``, the default size and steps (unless :class:`LiveConfig` sets them), no adapters,
and ``deadline_ms`` = the simulator's SLO (:func:`argus.slo.default_slo_s` on the default
:class:`SimConfig`'s GPU class, 3 × 4.2 s = 12.6 s with the default profiles) minus how late the
request leaves.

Memory stays bounded: at most ``max_outstanding`` calls are in flight (gRPC futures; their
answers are recorded by callbacks). A request that finds every slot taken, or that the sender
reaches more than ``max_lag_s`` after its time, is not sent: it is *dropped*.

Every request ends in one :class:`RequestRecord`, and the records become a
:class:`~argus.sim.cluster.RunResult`, so :mod:`argus.sim.report` writes the same
``summary.json``, ``per_minute.csv`` and ``timeseries.png`` and prints the same table:

* **served** (status OK): ``finish_s = arrival_s + latency``; the level, worker and quality
  score of the answer; an SLO violation when the latency exceeds the SLO.
* **rejected** (RESOURCE_EXHAUSTED: admission predicted a missed deadline, or the router or a
  worker was full): never finishes (below).
* **failed** (any other status: UNAVAILABLE, DEADLINE_EXCEEDED, INVALID_ARGUMENT, the client's
  own timeout, ...): never finishes.
* **dropped** (not sent: every slot taken, or the sender fell behind): never finishes.

``sent = served + rejected + failed``; every request of the workload is one of the four.

The simulator serves every request eventually; what it cannot serve in time shows as a request
that is offered, not served within the run, an SLO violation, and outside the quality means.
A request that never finishes is given exactly that: a finish time past the end of the run's
last minute, so :func:`~argus.sim.report.summarise` and :func:`~argus.sim.report.per_minute`
count it as offered, not served and violated, and leave it out of effective quality. The
counts per outcome and per status go into the report's description and ``requests.csv``.

Arrivals stay on the trace's clock and latency on the wall clock; quality is looked up as the
simulator does; what the client cannot see is estimated from the answers
(``docs/control-plane-internals.md`` says how).
"""

from __future__ import annotations

import csv
import itertools
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from argus.contracts.quality import QualityTable
from argus.contracts.wire import STRATEGY_FROM_PB as _STRATEGY_FROM_PB
from argus.plumbing import rpc
from argus.sim.cluster import RunResult, SimConfig
from argus.sim.workloads import Workload
from argus.slo import default_slo_s
from argus.types import ProfileSet, Strategy

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

NOT_SENT = "NOT_SENT"
"""Status of a request that was dropped before it was sent."""

_UINT64 = (1 << 64) - 1


class LiveError(Exception):
    """The router cannot be reached or the replay cannot start; the message is one line."""


@dataclass(frozen=True)
class LiveConfig:
    """How a live replay drives the router."""

    address: str
    """HOST:PORT of the router."""

    speedup: float = 60.0
    """Trace seconds per wall-clock second: request i leaves at arrival_s[i] / speedup."""

    limit: int | None = None
    """Send at most the first this many requests; None: all."""

    window_s: float | None = None
    """Only the requests arriving in the trace's first this many seconds; None: all."""

    max_outstanding: int = 256
    """Calls in flight at most; a request that finds them all taken is dropped."""

    slo_s: float | None = None
    """Latency objective, seconds; None: the simulator's (:func:`simulator_slo_s`)."""

    max_lag_s: float | None = None
    """A request the sender reaches later than this after its time is dropped; None: the SLO."""

    timeout_s: float | None = None
    """The client's gRPC timeout per call, seconds; None: the SLO + 10 s."""

    seed: int = 0
    """Request i carries seed + i."""

    width: int | None = None
    height: int | None = None
    steps: int | None = None
    """Image size and denoising steps; None: the router's and worker's defaults."""

    run_id: str | None = None
    """Prefix of the request ids; None: a random one (ids must not repeat across runs)."""

    auth_token: str | None = None
    """Bearer token, sent as ``authorization: Bearer <token>`` metadata on every call."""

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address: must be HOST:PORT, got an empty string")
        if not (math.isfinite(self.speedup) and self.speedup > 0.0):
            raise ValueError(f"speedup: must be > 0, got {self.speedup}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit: must be >= 1, got {self.limit}")
        if self.window_s is not None and not self.window_s > 0.0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding: must be >= 1, got {self.max_outstanding}")
        for name in ("slo_s", "max_lag_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name}: must be > 0, got {value}")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request of the workload."""

    index: int  # the request's index in the workload (its prompt row: index % prompts)
    request_id: str
    arrival_s: float  # trace clock
    status: str  # "OK", a gRPC status name, or NOT_SENT
    latency_s: float = math.nan  # wall clock, from when it was due to leave to its answer
    level: str = ""  # the level served
    level_index: int = -1  # its index among the strategy's levels (the router's)
    strategy: str = ""  # "AC" or "SM"
    worker_id: str = ""
    classified_level: str = ""  # the router classifier's optimal level for the prompt
    plan_version: int = 0
    worker_busy_s: float = 0.0  # the worker's own time less its queue time, wall clock
    detail: str = ""  # the error's details (first line), or why it was not sent

    @property
    def outcome(self) -> str:
        """``served``, ``rejected``, ``failed`` or ``dropped`` (see the module docstring)."""
        if self.status == "OK":
            return "served"
        if self.status == "RESOURCE_EXHAUSTED":
            return "rejected"
        if self.status == NOT_SENT:
            return "dropped"
        return "failed"


@dataclass(frozen=True)
class LiveCounts:
    """Requests by outcome: ``sent = served + rejected + failed``; ``total = sent + dropped``."""

    served: int
    rejected: int
    failed: int
    dropped: int
    late: int  # served, but later than the SLO

    @property
    def sent(self) -> int:
        return self.served + self.rejected + self.failed

    @property
    def total(self) -> int:
        return self.sent + self.dropped


@dataclass(frozen=True)
class LiveResult:
    """A live replay: the per-request records and their RunResult for the report code."""

    run: RunResult
    records: tuple[RequestRecord, ...]
    address: str
    speedup: float
    wall_s: float  # wall-clock seconds from the first request's time to the last answer

    @property
    def counts(self) -> LiveCounts:
        outcomes = Counter(r.outcome for r in self.records)
        late = sum(1 for r in self.records if r.status == "OK" and r.latency_s > self.run.slo_s)
        return LiveCounts(
            outcomes["served"], outcomes["rejected"], outcomes["failed"], outcomes["dropped"], late
        )

    def statuses(self) -> dict[str, int]:
        """Requests per status, most frequent first."""
        return dict(Counter(r.status for r in self.records).most_common())

    def describe(self) -> dict[str, str]:
        """Entries for the report's description (``summary.json``)."""
        c = self.counts
        return {
            "live": self.address,
            "speedup": f"{self.speedup:g} (arrivals on the trace's clock; latency in wall seconds)",
            "slo_s": f"{self.run.slo_s:g}",
            "sent": str(c.sent),
            "served": str(c.served),
            "rejected": str(c.rejected),
            "failed": str(c.failed),
            "dropped": str(c.dropped),
            "late": str(c.late),
            "statuses": ", ".join(f"{k} {v}" for k, v in self.statuses().items()),
            "workers_seen": str(self.run.gpus),
            "wall_s": f"{self.wall_s:.1f}",
        }


# -- the channel ----------------------------------------------------------------------------


def open_channel(
    address: str, *, tls_ca: bytes | None = None, connect_timeout_s: float = 5.0
) -> grpc.Channel:
    """A channel to the router once it is connected; LiveError when it cannot connect.

    A refused connection or failed TLS handshake fails at once (the channel's first
    TRANSIENT_FAILURE); otherwise the channel has ``connect_timeout_s`` to become ready.
    """
    if tls_ca is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=tls_ca)
        )
    settled = threading.Event()
    seen: list[grpc.ChannelConnectivity] = []

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (
            grpc.ChannelConnectivity.READY,
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        ):
            seen.append(state)
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        settled.wait(connect_timeout_s)
    finally:
        channel.unsubscribe(watch)
    if seen and seen[0] is grpc.ChannelConnectivity.READY:
        return channel
    channel.close()
    why = f"connection {seen[0].name}" if seen else f"not ready in {connect_timeout_s:g} s"
    raise LiveError(f"cannot reach the router at {address} ({why})")


# -- the load generator ---------------------------------------------------------------------


def selected_count(workload: Workload, limit: int | None, window_s: float | None) -> int:
    """How many of the workload's first requests a replay sends (arrivals are sorted)."""
    n = len(workload)
    if window_s is not None:
        n = int(np.searchsorted(workload.arrivals_s, window_s, side="left"))
    return n if limit is None else min(n, limit)


def build_request(
    workload: Workload, i: int, config: LiveConfig, run_id: str, deadline_s: float
) -> Any:
    """The RouterGenerateRequest of request ``i``, due within ``deadline_s`` seconds."""
    request = router_pb2.RouterGenerateRequest(
        request_id=f"{run_id}-{i}",
        prompt=workload.prompt(i).prompt,
        seed=(config.seed + i) & _UINT64,
        deadline_ms=max(1, round(deadline_s * 1e3)),
    )
    for name in ("width", "height", "steps"):
        value = getattr(config, name)
        if value is not None:
            setattr(request, name, value)
    return request


class LoadGenerator:
    """Sends a workload's requests open loop and records how each ended; one run per object.

    ``run`` is called once, from one thread; answers are recorded by gRPC's callbacks.
    """

    def __init__(
        self,
        stub: Any,
        workload: Workload,
        config: LiveConfig,
        slo_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.stub = stub
        self.workload = workload
        self.config = config
        self.slo_s = slo_s
        self.max_lag_s = config.max_lag_s if config.max_lag_s is not None else slo_s
        self.timeout_s = config.timeout_s if config.timeout_s is not None else slo_s + 10.0
        self.run_id = config.run_id or f"replay-{uuid.uuid4().hex[:12]}"
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else ()
        )
        self._clock = clock
        self._sleep = sleep
        self._progress = progress
        self._count = selected_count(workload, config.limit, config.window_s)
        self._records: list[RequestRecord | None] = [None] * self._count
        self._lock = threading.Condition()
        self._in_flight: dict[int, Any] = {}  # request -> its call (at most max_outstanding)
        self._last_answer = 0.0

    def run(self) -> tuple[list[RequestRecord], float]:
        """Send every selected request at its time, wait for the answers; (records, wall_s)."""
        arrivals = self.workload.arrivals_s[: self._count].tolist()
        started = self._clock()
        self._last_answer = started
        for i, arrival in enumerate(arrivals):
            due = started + arrival / self.config.speedup
            wait = due - self._clock()
            if wait > 0.0:
                self._sleep(wait)
            self._send(i, arrival, due)
            if self._progress is not None and i % 50 == 49:
                self._progress(i + 1)
        self._drain()
        if self._progress is not None and self._count % 50:
            self._progress(self._count)
        with self._lock:
            records = [
                r if r is not None else self._lost(i, arrivals[i])
                for i, r in enumerate(self._records)
            ]
        return records, max(0.0, self._last_answer - started)

    def _lost(self, i: int, arrival: float) -> RequestRecord:
        """The record of a call that did not even answer its cancellation (should not happen)."""
        return RequestRecord(
            i, f"{self.run_id}-{i}", arrival, "CANCELLED", detail="no answer after cancelling"
        )

    def _send(self, i: int, arrival: float, due: float) -> None:
        lag = self._clock() - due
        request_id = f"{self.run_id}-{i}"
        if lag > self.max_lag_s:
            self._records[i] = RequestRecord(
                i, request_id, arrival, NOT_SENT, detail=f"sender {lag:.3f} s late"
            )
            return
        with self._lock:
            if len(self._in_flight) >= self.config.max_outstanding:
                self._records[i] = RequestRecord(
                    i, request_id, arrival, NOT_SENT,
                    detail=f"{self.config.max_outstanding} calls outstanding",
                )  # fmt: skip
                return
            self._in_flight[i] = None  # the slot is taken before the call can answer
        request = build_request(
            self.workload, i, self.config, self.run_id, self.slo_s - max(lag, 0.0)
        )
        try:
            call = self.stub.Generate.future(
                request, timeout=self.timeout_s, metadata=self.metadata
            )
        except Exception as err:  # e.g. a closed channel: the request fails, the replay goes on
            with self._lock:
                self._in_flight.pop(i, None)
                self._records[i] = RequestRecord(
                    i, request_id, arrival, "UNKNOWN", detail=_first_line(repr(err))
                )
            return
        with self._lock:
            self._in_flight[i] = call  # kept to cancel at the end if it outlives its timeout
        call.add_done_callback(lambda done: self._answered(i, arrival, due, request_id, done))

    def _answered(self, i: int, arrival: float, due: float, request_id: str, call: Any) -> None:
        """gRPC's callback: record the answer and free the slot. Never raises."""
        now = self._clock()
        try:
            record = _record(i, request_id, arrival, now - due, call)
        except Exception as err:  # a callback must not raise; keep what went wrong
            record = RequestRecord(
                i, request_id, arrival, "UNKNOWN", now - due, detail=_first_line(repr(err))
            )
        with self._lock:
            if self._records[i] is None:
                self._records[i] = record
            self._in_flight.pop(i, None)
            self._last_answer = max(self._last_answer, now)
            self._lock.notify_all()

    def _drain(self) -> None:
        """Wait for the calls in flight; cancel what outlives its own timeout by 5 s."""
        with self._lock:
            self._lock.wait_for(lambda: not self._in_flight, timeout=self.timeout_s + 5.0)
            left = [call for call in self._in_flight.values() if call is not None]
        for call in left:
            call.cancel()
        with self._lock:
            self._lock.wait_for(lambda: not self._in_flight, timeout=5.0)


def _record(i: int, request_id: str, arrival: float, latency_s: float, call: Any) -> RequestRecord:
    if call.cancelled():
        return RequestRecord(i, request_id, arrival, "CANCELLED", latency_s, detail="cancelled")
    error = call.exception()
    if error is not None:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else repr(error)
        return RequestRecord(
            i, request_id, arrival, code.name, latency_s, detail=_first_line(details or "")
        )
    reply = call.result()
    worker_timing = reply.timing.worker
    busy_ms = max(0.0, worker_timing.total_ms - worker_timing.queue_ms)
    strategy = _STRATEGY_FROM_PB.get(reply.strategy)
    return RequestRecord(
        index=i,
        request_id=request_id,
        arrival_s=arrival,
        status="OK",
        latency_s=latency_s,
        level=reply.level,
        level_index=reply.level_index,
        strategy="" if strategy is None else strategy.value,
        worker_id=reply.worker_id,
        classified_level=reply.classified_level,
        plan_version=reply.plan_version,
        worker_busy_s=busy_ms / 1e3,
    )


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# -- records -> RunResult -------------------------------------------------------------------


def simulator_slo_s(profiles: ProfileSet) -> float:
    """The SLO the simulator judges a run on its default cluster by (``Simulation.slo_s``
    with the default :class:`SimConfig`): the shared rule on that cluster's GPU classes."""
    return default_slo_s(profiles, [name for name, _ in SimConfig().worker_counts()])


def to_run_result(
    records: Sequence[RequestRecord],
    *,
    profiles: ProfileSet,
    quality: Mapping[Strategy, QualityTable],
    slo_s: float,
    speedup: float,
    wall_s: float,
    policy: str = "live",
) -> RunResult:
    """The RunResult of a live replay (the mapping is in the module docstring)."""
    records = sorted(records, key=lambda r: r.index)
    n = len(records)
    arrivals = np.array([r.arrival_s for r in records], dtype=np.float64)
    duration = float(arrivals[-1]) if n else 0.0
    never = (math.floor(duration / 60.0) + 1) * 60.0 + slo_s + 1.0  # past the run's last minute
    served = [r for r in records if r.status == "OK"]
    workers = sorted({r.worker_id for r in served})
    worker_index = {w: k for k, w in enumerate(workers)}
    level_index = {level.name: k for k, level in enumerate(profiles.levels)}
    finish = np.full(n, never)
    level = np.full(n, -1, dtype=np.int64)
    worker = np.full(n, -1, dtype=np.int64)
    score = np.zeros(n)
    relative = np.zeros(n)
    busy_by_minute: list[float] = []
    for k, r in enumerate(records):
        if r.status != "OK":
            continue
        finish[k] = r.arrival_s + r.latency_s
        level[k] = level_index.get(r.level, -1)
        worker[k] = worker_index[r.worker_id]
        score[k], relative[k] = _quality(r, profiles, quality)
        minute = int(r.arrival_s // 60.0)
        if minute >= len(busy_by_minute):
            busy_by_minute.extend([0.0] * (minute + 1 - len(busy_by_minute)))
        busy_by_minute[minute] += r.worker_busy_s * speedup
    in_order = sorted(served, key=lambda r: r.arrival_s + r.latency_s)
    plan_times = _change_times(in_order, lambda r: r.plan_version)
    strategy_times = _change_times(in_order, lambda r: r.strategy)
    switch_times = _model_switch_times(in_order, profiles)
    gpus = max(1, len(workers))
    return RunResult(
        policy=policy,
        arrivals_s=arrivals,
        finish_s=finish,
        level=level,
        worker=worker,
        score=score,
        relative=relative,
        slo_s=slo_s,
        model_switches=len(switch_times),
        plan_changes=len(plan_times),
        busy_s=sum(busy_by_minute),
        gpu_seconds=gpus * max(duration, wall_s * speedup),
        duration_s=duration,
        strategy_switches=len(strategy_times),
        switch_times_s=switch_times,
        plan_change_times_s=plan_times,
        busy_by_minute_s=busy_by_minute,
        gpus=gpus,
    )


def _quality(
    r: RequestRecord, profiles: ProfileSet, quality: Mapping[Strategy, QualityTable]
) -> tuple[float, float]:
    """(score, relative) of a served request, as the simulator scores it.

    The strategy is the answer's (or the served level's in the profiles); the column is the
    served level's, or the answer's level index when the router's profiles name levels these
    do not (clamped to the table).
    """
    strategy = Strategy(r.strategy) if r.strategy else _strategy_of(r.level, profiles)
    table = quality[strategy]
    row = r.index % len(table.prompts)
    try:
        column = table.level_index(r.level)
    except KeyError:
        column = min(max(r.level_index, 0), len(table.levels) - 1)
    value = float(table.scores[row, column])
    return value, value / float(table.scores[row].max())


def _strategy_of(level_name: str, profiles: ProfileSet) -> Strategy:
    for level in profiles.levels:
        if level.name == level_name:
            return level.strategy
    return Strategy.AC


def _change_times(
    in_order: Sequence[RequestRecord], key: Callable[[RequestRecord], object]
) -> list[float]:
    """Finish times (trace clock) of the answers whose ``key`` differs from the one before."""
    times = []
    for before, after in itertools.pairwise(in_order):
        if key(before) != key(after):
            times.append(after.arrival_s + after.latency_s)
    return times


def _model_switch_times(in_order: Sequence[RequestRecord], profiles: ProfileSet) -> list[float]:
    """Finish times of answers that came from another model than the worker's previous one."""
    model_of = {level.name: level.model for level in profiles.levels}
    last: dict[str, str] = {}
    times = []
    for r in in_order:
        model = model_of.get(r.level, r.level)
        if r.worker_id in last and last[r.worker_id] != model:
            times.append(r.arrival_s + r.latency_s)
        last[r.worker_id] = model
    return times


# -- the whole replay -----------------------------------------------------------------------


def replay_live(
    workload: Workload,
    profiles: ProfileSet,
    quality: Mapping[Strategy, QualityTable],
    config: LiveConfig,
    channel: grpc.Channel,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    progress: Callable[[int], None] | None = None,
    policy: str = "live",
) -> LiveResult:
    """Replay ``workload`` through the router on ``channel`` (see :func:`open_channel`)."""
    slo_s = config.slo_s if config.slo_s is not None else simulator_slo_s(profiles)
    stub = router_pb2_grpc.RouterStub(channel)
    generator = LoadGenerator(
        stub, workload, config, slo_s, clock=clock, sleep=sleep, progress=progress
    )
    records, wall_s = generator.run()
    run = to_run_result(
        records,
        profiles=profiles,
        quality=quality,
        slo_s=slo_s,
        speedup=config.speedup,
        wall_s=wall_s,
        policy=policy,
    )
    return LiveResult(run, tuple(records), config.address, config.speedup, wall_s)


REQUEST_COLUMNS = (
    "index",
    "request_id",
    "arrival_s",
    "finish_s",
    "latency_s",
    "status",
    "outcome",
    "level",
    "level_index",
    "strategy",
    "worker_id",
    "classified_level",
    "plan_version",
    "detail",
)


def write_requests(result: LiveResult, path: Path) -> None:
    """One row per request (``requests.csv``): the records behind the report."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(REQUEST_COLUMNS)
        for r in result.records:
            ok = r.status == "OK"
            writer.writerow(
                [
                    r.index,
                    r.request_id,
                    f"{r.arrival_s:.3f}",
                    f"{r.arrival_s + r.latency_s:.3f}" if ok else "",
                    "" if math.isnan(r.latency_s) else f"{r.latency_s:.4f}",
                    r.status,
                    r.outcome,
                    r.level,
                    r.level_index if ok else "",
                    r.strategy,
                    r.worker_id,
                    r.classified_level,
                    r.plan_version if ok else "",
                    r.detail,
                ]
            )
