"""Overload: served throughput and refusal latency when clients offer more than the cluster
can serve (by default 3 × its capacity for 60 s).

Processes on this machine, as in a deployment with one router:

* **stub workers**, one child process each: the real ``argus.v1.Worker`` interface serving
  one request at a time, each taking the profiled latency of the level the router asked for
  (a sleep: no model). A request waits for the worker no longer than its gRPC deadline (the
  router forwards its own) and is dropped with DEADLINE_EXCEEDED when that passes, as a real
  worker drops expired work; a cancelled call stops at once;
* **the router** (another child): ``RouterCore`` behind ``argus.router.app``'s
  ``create_server``, with the committed default classifier behind the micro-batcher
  (``--classifier stub`` skips it for smoke runs), following the plan an in-process
  allocator made for the workers. The classifier's encoder runs on ``--classifier-threads``
  intra-op threads (default 1): on a machine whose cores are all busy, torch's default of one
  thread per core made each batch wait for descheduled threads: on this 2-core machine
  (load average 5–6, two 20 s runs in 5 s windows) the served requests' classifier p95 was
  590–850 ms against 40–85 ms with one thread, and served throughput 8–88% of capacity
  against 97–100%. The profile is the default one with every latency multiplied by
  ``--time-scale``, so the router's admission and the stubs' service times agree and a run
  at stub speed takes seconds, not hours;
* **the load generator** (this process): open-loop Poisson arrivals at ``--load`` × the
  capacity for ``--duration-s``, each request with ``deadline_ms`` = ``--deadline-ms`` and
  sent with ``Generate.future`` so that slow answers never hold back the next arrival. At
  most ``--max-outstanding`` calls are open at once; arrivals beyond that are counted as
  ``not sent`` (the generator's bound, not the router's).

Capacity is computed, not measured: Σ over workers of 1 / (the service time of the level
the plan gave it), the most the stubs can serve whatever the router does. Per 10 s window
it prints what was offered (by arrival) and served (answers OK by completion) per second,
served as a share of capacity, the served requests' time in the classifier (the router's
``classify_ms``, p95), the refusals (RESOURCE_EXHAUSTED) and their client-side latency
p50/p95, requests that ran out of deadline (DEADLINE_EXCEEDED: refused as infeasible or
late) and other errors.
Targets: served ≥ 90% of capacity in every window, refusals ≤ 100 ms p95.

    .venv/bin/python benchmarks/bench_overload.py [--duration-s 60] [--load 3] [--workers 2]
        [--time-scale 0.025] [--deadline-ms 1000] [--classifier default|stub]
        [--classifier-threads 1]
        [--window-s 10] [--max-outstanding 2000]

These are figures for stub workers on this machine: every process shares its CPUs with
whatever else runs, so the load average is printed with them.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from _machine import machine_line
from _plan import allocator_plan, scaled_profiles, serve_router
from bench_router import PNG, Child, StubClassifier, arrivals, load_average

from argus.plumbing import rpc
from argus.traces import default_prompt_trace, load_prompts

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")
worker_pb2: Any = rpc.load("worker_pb2")
worker_pb2_grpc: Any = rpc.load("worker_pb2_grpc")

READY_TIMEOUT_S = 300.0  # the real classifier imports torch and loads MiniLM
ROUTER_THREADS = 128  # the router's gRPC handler threads: refusals must not queue for one


# -- child processes -----------------------------------------------------------------------


class TimedWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Serves one request at a time, each for its level's profiled latency."""

    def __init__(self, worker_id: str, service_s: dict[str, float]) -> None:
        self.worker_id = worker_id
        self.service_s = service_s
        self._slot = threading.Lock()

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        service_s = self.service_s[request.level]
        remaining = context.time_remaining()
        if not self._slot.acquire(timeout=-1 if remaining is None else max(remaining, 0.0)):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed in the queue")
        try:
            began = time.perf_counter()
            end = began + service_s
            while (left := end - time.perf_counter()) > 0:  # steps: stop when the call ends
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, "call ended")
                time.sleep(min(left, 0.01))
        finally:
            self._slot.release()
        reply = worker_pb2.GenerateResponse(
            request_id=request.request_id, png=PNG, level=request.level, worker_id=self.worker_id
        )
        reply.timing.total_ms = (time.perf_counter() - began) * 1e3
        return reply


def start_worker(
    worker_id: str, service_s: dict[str, float]
) -> tuple[tuple[str, str], Callable[[], None]]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    worker_pb2_grpc.add_WorkerServicer_to_server(TimedWorker(worker_id, service_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def close() -> None:
        server.stop(grace=None)

    return (worker_id, f"127.0.0.1:{port}"), close


def start_router(
    workers: list[tuple[str, str]], classifier_name: str, time_scale: float, threads: int
) -> tuple[dict[str, Any], Callable[[], None]]:
    """A router on the plan an allocator made for ``workers``; returns its port, the plan's
    service times per worker and a closer."""
    from argus.router.config import RouterServiceConfig
    from argus.router.core import RouterCore
    from argus.router.worker_calls import GrpcWorkers

    profiles = scaled_profiles(time_scale)
    published = allocator_plan(profiles, workers, "overload")
    classifier, label = load_classifier(classifier_name, threads)
    core = RouterCore(
        profiles, classifier, RouterServiceConfig(router_id="overload"), workers=GrpcWorkers()
    )
    core.install(published)
    router_port, stop_router = serve_router(core, ROUTER_THREADS)
    classes = published.worker_classes()
    info = {
        "port": router_port,
        "classifier": label,
        "assignment": dict(published.plan.allocation.assignment),
        "service_s": {
            w: profiles.profile(classes[w], level).latency_s
            for w, level in published.plan.allocation.assignment.items()
        },
    }

    def close() -> None:
        stop_router()
        closer = getattr(classifier, "close", None)
        if closer is not None:
            closer()

    return info, close


def load_classifier(name: str, threads: int) -> tuple[Any, str]:
    if name == "stub":
        return StubClassifier(), StubClassifier.label
    import torch

    from argus.classifier.serving import default_classifier_dir, load_prompt_classifier

    torch.set_num_threads(threads)
    classifier = load_prompt_classifier()
    classifier.classify("warm-up: a red fox in the snow")
    name = default_classifier_dir().name
    return classifier, f"default ({name}, micro-batched, {threads} torch threads)"


@contextmanager
def stub_cluster(
    workers: int,
    time_scale: float,
    router: Callable[..., Any],
    *router_args: Any,
    router_cpus: Sequence[int] | None = None,
    worker_cpus: Sequence[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Start ``workers`` stub workers at the profile's latencies × ``time_scale``, then
    ``router(addresses, *router_args)`` in its own process; yields the router's info; stops
    them all. ``router_cpus`` / ``worker_cpus``: the CPU sets they run on (None: anywhere
    this thread may)."""
    ctx = multiprocessing.get_context("spawn")
    profiles = scaled_profiles(time_scale)
    worker_class = profiles.worker_classes[0]
    service_s = {level.name: profiles.profile(worker_class, level.name).latency_s
                 for level in profiles.levels}  # fmt: skip
    children: list[Child] = []
    try:
        addresses = []
        for i in range(workers):
            child = Child(
                ctx, f"worker-{i}", start_worker, f"stub-{i}", service_s, cpus=worker_cpus
            )
            children.append(child)
            addresses.append(child.wait_ready(60.0))
        child = Child(ctx, "router", router, addresses, *router_args, cpus=router_cpus)
        children.append(child)
        yield child.wait_ready(READY_TIMEOUT_S)
    finally:
        for child in reversed(children):
            child.close()


def processes(args: argparse.Namespace) -> Any:
    """The stub workers and this benchmark's router (a context manager)."""
    return stub_cluster(
        args.workers,
        args.time_scale,
        start_router,
        args.classifier,
        args.time_scale,
        args.classifier_threads,
    )


# -- the load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request as the load generator saw it."""

    at_s: float  # scheduled arrival, seconds from the start
    done_s: float  # answer, seconds from the start
    code: str  # "OK", a status code name, or "NOT_SENT" (over --max-outstanding)
    latency_ms: float  # send to answer, client side
    classify_ms: float = math.nan  # served: the router's arrival to the classifier's answer


def offer(
    stub: Any, times: np.ndarray, prompts: Sequence[str], deadline_ms: int, max_open: int
) -> list[Outcome]:
    """One request at each of ``times`` (open loop, at most ``max_open`` open at once)."""
    outcomes: list[Outcome | None] = [None] * len(times)
    lock = threading.Condition()
    open_calls = 0
    timeout_s = deadline_ms / 1e3 + 5.0

    def record(i: int, sent: float, future: Any) -> None:
        nonlocal open_calls
        done = time.perf_counter()
        err = future.exception()
        code = "OK" if err is None else (err.code().name if isinstance(err, grpc.Call) else "?")
        classify_ms = future.result().timing.classify_ms if err is None else math.nan
        outcomes[i] = Outcome(float(times[i]), done - start, code, (done - sent) * 1e3, classify_ms)
        with lock:
            open_calls -= 1
            lock.notify_all()

    start = time.perf_counter()
    for i, at in enumerate(times):
        if (delay := start + float(at) - time.perf_counter()) > 0:
            time.sleep(delay)
        with lock:
            if open_calls >= max_open:
                outcomes[i] = Outcome(float(at), float(at), "NOT_SENT", 0.0)
                continue
            open_calls += 1
        call = router_pb2.RouterGenerateRequest(
            prompt=prompts[i % len(prompts)], seed=i, deadline_ms=deadline_ms
        )
        sent = time.perf_counter()
        future = stub.Generate.future(call, timeout=timeout_s)
        future.add_done_callback(lambda f, i=i, sent=sent: record(i, sent, f))
    with lock:
        if not lock.wait_for(lambda: open_calls == 0, timeout_s + 10.0):
            raise RuntimeError(f"{open_calls} answers still missing after {timeout_s + 10:.0f} s")
    return [o for o in outcomes if o is not None]


# -- figures -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def windows(
    outcomes: list[Outcome], duration_s: float, window_s: float, capacity: float
) -> list[dict[str, Any]]:
    """The figures of each window: what arrived in it (offered, refused, ran out of
    deadline, other errors) and what was served in it (answers OK that came back in it)."""
    rows = []
    count = max(1, math.ceil(duration_s / window_s - 1e-9))
    for w in range(count):
        lo, hi = w * window_s, min((w + 1) * window_s, duration_s)
        inside = [o for o in outcomes if lo <= o.at_s < hi]
        codes = Counter(o.code for o in inside)
        refused = [o.latency_ms for o in inside if o.code == "RESOURCE_EXHAUSTED"]
        span = hi - lo
        ok = [o for o in outcomes if o.code == "OK" and lo <= o.done_s < hi]
        served = len(ok) / span
        rows.append({
            "window": f"{lo:g}-{hi:g} s",
            "offered_per_s": len(inside) / span,
            "served_per_s": served,
            "served_pct": 100.0 * served / capacity,
            "classify_p95_ms": pct([o.classify_ms for o in ok], 95),
            "refused": len(refused),
            "refusal_p50_ms": pct(refused, 50),
            "refusal_p95_ms": pct(refused, 95),
            "deadline": codes["DEADLINE_EXCEEDED"],
            "other": sum(n for c, n in codes.items()
                         if c not in ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")),
        })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]], outcomes: list[Outcome]) -> None:
    head = (f"{'window':>10} {'offered/s':>9} {'served/s':>8} {'% cap':>6} {'cls p95':>7} "
            f"{'refused':>7} "
            f"{'ref p50 ms':>10} {'ref p95 ms':>10} {'deadline':>8} {'other':>5}")  # fmt: skip
    print(head)
    for r in rows:
        print(
            f"{r['window']:>10} {r['offered_per_s']:9.1f} {r['served_per_s']:8.1f} "
            f"{r['served_pct']:6.1f} {r['classify_p95_ms']:7.1f} {r['refused']:7d} "
            f"{r['refusal_p50_ms']:10.1f} "
            f"{r['refusal_p95_ms']:10.1f} {r['deadline']:8d} {r['other']:5d}"
        )
    refused = [o.latency_ms for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    codes = Counter(o.code for o in outcomes)
    print(
        f"{'all':>10} refusals p50 {pct(refused, 50):.1f} ms, p95 {pct(refused, 95):.1f} ms; "
        f"codes {dict(sorted(codes.items()))}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--load", type=float, default=3.0, help="offered load × capacity")
    parser.add_argument("--workers", type=int, default=2, help="stub worker processes")
    parser.add_argument("--time-scale", type=float, default=0.025, help="profiled latencies × this")
    parser.add_argument("--deadline-ms", type=int, default=1000, help="every request's deadline")
    parser.add_argument("--classifier", choices=("default", "stub"), default="default")
    parser.add_argument(
        "--classifier-threads", type=int, default=1, help="torch intra-op threads of the router"
    )
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds per table row")
    parser.add_argument("--max-outstanding", type=int, default=2000, help="open calls at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("duration_s", "load", "time_scale", "window_s"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            parser.error(f"--{name.replace('_', '-')}: must be a positive number")
    for name in ("workers", "deadline_ms", "max_outstanding", "classifier_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts = [p.prompt for p in load_prompts(default_prompt_trace())]
    print(machine_line())
    print(f"load average before: {load_average()}")
    with processes(args) as router:
        capacity = sum(1.0 / s for s in router["service_s"].values())
        rate = args.load * capacity
        print(f"classifier: {router['classifier']}")
        print(
            f"{args.workers} stub workers, service s "
            f"{ {w: round(s, 4) for w, s in sorted(router['service_s'].items())} }; "
            f"capacity {capacity:.1f} req/s (computed: Σ 1 / service time)"
        )
        print(
            f"offering {rate:.1f} req/s ({args.load:g} × capacity) for {args.duration_s:g} s, "
            f"deadline {args.deadline_ms} ms"
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{router['port']}")
        try:
            stub = router_pb2_grpc.RouterStub(channel)
            times = arrivals(rate, args.duration_s, np.random.default_rng(args.seed))
            outcomes = offer(stub, times, prompts, args.deadline_ms, args.max_outstanding)
        finally:
            channel.close()
    rows = windows(outcomes, args.duration_s, args.window_s, capacity)
    print_table(rows, outcomes)
    print(f"load average after: {load_average()}")
    print("figures for stub workers on this machine; every process shares its CPUs")
    return {"capacity_per_s": capacity, "rate_per_s": rate, "windows": rows}


if __name__ == "__main__":
    main()
