"""Concurrency: 1,000 requests at the same instant, over HTTP and over gRPC, to one router. Who
answers each one, how fast a refusal comes, whether any answer comes after its deadline, and
whether health stays its own path meanwhile. Processes on this machine:

* **stub workers** (``bench_overload``'s, one process each): the real ``argus.v1.Worker``
  interface, one request at a time for its level's profiled latency × ``--time-scale``;
* **the router** (another child): ``RouterCore`` on the plan an in-process allocator made,
  stub classifier (``--classifier default``: the committed one), behind the gRPC server of
  ``argus.router.app.create_server`` (its ``grpc_sizes`` printed) and the HTTP API of
  ``argus.router.http_app`` in an ``HttpServer``, as ``argus router`` builds them;
* **the load generator** (this process): per transport, ``--requests`` requests started
  together with ``deadline_ms`` = ``--deadline-ms``. gRPC: ``Generate`` futures over
  ``--grpc-channels`` connections; HTTP: one asyncio task and connection per request
  (``Connection: close``). Clients wait the deadline + 10 s, so a late answer is seen;
* **a health prober** (its own process), during each burst: ``GET /healthz`` on a new
  connection, as a kubelet does, and a ``grpc.health.v1`` ``Check``, every ``--probe-ms``
  each, with the Helm chart's probe timeout (5 s).

Placement (the header says which ran): unpinned by default. ``--pin``: the router alone on
the first CPU; workers, prober and load generator on the others, as a node honouring the Helm
chart's CPU requests would (``_pinning``). ``--noisy-neighbour``: a CPU-bound busy loop on the
workers' CPUs (any CPU unpinned) at ``argus up``'s ``compute_nice``, the whole run.

Per transport it prints: answered, served (OK / 200), refused by Argus with a retry hint
(``retry-after-ms`` trailer; HTTP 429/503 with Argus's JSON error and ``Retry-After``),
refused by the transport (gRPC's own RESOURCE_EXHAUSTED, a connection failure; HTTP: a body
that is not Argus's error, or no answer), other answers by code, each refusal kind's latency
p50 / p95 / max (from the burst's start and from the request's own send), answers after the
deadline, and the health probes' p50 / p99 / max per protocol with the failed ones.

    .venv/bin/python benchmarks/bench_concurrency.py [--requests 1000] [--deadline-ms 5000]
        [--workers 2] [--time-scale 0.025] [--classifier stub|default] [--grpc-channels 10]
        [--transports grpc,http] [--max-in-flight 256] [--probe-ms 10] [--pin]
        [--noisy-neighbour]

Figures for stub workers on this machine: its processes share its CPUs; the load average is
printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
from _machine import load_line, machine_line
from _pinning import (
    NoisyNeighbour,
    add_window_argument,
    mode_line,
    pin_this_process,
    split_cpus,
    with_window,
)
from _plan import allocator_plan, scaled_profiles
from bench_overload import load_classifier, stub_cluster

from argus.plumbing import rpc
from argus.tools.local_cluster import ClusterSpec, inherited_affinity

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

READY_TIMEOUT_S = 300.0  # the real classifier imports torch and loads MiniLM
SLACK_S = 10.0  # clients wait this long past the deadline, so a late answer is seen
RETRY_KEY = "retry-after-ms"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
PROBE_TIMEOUT_S = 5.0  # the Helm chart's probes.timeoutSeconds


# -- the router ----------------------------------------------------------------------------


def raise_open_files() -> int:
    """The soft limit on open files raised to the hard one (a burst holds a socket per
    request on each side); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_router(
    workers: list[tuple[str, str]],
    classifier_name: str,
    time_scale: float,
    max_in_flight: int,
    late_binding_window: int | None = None,
) -> tuple[dict[str, Any], Callable[[], None]]:
    """The router's gRPC server and HTTP API on one core, on the plan an allocator made for
    ``workers``; returns their ports, the gRPC sizes and a closer."""
    from argus.router.app import create_server, grpc_sizes
    from argus.router.config import RouterServiceConfig
    from argus.router.core import RouterCore
    from argus.router.http_app import create_app
    from argus.router.http_server import HttpServer
    from argus.router.worker_calls import GrpcWorkers

    open_files = raise_open_files()
    profiles = scaled_profiles(time_scale)
    published = allocator_plan(profiles, workers, "concurrency")
    classifier, label = load_classifier(classifier_name, 1)
    config = RouterServiceConfig(router_id="concurrency", max_in_flight=max_in_flight)
    config = with_window(config, late_binding_window)
    core = RouterCore(profiles, classifier, config, workers=GrpcWorkers())
    core.install(published)
    server, grpc_port, _ = create_server(core)
    server.start()
    http = HttpServer(create_app(core), "127.0.0.1", 0)
    http.start()
    draining = threading.Event()

    def drain() -> None:  # what StatsReporter takes each second, without the RPC
        while not draining.wait(1.0):
            core.take_report()

    threading.Thread(target=drain, name="bench-drain", daemon=True).start()
    sizes = grpc_sizes(max_in_flight)
    classes = published.worker_classes()
    info = {
        "grpc_port": grpc_port,
        "http_port": http.port,
        "classifier": label,
        "sizes": (sizes.in_flight, sizes.threads, sizes.max_concurrent_rpcs),
        "open_files": open_files,
        "service_s": {
            w: profiles.profile(classes[w], level).latency_s
            for w, level in published.plan.allocation.assignment.items()
        },
    }

    def close() -> None:
        draining.set()
        http.stop()
        server.stop(grace=None)
        core.close()
        closer = getattr(classifier, "close", None)
        if closer is not None:
            closer()

    return info, close


def processes(args: argparse.Namespace, pinned: tuple[Sequence[int], Sequence[int]] | None) -> Any:
    """The stub workers and this benchmark's router (a context manager); ``pinned``: (the
    router's CPUs, the workers') or None."""
    return stub_cluster(
        args.workers,
        args.time_scale,
        start_router,
        args.classifier,
        args.time_scale,
        args.max_in_flight,
        args.late_binding_window,
        router_cpus=None if pinned is None else pinned[0],
        worker_cpus=None if pinned is None else pinned[1],
    )


# -- the health prober ---------------------------------------------------------------------


Probe = tuple[float, bool]  # (latency in ms, answered healthy within the timeout)


def probe_loop(check: Callable[[], bool], period_s: float, stop: Any, out: list[Probe]) -> None:
    """Call ``check`` every ``period_s`` (at once after a slower one) until ``stop`` is set."""
    next_at = time.perf_counter()
    while not stop.is_set():
        began = time.perf_counter()
        try:
            healthy = check()
        except Exception:  # a refused connection, a timeout, an RPC error: a failed probe
            healthy = False
        out.append(((time.perf_counter() - began) * 1e3, healthy))
        next_at = max(next_at + period_s, time.perf_counter())
        stop.wait(next_at - time.perf_counter())


def run_prober(
    http_port: int, grpc_port: int, period_s: float, stop: Any, conn: Connection
) -> None:
    """The prober's process: HTTP ``/healthz`` and gRPC ``Check`` probes, one thread each,
    until ``stop`` is set; sends "ready" once both can start, then {"http": [...], "grpc":
    [...]} of :data:`Probe`."""
    import http.client

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING

    def http_check() -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=PROBE_TIMEOUT_S)
        try:
            connection.request("GET", "/healthz")
            answer = connection.getresponse()
            answer.read()
            return answer.status == 200
        finally:
            connection.close()

    def grpc_check() -> bool:
        request = health_pb2.HealthCheckRequest(service="")
        return bool(health.Check(request, timeout=PROBE_TIMEOUT_S).status == serving)

    results: dict[str, list[Probe]] = {"http": [], "grpc": []}
    threads = [
        threading.Thread(target=probe_loop, args=(check, period_s, stop, results[name]))
        for name, check in (("http", http_check), ("grpc", grpc_check))
    ]
    conn.send("ready")
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    conn.send(results)


class HealthProber:
    """:func:`run_prober` in a spawned process of its own (so the load generator's threads
    never delay a probe), on ``cpus``; probing from construction until :meth:`stop`."""

    def __init__(
        self, http_port: int, grpc_port: int, period_s: float, cpus: Sequence[int] | None
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=run_prober,
            args=(http_port, grpc_port, period_s, self._stop, theirs),
            name="health-prober",
            daemon=True,
        )
        with inherited_affinity(cpus):
            self.process.start()
        theirs.close()
        try:
            ready = self._conn.poll(60.0) and self._conn.recv() == "ready"
        except EOFError:  # it died first
            ready = False
        if not ready:
            self.close()
            raise RuntimeError("the health prober did not start")

    def stop(self) -> dict[str, list[Probe]]:
        """Stop probing; the probes of each protocol."""
        self._stop.set()
        if not self._conn.poll(PROBE_TIMEOUT_S + 10.0):
            raise RuntimeError("the health prober sent no results")
        results: dict[str, list[Probe]] = self._conn.recv()
        self.close()
        return results

    def close(self) -> None:
        self._stop.set()
        self.process.join(PROBE_TIMEOUT_S + 5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


# -- the bursts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request as the load generator saw it."""

    kind: str  # "served", "argus" (refused with a retry hint), "transport", or "other"
    code: str  # gRPC status name or HTTP status ("none" when nothing came back)
    latency_ms: float  # from the start of the burst to the answer
    detail: str = ""  # the refusal's text, cut short
    sent_ms: float = 0.0  # when it left the client, from the start of the burst

    @property
    def own_ms(self) -> float:
        """From its own sending to its answer."""
        return self.latency_ms - self.sent_ms


def grpc_outcome(future: Any, latency_ms: float) -> Outcome:
    err = future.exception()
    if err is None:
        return Outcome("served", "OK", latency_ms)
    if not isinstance(err, grpc.Call):
        return Outcome("transport", type(err).__name__, latency_ms, str(err)[:80])
    code, details = err.code(), err.details() or ""
    hinted = any(k == RETRY_KEY for k, _ in err.trailing_metadata() or ())
    if hinted:
        return Outcome("argus", code.name, latency_ms, details[:80])
    transport = code is grpc.StatusCode.RESOURCE_EXHAUSTED or (
        code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    )
    return Outcome("transport" if transport else "other", code.name, latency_ms, details[:80])


def grpc_burst(port: int, count: int, deadline_ms: int, channels: int) -> list[Outcome]:
    """``count`` Generate calls started back to back over ``channels`` connections."""
    opened = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.channel_id", i)])
        for i in range(channels)
    ]  # a distinct option gives each its own connection
    stubs = [router_pb2_grpc.RouterStub(c) for c in opened]
    for c in opened:
        grpc.channel_ready_future(c).result(timeout=30)
    outcomes: list[Outcome | None] = [None] * count
    done = threading.Semaphore(0)
    timeout_s = deadline_ms / 1e3 + SLACK_S
    try:
        start = time.perf_counter()

        def record(i: int, sent_ms: float, future: Any) -> None:
            outcome = grpc_outcome(future, (time.perf_counter() - start) * 1e3)
            outcomes[i] = replace(outcome, sent_ms=sent_ms)
            done.release()

        for i in range(count):
            call = router_pb2.RouterGenerateRequest(
                prompt=f"{PROMPT}, take {i}", seed=i, deadline_ms=deadline_ms
            )
            sent_ms = (time.perf_counter() - start) * 1e3
            future = stubs[i % channels].Generate.future(call, timeout=timeout_s)
            future.add_done_callback(lambda f, i=i, sent=sent_ms: record(i, sent, f))
        for _ in range(count):
            if not done.acquire(timeout=timeout_s + SLACK_S):
                raise RuntimeError(f"gRPC answers still missing after {timeout_s + SLACK_S} s")
    finally:
        for c in opened:
            c.close()
    return [o for o in outcomes if o is not None]


def http_outcome(status: int, headers: dict[str, str], body: bytes, latency_ms: float) -> Outcome:
    if status == 200:
        return Outcome("served", "200", latency_ms)
    try:
        error = json.loads(body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):  # not Argus's error JSON: the server's own
        return Outcome("transport", str(status), latency_ms, body[:80].decode(errors="replace"))
    if status in (429, 503) and "retry-after" in headers:
        return Outcome("argus", str(status), latency_ms, message[:80])
    return Outcome("other", str(status), latency_ms, message[:80])


async def http_request(port: int, body: bytes, timeout_s: float, start: float) -> Outcome:
    """One POST on its own connection; the answer read to the end."""

    def elapsed_ms() -> float:
        return (time.perf_counter() - start) * 1e3

    sent_ms = elapsed_ms()  # the task's turn to connect came
    outcome = await _http_request(port, body, timeout_s, elapsed_ms)
    return replace(outcome, sent_ms=sent_ms)


async def _http_request(
    port: int, body: bytes, timeout_s: float, elapsed_ms: Callable[[], float]
) -> Outcome:
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head + body)
                await writer.drain()
                answer = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError) as err:
        return Outcome("transport", "none", elapsed_ms(), f"{type(err).__name__}: {err}"[:80])
    status_line, _, rest = answer.partition(b"\r\n")
    raw_headers, _, payload = rest.partition(b"\r\n\r\n")
    parts = status_line.split(b" ")
    if len(parts) < 2 or not parts[1].isdigit():
        return Outcome("transport", "none", elapsed_ms(), answer[:80].decode(errors="replace"))
    headers = {}
    for line in raw_headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    return http_outcome(int(parts[1]), headers, payload, elapsed_ms())


def http_burst(port: int, count: int, deadline_ms: int) -> list[Outcome]:
    """``count`` POSTs started together, one connection each."""

    async def burst() -> list[Outcome]:
        timeout_s = deadline_ms / 1e3 + SLACK_S
        bodies = [
            json.dumps({"prompt": f"{PROMPT}, take {i}", "seed": i, "deadline_ms": deadline_ms})
            for i in range(count)
        ]
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(http_request(port, b.encode(), timeout_s, start)) for b in bodies
        ]
        return list(await asyncio.gather(*tasks))

    return asyncio.run(burst())


# -- figures -------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p95 = np.percentile(values, [50, 95])
    return f"p50 {p50:.0f} / p95 {p95:.0f} / max {max(values):.0f} ms"


def summarize_probes(probes: dict[str, list[Probe]]) -> dict[str, Any]:
    """Per protocol: probes made, failed (unhealthy, error or timeout), latency of the
    healthy ones; printed as one line each."""
    figures: dict[str, Any] = {}
    for protocol, made in probes.items():
        healthy = [ms for ms, ok in made if ok]
        p50, p99 = np.percentile(healthy, [50, 99]) if healthy else (math.nan, math.nan)
        figures[protocol] = {
            "probes": len(made),
            "failed": len(made) - len(healthy),
            "p50_ms": float(p50),
            "p99_ms": float(p99),
            "max_ms": max(healthy, default=math.nan),
        }
        f = figures[protocol]
        label = "HTTP GET /healthz" if protocol == "http" else "gRPC health Check"
        print(
            f"   {label} during the burst: {f['probes']} probes, {f['failed']} failed or over "
            f"{PROBE_TIMEOUT_S:g} s; p50 {f['p50_ms']:.1f} / p99 {f['p99_ms']:.1f} / max "
            f"{f['max_ms']:.1f} ms"
        )
    return figures


def summarize(name: str, outcomes: list[Outcome], deadline_ms: int) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    answered = sum(1 for o in outcomes if o.code != "none")
    late = Counter(o.kind for o in outcomes if o.code != "none" and o.latency_ms > deadline_ms)
    others = Counter(o.code for o in outcomes if o.kind == "other")
    argus = [o.latency_ms for o in outcomes if o.kind == "argus"]
    transport = [o.latency_ms for o in outcomes if o.kind == "transport"]
    argus_own = [o.own_ms for o in outcomes if o.kind == "argus"]
    sent_last = max((o.sent_ms for o in outcomes), default=0.0)
    refusals = Counter(o.detail.split(":")[0] for o in outcomes if o.kind == "argus")
    transport_words = Counter(o.detail[:40] for o in outcomes if o.kind == "transport")
    print(f"-- {name}: {len(outcomes)} requests at once, deadline {deadline_ms} ms")
    print(f"   answered {answered}, served {kinds['served']}")
    print(f"   the last request left the client {sent_last:.0f} ms after the first")
    p50, p95 = np.percentile(argus_own, [50, 95]) if argus_own else (math.nan, math.nan)
    print(f"   refused by Argus with a retry hint: {kinds['argus']}")
    print(f"      latency from the burst's start: {spread(argus)}")
    print(f"      from the request's own send:    {spread(argus_own)}")
    print(f"      why (the refusal's first words): {dict(refusals.most_common(4))}")
    print(f"   refused by the transport: {kinds['transport']}  ({spread(transport)})")
    if transport_words:
        print(f"      what it said: {dict(transport_words.most_common(3))}")
    print(f"   other answers: {dict(others) or 0}")
    by_kind = f" {dict(late)}" if late else ""
    print(f"   answers after their deadline: {late.total()}{by_kind}")
    return {
        "requests": len(outcomes),
        "answered": answered,
        "served": kinds["served"],
        "refused_argus": kinds["argus"],
        "refused_transport": kinds["transport"],
        "other": dict(others),
        "late": late.total(),
        "argus_refusal_ms": argus,
        "argus_refusal_own_ms": argus_own,
        "argus_refusal_own_p50_ms": float(p50),
        "argus_refusal_own_p95_ms": float(p95),
        "transport_refusal_ms": transport,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per burst")
    parser.add_argument("--deadline-ms", type=int, default=5000, help="every request's deadline")
    parser.add_argument("--workers", type=int, default=2, help="stub worker processes")
    parser.add_argument("--time-scale", type=float, default=0.025, help="profiled latencies × this")
    parser.add_argument("--classifier", choices=("stub", "default"), default="stub")
    parser.add_argument("--grpc-channels", type=int, default=10, help="gRPC connections")
    parser.add_argument("--transports", default="grpc,http", help="bursts, in this order")
    parser.add_argument("--max-in-flight", type=int, default=256, help="the router's max_in_flight")
    add_window_argument(parser)
    parser.add_argument(
        "--probe-ms", type=float, default=10.0, help="health probe period, each protocol"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the router on the first CPU alone; stub workers and the load generator on the rest",
    )
    parser.add_argument(
        "--noisy-neighbour",
        action="store_true",
        help="a CPU-bound busy loop on the workers' CPUs at argus up's compute nice, the whole run",
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.probe_ms) and args.probe_ms > 0):
        parser.error("--probe-ms: must be a positive number")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        parser.error("--time-scale: must be a positive number")
    for name in ("requests", "deadline_ms", "workers", "grpc_channels", "max_in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not args.transports or any(t not in ("grpc", "http") for t in args.transports):
        parser.error("--transports: a comma-separated list of grpc and http")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(machine_line())
    pinned = split_cpus() if args.pin else None
    others = None if pinned is None else pinned[1]
    neighbour = NoisyNeighbour(others, ClusterSpec.compute_nice)
    print(mode_line(pinned, "the stub workers, the health prober and the load generator"))
    print(neighbour.describe() if args.noisy_neighbour else "noisy neighbour: none")
    if others is not None:
        pin_this_process(others)  # before any channel or pool starts a thread
    raise_open_files()
    results: dict[str, Any] = {"pinned": pinned, "noisy_neighbour": args.noisy_neighbour}
    with neighbour if args.noisy_neighbour else nullcontext(), processes(args, pinned) as router:
        in_flight, threads, max_rpcs = router["sizes"]
        capacity = sum(1.0 / s for s in router["service_s"].values())
        print(f"classifier: {router['classifier']}")
        print(
            f"{args.workers} stub workers, capacity {capacity:.1f} req/s (Σ 1 / service time); "
            f"router max_in_flight {args.max_in_flight}; gRPC: in-flight bound {in_flight}, "
            f"{threads} handler threads, gRPC's own bound {max_rpcs} calls; "
            f"open files {router['open_files']}"
        )
        for transport in args.transports:
            time.sleep(1.0)  # the previous burst's held requests have drained by now
            print(load_line(f"{transport} burst"))
            prober = HealthProber(
                router["http_port"], router["grpc_port"], args.probe_ms / 1e3, others
            )
            try:
                if transport == "grpc":
                    outcomes = grpc_burst(
                        router["grpc_port"], args.requests, args.deadline_ms, args.grpc_channels
                    )
                else:
                    outcomes = http_burst(router["http_port"], args.requests, args.deadline_ms)
            finally:
                probes = prober.stop()
            results[transport] = summarize(transport, outcomes, args.deadline_ms)
            results[transport]["health"] = summarize_probes(probes)
            wait_s = args.deadline_ms / 1e3
            time.sleep(min(wait_s, 5.0))
        if args.noisy_neighbour:
            print(neighbour.usage_line())
    print(load_line("end"))
    print("figures for stub workers on this machine; every process shares its CPUs")
    return results


if __name__ == "__main__":
    main()
