"""Router overhead: the time a request spends outside the workers, at 10, 100 and 500 req/s.

Three processes on this machine, as in a deployment with one router (more with ``--routers``):

* **stub workers** (one child process): ``--workers`` gRPC servers with the real
  ``argus.v1.Worker`` interface that answer a small fixed PNG at once and report their own
  service time (handler entry to reply) in ``timing.total_ms``, and the health service the
  workers serve (the router holds a ``Watch`` open on each worker's channel);
* **the router** (another child process; ``--routers N``: N of them, replicas as the Helm
  chart runs several, each with its own classifier, the same plan and a share of the
  arrivals, request i to replica i mod N): ``RouterCore`` behind ``argus.router.app``'s
  ``create_server`` with its defaults, following a real plan: an allocator in that process
  (frozen clock, no control loop) receives one heartbeat per stub worker and makes the plan,
  which the router installs once; the allocator is stopped before the load starts. A thread
  drains ``take_report`` every second, as the ``StatsReporter`` does, without the RPC;
* **the load generator** (this process): open-loop Poisson arrivals at each rate for
  ``--seconds``, each request sent with ``Generate.future`` so that slow answers never hold
  back the next arrival. Every request has a PartiPrompts prompt and, unless
  ``--request-ids none``, a unique ``request_id``, so the router's idempotency ledger is on
  the path as it is for clients that retry safely. The ledger is the router's for the whole
  run (it remembers the last ``max_ids`` ids), so each rate finds the earlier rates' ids in it.

Per request it records the client-observed latency, the status code and the router's
``RouterTiming``. **Overhead** = client latency − the worker's own ``timing.total_ms``: the
client's and the router's gRPC stacks, classification, routing, admission, the hop to the
worker and the worker's gRPC stack. The **router-internal** view is ``timing.total_ms −
timing.worker.total_ms`` (arrival in the router's handler to its answer, without the
router's own gRPC transport). The router's ``classify_ms`` runs from its arrival to the
classifier's answer, so it includes the request checks, the id ledger and the in-flight slot;
``route_ms`` is routing and admission; the worker hop is ``forward_ms − worker.total_ms``.
CPU % is each process's user + system time over the rate's wall time (from ``/proc``), 100% =
one core. The router's garbage collections are counted with ``gc.callbacks``: a full (gen 2)
collection stops the whole process for as long as it walks every tracked object, which the
real classifier's torch and transformers make hundreds of thousands; the router calls
``gc.freeze()`` after start-up, as ``argus router`` does, and ``--no-gc-freeze`` shows what
a router without it pays.

The classifier is the router's own by default (``--classifier default``): the committed
default (``default_classifier_dir``) loaded by ``load_prompt_classifier`` with the serving
defaults (encoder runtime, threads, micro-batcher, prompt-vector cache), as ``argus router``
runs it.
Prompts are PartiPrompts made distinct across the whole run (after the first pass over the
1,632 of them each gets ", variation N"), so the cache never answers: every request pays
for a real classification; the router's cache counters are printed to show it.
``--classifier stub`` returns a fixed level instead (the router's own overhead alone);
``--classifier DIR`` loads the classifier artifacts under DIR the same way.
``--floor`` also starts a pass-through router (:class:`FloorRouter`, on a server built as
the router's) and offers each rate's arrivals to it just before the router: what the Python
gRPC transport costs on this machine, beside what the router adds (overhead and the router
process's CPU per request).
``--metrics`` also gives the core the ``RouterMetrics`` that ``argus router`` counts in
(prometheus_client; nothing scrapes them here).

``--pin`` runs the router processes (and the floor's) alone on the first CPU, and the stub
workers and this load generator on the others, as a node honouring the Helm chart's CPU
requests would (``_pinning``; the header says which placement ran); ``--noisy-neighbour``
adds a CPU-bound busy loop on the workers' CPUs (any CPU unpinned) at ``argus up``'s
``compute_nice`` for the whole run, its CPU share printed at the end.

Admission works as in production (``--deadline-ms router``, the default): requests carry no
deadline, so the router gives them its default (30 s) and refuses with RESOURCE_EXHAUSTED
what its admission rule or its in-flight bound refuses. The profile the allocator plans with
and the router admits by is the default one with every latency × ``--time-scale`` (default
0.00025: the slowest level takes about 1 ms), so that the router prices the stubs at about
their speed; at ``--time-scale 1`` it believes each answer takes seconds, and at 500 req/s
admission refuses a few per cent of requests that the stubs would have served at once.
``--deadline-ms auto`` picks (max_in_flight + 1) × the plan's slowest t_proc, a deadline
admission cannot refuse.
Refused requests (RESOURCE_EXHAUSTED) and cancelled ones (CANCELLED, DEADLINE_EXCEEDED) are
counted per rate; the sustained rate is the requests answered OK per second of the rate's
wall time (first send to last answer).

    .venv/bin/python benchmarks/bench_router.py [--rates 10,100,500] [--seconds 10]
        [--workers 4] [--routers 1] [--classifier default|stub|DIR] [--deadline-ms router|auto|MS]
        [--request-ids unique|none] [--metrics] [--no-gc-freeze] [--router-threads 320]
        [--time-scale 0.00025] [--pin] [--noisy-neighbour]
        [--json PATH]

These are figures for stub-fast workers on this machine: every process shares its CPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import multiprocessing
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from _machine import machine_line
from _pinning import (
    NoisyNeighbour,
    add_window_argument,
    mode_line,
    pin_this_process,
    split_cpus,
    with_window,
)
from _plan import allocator_plan, scaled_profiles, serve_router
from grpc_health.v1 import health, health_pb2_grpc

from argus import defaults
from argus.plumbing import rpc
from argus.router.app import grpc_sizes
from argus.tools.local_cluster import ClusterSpec, inherited_affinity
from argus.traces import default_prompt_trace, load_prompts

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

PNG = b"\x89PNG\r\n\x1a\n" + bytes(56)  # a small fixed answer (64 bytes)
TIME_SCALE = 0.00025  # the profile's slowest level (4.2 s) becomes about 1 ms, as fast as a stub
MAX_IN_FLIGHT = defaults.MAX_IN_FLIGHT  # the router's; the auto deadline and thread count use it
ROUTER_DEADLINE_MS = 30_000  # RouterServiceConfig.default_deadline_ms: requests without one
READY_TIMEOUT_S = 300.0  # loading the real classifier imports torch and MiniLM
WARMUP_REQUESTS = 100


# -- child processes -----------------------------------------------------------------------


class StubWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Answers a fixed PNG at once; ``timing.total_ms`` is the handler's own time."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        began = time.perf_counter()
        reply = worker_pb2.GenerateResponse(
            request_id=request.request_id,
            png=PNG,
            level=request.level,
            worker_id=self.worker_id,
        )
        reply.timing.total_ms = (time.perf_counter() - began) * 1e3
        return reply


class StubClassifier:
    """The same level for every prompt and strategy (no model, no batching)."""

    label = "stub (fixed level)"

    def __init__(self, level: int = 0) -> None:
        self.level = level

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Any, int]:
        from argus.types import Strategy

        return {Strategy.AC: self.level, Strategy.SM: self.level}


class FloorRouter(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    """The least a Python gRPC router does: take the request, call a stub worker (round
    robin) with the router's own client call (``Generate.future``, then its result) and
    answer. No checks, id ledger, classification, routing or admission: what remains is
    the transport every router on this machine pays. Its channels are the router's
    (:class:`~argus.router.worker_calls.WorkerChannels`: each holds the worker's health watch
    open, which keeps the channel's completion thread running)."""

    def __init__(self, workers: list[tuple[str, str]]) -> None:
        from argus.router.worker_calls import WorkerChannels

        self._channels = WorkerChannels(grpc.insecure_channel)
        self._addresses = [address for _, address in workers]
        self._next = itertools.count()

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        began = time.perf_counter()
        address = self._addresses[next(self._next) % len(self._addresses)]
        stub = self._channels.stub(address)
        call = worker_pb2.GenerateRequest(
            request_id=request.request_id, prompt=request.prompt, seed=request.seed
        )
        sent = time.perf_counter()
        reply = stub.Generate.future(call, timeout=ROUTER_DEADLINE_MS / 1e3).result()
        answer = router_pb2.RouterGenerateResponse(
            request_id=request.request_id, png=reply.png, worker_id=reply.worker_id
        )
        answer.timing.forward_ms = (time.perf_counter() - sent) * 1e3
        answer.timing.worker.CopyFrom(reply.timing)
        answer.timing.total_ms = (time.perf_counter() - began) * 1e3
        return answer

    def close(self) -> None:
        self._channels.close()


class GcWatch:
    """The process's garbage collections per generation: how many, and their pauses (the
    whole process stops for one: the GIL is held)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]  # since the last snapshot
        self._began = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation, pause_s = info["generation"], time.perf_counter() - self._began
        self.count[generation] += 1
        self.total_s[generation] += pause_s
        self.max_s[generation] = max(self.max_s[generation], pause_s)

    def snapshot(self) -> dict[str, list[float]]:
        """Counts and total pauses so far, and the longest pause since the last snapshot."""
        taken = {
            "count": [float(n) for n in self.count],
            "total_s": list(self.total_s),
            "max_s": self.max_s,
        }
        self.max_s = [0.0, 0.0, 0.0]
        return taken


def _child(
    body: Callable[..., tuple[Any, Callable[[], None]]], conn: Connection, *args: Any
) -> None:
    """Run ``body`` in a child: send ("ready", info) or ("error", traceback) on ``conn``, then
    answer "gc" with a :class:`GcWatch` snapshot until "stop" or until the parent is gone
    (its end of the pipe closes). Ctrl-C is the parent's to handle."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = GcWatch()
    try:
        info, close = body(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", info))
    try:
        while conn.recv() != "stop":
            conn.send(watch.snapshot() | {"classifier": classifier_counters()})
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        close()


def start_workers(count: int) -> tuple[list[tuple[str, str]], Callable[[], None]]:
    """``count`` stub worker servers; returns [(worker_id, address)] and a closer."""
    from concurrent import futures

    servers, workers = [], []
    for i in range(count):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        worker_id = f"stub-{i}"
        worker_pb2_grpc.add_WorkerServicer_to_server(StubWorker(worker_id), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # as workers
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        workers.append((worker_id, f"127.0.0.1:{port}"))

    def close() -> None:
        for server in servers:
            server.stop(grace=None)

    return workers, close


def start_router(
    workers: list[tuple[str, str]],
    classifier_name: str,
    with_metrics: bool,
    gc_freeze: bool,
    threads: int,
    time_scale: float,
    late_binding_window: int | None = None,
) -> tuple[dict[str, Any], Callable[[], None]]:
    """A router serving on a plan the allocator made for ``workers``; returns its port, the
    plan's summary and a closer. ``gc_freeze``: move every object made so far out of the
    collector's reach (``gc.freeze``), as ``argus router`` does after loading its classifier."""
    from argus.router.config import RouterServiceConfig
    from argus.router.core import RouterCore
    from argus.router.worker_calls import GrpcWorkers

    profiles = scaled_profiles(time_scale)
    published = allocator_plan(profiles, workers, "bench")

    classifier, label = load_classifier(classifier_name)
    config = RouterServiceConfig(router_id="bench-router", max_in_flight=MAX_IN_FLIGHT)
    config = with_window(config, late_binding_window)
    extra: dict[str, Any] = {}
    if with_metrics:
        from argus.router.app import PrometheusStats
        from argus.router.metrics import RouterMetrics

        extra["stats"] = PrometheusStats(RouterMetrics(profiles))
    core = RouterCore(profiles, classifier, config, workers=GrpcWorkers(), **extra)
    core.install(published)
    router_port, stop_router = serve_router(core, threads)
    tracked = len(gc.get_objects())
    if gc_freeze:
        gc.collect()
        gc.freeze()
    classes = published.worker_classes()
    t_proc = {
        w: profiles.profile(classes[w], level).latency_s
        for w, level in published.plan.allocation.assignment.items()
    }
    info = {
        "port": router_port,
        "classifier": label,
        "strategy": str(published.plan.strategy),
        "assignment": dict(published.plan.allocation.assignment),
        "max_t_proc_s": max(t_proc.values(), default=0.0),
        "gc_objects": tracked,
    }

    def close() -> None:
        stop_router()
        closer = getattr(classifier, "close", None)
        if closer is not None:
            closer()

    return info, close


def start_floor(
    workers: list[tuple[str, str]], threads: int
) -> tuple[dict[str, Any], Callable[[], None]]:
    """A :class:`FloorRouter` on the router's kind of server (``router_server``: the same
    pool, limits and request parsing); returns its port and a closer."""
    from argus.router.app import router_server

    server = router_server(threads, prefix="floor")
    floor = FloorRouter(workers)
    router_pb2_grpc.add_RouterServicer_to_server(floor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def close() -> None:
        server.stop(grace=None)
        floor.close()

    return {"port": port}, close


def load_classifier(name: str) -> tuple[Any, str]:
    """The router's classifier and how the printout names it."""
    if name == "stub":
        return StubClassifier(), StubClassifier.label
    from argus.classifier.serving import (
        SERVING_CACHE_ENTRIES,
        SERVING_MAX_WAIT_S,
        SERVING_THREADS,
        default_classifier_dir,
        load_prompt_classifier,
    )
    from argus.types import Strategy

    directory = default_classifier_dir() if name == "default" else Path(name)
    classifier = load_prompt_classifier(directory)
    classifier.classify("warm-up: a red fox in the snow")
    global _CLASSIFIER
    _CLASSIFIER = classifier
    encoder = classifier.classifiers.current(Strategy.AC).encoder
    runtime = getattr(encoder, "runtime", "?")
    if runtime.startswith("onnx"):
        threads = f"{SERVING_THREADS} ONNX Runtime intra-op thread(s)"
    else:
        import torch

        threads = f"{torch.get_num_threads()} torch intra-op thread(s)"
    return classifier, (
        f"{name} ({directory.name}; encoder runtime {runtime}, {threads}; "
        f"micro-batched, wait {SERVING_MAX_WAIT_S * 1e3:g} ms; prompt-vector cache of "
        f"{SERVING_CACHE_ENTRIES})"
    )


_CLASSIFIER: Any = None  # the router process's PromptClassifier, for its counters


def classifier_counters() -> dict[str, float]:
    """The router's classifier counters so far (empty for the stub)."""
    if _CLASSIFIER is None:
        return {}
    batches, cache = _CLASSIFIER.stats(), _CLASSIFIER.cache_stats()
    out = {"batches": float(batches.batches), "items": float(batches.items)}
    if cache is not None:
        out |= {"cache_hits": float(cache.hits), "cache_misses": float(cache.misses)}
    return out


class Child:
    """A spawned child process that runs ``body`` until closed; ``info`` is what it sent.
    ``cpus``: the CPU set every thread of it runs on (None: this thread's)."""

    def __init__(
        self,
        ctx: Any,
        name: str,
        body: Callable[..., Any],
        *args: Any,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.name = name
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=_child, args=(body, theirs, *args), name=name, daemon=True
        )
        with inherited_affinity(cpus):  # pinned from its first instruction (spawn: fork + exec)
            self.process.start()
        theirs.close()
        self.info: Any = None

    def wait_ready(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: did not start (exit {self.process.exitcode})")
        kind, self.info = self._conn.recv()
        if kind != "ready":
            raise RuntimeError(f"{self.name} failed to start:\n{self.info}")
        return self.info

    def gc(self) -> dict[str, Any]:
        """The child's :meth:`GcWatch.snapshot`, with its classifier's counters."""
        self._conn.send("gc")
        if not self._conn.poll(10.0):
            raise RuntimeError(f"{self.name}: no answer")
        snapshot: dict[str, Any] = self._conn.recv()
        return snapshot

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


# -- the load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request as the load generator saw it; times in milliseconds."""

    lag_ms: float  # sent this late after its scheduled arrival (the generator falling behind)
    latency_ms: float  # client-observed: just before sending until the answer's callback
    code: str  # status code name, "OK" when answered
    classify_ms: float = math.nan  # the router's RouterTiming (NaN when not answered)
    route_ms: float = math.nan
    forward_ms: float = math.nan
    router_ms: float = math.nan  # RouterTiming.total_ms
    worker_ms: float = math.nan  # RouterTiming.worker.total_ms
    replica: int = 0  # which router process it was sent to (--routers)


class Countdown:
    """Wait until ``n`` callbacks have counted down."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._done = threading.Condition()

    def count(self) -> None:
        with self._done:
            self._left -= 1
            if self._left <= 0:
                self._done.notify_all()

    def wait(self, timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: self._left <= 0, timeout_s)


def arrivals(rate: float, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrival times in [0, seconds), seconds from the start."""
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.5) + 100)
    times = np.cumsum(gaps)
    return times[times < seconds]


def request(tag: str | None, i: int, prompt: str, deadline_ms: int | None) -> Any:
    """Request ``i``; ``tag`` None leaves request_id empty (no idempotency ledger), and
    ``deadline_ms`` None leaves the deadline to the router."""
    call = router_pb2.RouterGenerateRequest(
        request_id="" if tag is None else f"{tag}-{i}", prompt=prompt, seed=i
    )
    if deadline_ms is not None:
        call.deadline_ms = deadline_ms
    return call


def distinct_prompts(prompts: Sequence[str], start: int, count: int) -> list[str]:
    """``count`` prompts from position ``start`` of an endless stream over ``prompts`` that
    never repeats a text: pass N >= 1 appends ", variation N"."""
    out = []
    for k in range(start, start + count):
        cycle, index = divmod(k, len(prompts))
        out.append(prompts[index] if cycle == 0 else f"{prompts[index]}, variation {cycle}")
    return out


def sample_of(future: Any, lag_s: float, sent: float, done: float, replica: int = 0) -> Sample:
    lag_ms, latency_ms = lag_s * 1e3, (done - sent) * 1e3
    err = future.exception()
    if err is not None:
        code = err.code() if isinstance(err, grpc.Call) else None
        name = code.name if code is not None else type(err).__name__
        return Sample(lag_ms, latency_ms, name, replica=replica)
    t = future.result().timing
    return Sample(
        lag_ms, latency_ms, "OK", t.classify_ms, t.route_ms, t.forward_ms, t.total_ms,
        t.worker.total_ms, replica,
    )  # fmt: skip


def offer(
    stubs: Sequence[Any],
    tag: str | None,
    times: np.ndarray,
    prompts: Sequence[str],
    deadline_ms: int | None,
) -> tuple[list[Sample], float]:
    """Send one request at each of ``times`` (open loop), request ``i`` with ``prompts[i]``
    to ``stubs[i % len(stubs)]`` (one stub per router process); the samples and the wall
    time from the first send to the last answer."""
    samples: list[Sample | None] = [None] * len(times)
    countdown = Countdown(len(times))
    timeout_s = (deadline_ms or ROUTER_DEADLINE_MS) / 1e3 + 5.0

    def record(i: int, lag_s: float, sent: float, future: Any) -> None:
        samples[i] = sample_of(future, lag_s, sent, time.perf_counter(), i % len(stubs))
        countdown.count()

    start = time.perf_counter()
    for i, at in enumerate(times):
        due = start + float(at)
        if (delay := due - time.perf_counter()) > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        call = request(tag, i, prompts[i], deadline_ms)
        future = stubs[i % len(stubs)].Generate.future(call, timeout=timeout_s)
        future.add_done_callback(lambda f, i=i, lag=sent - due, sent=sent: record(i, lag, sent, f))
    if not countdown.wait(timeout_s + 10.0):
        raise RuntimeError(f"answers still missing after {timeout_s + 10.0:.0f} s")
    wall_s = time.perf_counter() - start
    return [s for s in samples if s is not None], wall_s


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` together (NaN where /proc is not
    available)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# -- figures -------------------------------------------------------------------------------


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def spread(values: np.ndarray, *qs: str) -> dict[str, float]:
    """Named percentiles of ``values``: "p50", "p99", "max"."""
    return {q: pct(values, 100.0 if q == "max" else float(q[1:])) for q in qs}


def summarize(rate: float, seconds: float, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The figures of one rate: counts, codes, and overhead and latency percentiles (ms)."""
    ok = [s for s in samples if s.code == "OK"]

    def column(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in ok])

    latency, worker, router = column("latency_ms"), column("worker_ms"), column("router_ms")
    codes = Counter(s.code for s in samples)
    return {
        "offered_per_s": rate,
        "seconds": seconds,
        "sent": len(samples),
        "sent_per_s": len(samples) / seconds,
        "ok": len(ok),
        "ok_per_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "errors": {code: n for code, n in sorted(codes.items()) if code != "OK"},
        "refused": codes["RESOURCE_EXHAUSTED"],
        "cancelled": codes["CANCELLED"] + codes["DEADLINE_EXCEEDED"],
        "overhead_ms": spread(latency - worker, "p50", "p99", "max"),
        "client_ms": spread(latency, "p50", "p99"),
        "router_internal_ms": spread(router - worker, "p50", "p99"),
        "classify_ms": spread(column("classify_ms"), "p50", "p99"),
        "route_ms": spread(column("route_ms"), "p50", "p99"),
        "worker_hop_ms": spread(column("forward_ms") - worker, "p50", "p99"),
        "worker_ms": spread(worker, "p50", "p99"),
        "send_lag_ms": spread(np.array([s.lag_ms for s in samples]), "p99", "max"),
        "ok_by_router": [n for _, n in sorted(Counter(s.replica for s in ok).items())],
    }


def print_tables(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'router':>6} {'offered/s':>9} {'sent/s':>7} {'ok/s':>7} {'count':>6} {'refused':>7} "
        f"{'cancelled':>9} {'other':>5} | {'overhead ms: p50':>16} {'p99':>6} {'max':>7} | "
        f"{'client ms: p50':>14} {'p99':>6} | {'router-internal ms: p50':>23} {'p99':>6}"
    )
    for r in rows:
        other = sum(r["errors"].values()) - r["refused"] - r["cancelled"]
        o, c, i = r["overhead_ms"], r["client_ms"], r["router_internal_ms"]
        print(
            f"{r['router']:>6} {r['offered_per_s']:>9g} {r['sent_per_s']:>7.1f} "
            f"{r['ok_per_s']:>7.1f} "
            f"{r['sent']:>6} {r['refused']:>7} {r['cancelled']:>9} {other:>5} | "
            f"{o['p50']:>16.2f} {o['p99']:>6.2f} {o['max']:>7.1f} | "
            f"{c['p50']:>14.2f} {c['p99']:>6.2f} | {i['p50']:>23.2f} {i['p99']:>6.2f}"
        )
        if r["errors"]:
            print(f"{'':>16} status codes: {r['errors']}")
    print()
    print(
        "where the router's time goes (ms, p50/p99), CPU per process (100% = one core) and the "
        "router's garbage collections (full ones, longest pause):"
    )
    print(
        f"{'router':>6} {'offered/s':>9} {'classify':>13} {'route':>13} {'worker hop':>13} "
        f"{'worker':>13} {'send lag p99':>12} | {'cpu: router':>11} {'ms/req':>6} "
        f"{'workers':>8} {'loadgen':>8} | {'gc: full':>8} {'max ms':>7}"
    )
    for r in rows:
        cells = [
            f"{r[k]['p50']:.2f}/{r[k]['p99']:.2f}"
            for k in ("classify_ms", "route_ms", "worker_hop_ms", "worker_ms")
        ]
        cpu = r["cpu_percent"]
        print(
            f"{r['router']:>6} {r['offered_per_s']:>9g} "
            + " ".join(f"{c:>13}" for c in cells)
            + f" {r['send_lag_ms']['p99']:>12.2f} | {cpu['router']:>10.0f}% "
            f"{r['router_cpu_ms_per_request']:>6.2f} "
            f"{cpu['workers']:>7.0f}% {cpu['loadgen']:>7.0f}% | "
            f"{r['router_gc']['gen2_count']:>8} {r['router_gc']['pause_max_ms']:>7.1f}"
        )


def print_floor(rows: list[dict[str, Any]]) -> None:
    """The router's overhead and CPU beside the floor's at each rate (with ``--floor``)."""
    floors = {r["offered_per_s"]: r for r in rows if r["router"] == "floor"}
    if not floors:
        return
    print()
    print("the router over the floor (the transport alone), same arrivals, floor first:")
    for r in rows:
        floor = floors.get(r["offered_per_s"])
        if r["router"] == "floor" or floor is None:
            continue
        o, f = r["overhead_ms"], floor["overhead_ms"]
        print(
            f"  {r['offered_per_s']:g} req/s: overhead p50 {o['p50']:.2f} ms (floor "
            f"{f['p50']:.2f}, +{o['p50'] - f['p50']:.2f}), p99 {o['p99']:.2f} ms (floor "
            f"{f['p99']:.2f}, +{o['p99'] - f['p99']:.2f}); router CPU "
            f"{r['router_cpu_ms_per_request']:.2f} ms a request (floor "
            f"{floor['router_cpu_ms_per_request']:.2f})"
        )


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,100,500", help="offered req/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each rate")
    parser.add_argument("--workers", type=int, default=4, help="stub workers")
    parser.add_argument(
        "--classifier",
        default="default",
        help="default (the committed default), stub (a fixed level) or a classifier directory",
    )
    parser.add_argument(
        "--deadline-ms",
        default="router",
        help="request deadline_ms; router: none (the router's default, admission as in "
        "production); auto: (max_in_flight + 1) × the plan's slowest t_proc",
    )
    parser.add_argument(
        "--request-ids",
        choices=["unique", "none"],
        default="unique",
        help="unique: every request has an id (the ledger is used); none: empty ids",
    )
    parser.add_argument("--metrics", action="store_true", help="count in RouterMetrics")
    parser.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() in the router after start-up, as argus router does (default: yes)",
    )
    parser.add_argument(
        "--router-threads",
        type=int,
        default=grpc_sizes(MAX_IN_FLIGHT).threads,
        help="the router's gRPC handler threads (argus router's default: max_in_flight + "
        "its refusal threads = %(default)d)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=TIME_SCALE,
        help="the profile's latencies × this, as the router admits by (default: %(default)g)",
    )
    add_window_argument(parser)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also offer each rate's arrivals to a pass-through router (the transport alone)",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes (replicas, as the Helm chart runs several); request i goes to "
        "replica i mod N (default 1)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the router processes on the first CPU alone; stub workers and the load generator "
        "on the others",
    )
    parser.add_argument(
        "--noisy-neighbour",
        action="store_true",
        help="a CPU-bound busy loop on the workers' CPUs at argus up's compute nice, the whole run",
    )
    parser.add_argument("--seed", type=int, default=0, help="arrival times")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    args.pinned = split_cpus() if args.pin else None
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.workers < 1 or args.routers < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates):
        parser.error("--workers, --routers, --seconds and every rate must be > 0")
    if not args.time_scale > 0:
        parser.error("--time-scale: must be > 0")
    return args


def replicas(count: int) -> str:
    """How the printout names the router processes."""
    if count == 1:
        return "the router (another)"
    return (
        f"{count} router processes (replicas, each with its own classifier and the same plan; "
        f"request i goes to replica i mod {count}, as a client balancing over their addresses)"
    )


def deadline_for(text: str, max_t_proc_s: float) -> int | None:
    if text == "router":
        return None
    if text == "auto":
        return math.ceil((MAX_IN_FLIGHT + 1) * max_t_proc_s * 1e3)
    return int(text)


def warm_up(stub: Any, tag: str | None, prompts: Sequence[str], deadline_ms: int | None) -> None:
    """Open the router's channels to every worker and the client's to the router."""
    for i in range(WARMUP_REQUESTS):
        stub.Generate(request(tag, i, prompts[i], deadline_ms), timeout=30.0)


@contextlib.contextmanager
def processes(
    args: argparse.Namespace,
) -> Iterator[tuple[list[Child], dict[str, tuple[int, ...]], Child | None]]:
    """Start the stub workers' process, ``--routers`` router processes (and with ``--floor``
    the floor router's); yields the routers, the pids (routers, workers, loadgen) and the
    floor; stops every child on the way out, Ctrl-C included."""
    ctx = multiprocessing.get_context("spawn")
    children: list[Child] = []
    router_cpus, worker_cpus = args.pinned or (None, None)
    try:
        workers = Child(ctx, "stub-workers", start_workers, args.workers, cpus=worker_cpus)
        children.append(workers)
        addresses = workers.wait_ready(60.0)
        routers = []
        for k in range(args.routers):  # one after another: each loads its own classifier
            router = Child(
                ctx,
                f"router-{k}",
                start_router,
                addresses,
                args.classifier,
                args.metrics,
                args.gc_freeze,
                args.router_threads,
                args.time_scale,
                args.late_binding_window,
                cpus=router_cpus,
            )
            children.append(router)
            router.wait_ready(READY_TIMEOUT_S)
            routers.append(router)
        floor = None
        if args.floor:
            floor = Child(
                ctx, "floor", start_floor, addresses, args.router_threads, cpus=router_cpus
            )
            children.append(floor)
            floor.wait_ready(60.0)
        pids = {
            "router": tuple(router.process.pid for router in routers),
            "workers": (workers.process.pid,),
            "loadgen": (os.getpid(),),
        }
        yield routers, pids, floor
    finally:
        for child in reversed(children):
            child.close()


def gc_total(routers: Sequence[Child]) -> dict[str, Any]:
    """The routers' :meth:`Child.gc` snapshots together: counts and pauses summed, longest
    pauses the longest of any, classifier counters summed."""
    snapshots = [router.gc() for router in routers]
    classifier: Counter[str] = Counter()
    for snapshot in snapshots:
        classifier.update(snapshot["classifier"])
    return {
        "count": [sum(s["count"][g] for s in snapshots) for g in range(3)],
        "total_s": [sum(s["total_s"][g] for s in snapshots) for g in range(3)],
        "max_s": [max(s["max_s"][g] for s in snapshots) for g in range(3)],
        "classifier": dict(classifier),
    }


def measure(
    stubs: Sequence[Any],
    rate: float,
    times: np.ndarray,
    args: argparse.Namespace,
    prompts: Sequence[str],
    deadline_ms: int | None,
    routers: Sequence[Child],
    pids: dict[str, tuple[int, ...]],
    label: str = "argus",
) -> dict[str, Any]:
    """Offer ``rate`` req/s at ``times``, one prompt of ``prompts`` per request in order,
    to the router ``label`` (its processes are ``routers``, ``pids["router"]``, one of
    ``stubs`` each); the rate's figures with CPU % per process (the routers' together), the
    routers' garbage collections and their classifiers' counters."""
    gc_before = gc_total(routers)
    before = {name: cpu_seconds(ids) for name, ids in pids.items()}
    tag = f"{label}-r{rate:g}" if args.request_ids == "unique" else None
    samples, wall_s = offer(stubs, tag, times, prompts[: len(times)], deadline_ms)
    row = summarize(rate, args.seconds, samples, wall_s)
    row["router"] = label
    used = {name: cpu_seconds(ids) - before[name] for name, ids in pids.items()}
    row["cpu_percent"] = {name: used[name] / wall_s * 100 for name in pids}
    row["router_cpu_ms_per_request"] = used["router"] / max(1, len(samples)) * 1e3
    gc_after = gc_total(routers)
    row["router_gc"] = {
        "gen2_count": int(gc_after["count"][2] - gc_before["count"][2]),
        "gen2_max_ms": gc_after["max_s"][2] * 1e3,
        "pause_total_ms": (sum(gc_after["total_s"]) - sum(gc_before["total_s"])) * 1e3,
        "pause_max_ms": max(gc_after["max_s"]) * 1e3,
    }
    counted = gc_after["classifier"]
    row["classifier"] = {k: v - gc_before["classifier"].get(k, 0.0) for k, v in counted.items()}
    print(
        f"  {label} at {rate:g} req/s: {row['ok']}/{row['sent']} OK in {wall_s:.1f} s", flush=True
    )
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the figures and returns them (as ``--json`` writes them)."""
    args = parse_args(argv)
    prompts = [p.prompt for p in load_prompts(default_prompt_trace())]
    print(machine_line())
    print(f"load average at start: {load_average()}")
    others = None if args.pinned is None else args.pinned[1]
    print(mode_line(args.pinned, "the stub workers and the load generator"))
    neighbour = NoisyNeighbour(others, ClusterSpec.compute_nice)
    print(neighbour.describe() if args.noisy_neighbour else "noisy neighbour: none")
    if others is not None:
        pin_this_process(others)  # before any channel or pool starts a thread
    with (
        neighbour if args.noisy_neighbour else contextlib.nullcontext(),
        processes(args) as (routers, pids, floor),
    ):
        info = routers[0].info
        deadline_ms = deadline_for(args.deadline_ms, info["max_t_proc_s"])
        print(
            f"stub-fast workers on this machine: {args.workers} stub workers (one process), "
            f"{replicas(args.routers)}, the load generator (this one)"
        )
        print(
            f"classifier: {info['classifier']}; request ids: {args.request_ids}; "
            f"RouterMetrics: {'on' if args.metrics else 'off'}; gc.freeze: "
            f"{'yes' if args.gc_freeze else 'no'} ({info['gc_objects']:,} objects tracked); "
            f"router handler threads: {args.router_threads}"
        )
        print(
            f"plan: {info['strategy']}, {sorted(Counter(info['assignment'].values()).items())}; "
            f"profile latencies x {args.time_scale:g} (slowest t_proc "
            f"{info['max_t_proc_s'] * 1e3:.2f} ms); deadline_ms {deadline_ms}; "
            f"open-loop Poisson arrivals, {args.seconds:g} s per rate",
            flush=True,
        )
        if floor is not None:
            print(
                "floor: a pass-through router on the same kind of server (FloorRouter), "
                "offered the same arrivals just before the router at each rate",
                flush=True,
            )
        with contextlib.ExitStack() as stack:
            stubs = []
            for k, router in enumerate(routers):
                address = f"127.0.0.1:{router.info['port']}"
                stub = router_pb2_grpc.RouterStub(
                    stack.enter_context(grpc.insecure_channel(address))
                )
                tag = f"warm-up-{k}" if args.request_ids == "unique" else None
                warm_up(stub, tag, prompts, deadline_ms)
                stubs.append(stub)
            floor_stub = None
            if floor is not None:
                address = f"127.0.0.1:{floor.info['port']}"
                floor_stub = router_pb2_grpc.RouterStub(
                    stack.enter_context(grpc.insecure_channel(address))
                )
                tag = "floor-warm-up" if args.request_ids == "unique" else None
                warm_up(floor_stub, tag, prompts, deadline_ms)
            rng = np.random.default_rng(args.seed)
            rows, used = [], WARMUP_REQUESTS  # no rate reuses a prompt of the warm-up
            for rate in args.rates:
                times = arrivals(rate, args.seconds, rng)
                fresh = distinct_prompts(prompts, used, len(times))
                if floor is not None and floor_stub is not None:
                    floor_pids = pids | {"router": (floor.process.pid,)}
                    offered = ([floor_stub], rate, times, args, fresh, deadline_ms)
                    rows.append(measure(*offered, [floor], floor_pids, label="floor"))
                rows.append(measure(stubs, rate, times, args, fresh, deadline_ms, routers, pids))
                used += len(times)
        if args.noisy_neighbour:
            print(neighbour.usage_line())
    print_tables(rows)
    print_floor(rows)
    for r in rows:
        if len(r["ok_by_router"]) > 1:
            each = r["ok_by_router"]
            print(f"{r['router']} at {r['offered_per_s']:g}/s: answered OK by replica {each}")
        counted = r["classifier"]
        if counted:
            print(
                f"router classifier at {r['offered_per_s']:g}/s: {counted['items']:.0f} prompts "
                f"in {counted['batches']:.0f} batches (mean "
                f"{counted['items'] / max(1.0, counted['batches']):.1f}); prompt-vector cache "
                f"{counted.get('cache_hits', 0):.0f} hits, {counted.get('cache_misses', 0):.0f} "
                "misses"
            )
    print(f"load average at end: {load_average()}")
    results = {
        "machine": machine_line(),
        "note": "stub-fast workers on this machine",
        "floor": args.floor,
        "classifier": info["classifier"],
        "workers": args.workers,
        "routers": args.routers,
        "request_ids": args.request_ids,
        "metrics": args.metrics,
        "gc_freeze": args.gc_freeze,
        "router_threads": args.router_threads,
        "router_gc_objects": info["gc_objects"],
        "deadline_ms": deadline_ms,
        "time_scale": args.time_scale,
        "pinned": args.pinned,
        "noisy_neighbour": args.noisy_neighbour,
        "plan": {"strategy": info["strategy"], "assignment": info["assignment"]},
        "rates": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the child processes are already stopped
        raise SystemExit(130) from None
