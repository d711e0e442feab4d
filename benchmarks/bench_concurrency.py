"""Concurrency: 1,000 requests at the same instant, over HTTP and over gRPC, to one router. Who
answers each one, how fast a refusal comes, and whether any answer comes after its deadline.

Processes on this machine, as in a deployment with one router:

* **stub workers**, one child process each (``bench_overload``'s): the real
  ``argus.v1.Worker`` interface serving one request at a time for its level's profiled
  latency × ``--time-scale`` (a sleep, no model), dropping a request whose deadline passes in
  its queue;
* **the router** (another child): ``RouterCore`` on the plan an in-process allocator made for
  the workers, with the stub classifier (``--classifier default`` loads the committed one),
  behind both of its public endpoints as ``argus router`` builds them: the gRPC server of
  ``argus.router.app.create_server`` (sized by ``grpc_sizes``: the in-flight bound, the
  handler threads and gRPC's own ``maximum_concurrent_rpcs``, printed) and the HTTP API of
  ``argus.router.http_app`` (``create_app`` in an ``HttpServer``), on loopback;
* **the load generator** (this process): for each transport in turn, ``--requests``
  requests started together, each with ``deadline_ms`` = ``--deadline-ms``. gRPC: ``Generate``
  futures created back to back, spread over ``--grpc-channels`` channels (each its own
  connection, as separate clients). HTTP: one asyncio task per request, each on its own
  connection (HTTP/1.1, ``Connection: close``), all started before any is awaited. Clients
  wait up to the deadline + 10 s, so that a late answer is seen rather than cut off.

Per transport it prints: answered (a status or HTTP answer came back), served (OK / 200),
refused by Argus with a retry hint (gRPC RESOURCE_EXHAUSTED or UNAVAILABLE with the
``retry-after-ms`` trailer; HTTP 429/503 with Argus's JSON error and ``Retry-After``), refused
by the transport (gRPC's own words: RESOURCE_EXHAUSTED without the trailer, as gRPC's
"Concurrent RPC limit exceeded!" comes, or a connection failure; HTTP: an answer whose body is
not Argus's JSON error, or no answer at all), the remaining answers by code, the latency
p50 / p95 / max of each kind of refusal (client side, from the moment the burst began), and
how many answers of any kind came after their request's deadline.

    .venv/bin/python benchmarks/bench_concurrency.py [--requests 1000] [--deadline-ms 5000]
        [--workers 2] [--time-scale 0.025] [--classifier stub|default] [--grpc-channels 10]
        [--transports grpc,http] [--max-in-flight 256]

These are figures for stub workers on this machine: the router, the workers and the load
generator share its CPUs, so the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np
from _machine import load_line, machine_line
from _plan import allocator_plan, scaled_profiles
from bench_overload import load_classifier, stub_cluster

from argus.plumbing import rpc

router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

READY_TIMEOUT_S = 300.0  # the real classifier imports torch and loads MiniLM
SLACK_S = 10.0  # clients wait this long past the deadline, so a late answer is seen
RETRY_KEY = "retry-after-ms"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"


# -- the router ----------------------------------------------------------------------------


def raise_open_files() -> int:
    """The soft limit on open files raised to the hard one (a burst holds a socket per
    request on each side); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_router(
    workers: list[tuple[str, str]], classifier_name: str, time_scale: float, max_in_flight: int
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


def processes(args: argparse.Namespace) -> Any:
    """The stub workers and this benchmark's router (a context manager)."""
    return stub_cluster(
        args.workers,
        args.time_scale,
        start_router,
        args.classifier,
        args.time_scale,
        args.max_in_flight,
    )


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
    args = parser.parse_args(argv)
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
    raise_open_files()
    results: dict[str, Any] = {}
    with processes(args) as router:
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
            if transport == "grpc":
                outcomes = grpc_burst(
                    router["grpc_port"], args.requests, args.deadline_ms, args.grpc_channels
                )
            else:
                outcomes = http_burst(router["http_port"], args.requests, args.deadline_ms)
            results[transport] = summarize(transport, outcomes, args.deadline_ms)
            wait_s = args.deadline_ms / 1e3
            time.sleep(min(wait_s, 5.0))
    print(load_line("end"))
    print("figures for stub workers on this machine; every process shares its CPUs")
    return results


if __name__ == "__main__":
    main()
