"""The floor under a refusal: how fast a Python server that decides nothing, and refuses
every request with Argus's retry hint, answers a burst of 1,000 when it has one core.

``bench_concurrency.py --pin`` measures the router itself; this measures what any router
written as a Python process would pay before it decides anything, one front design at a
time, with the same load generator and the same split of the CPUs (the server alone on the
first CPU, the load generator on the others):

* ``grpc-sync``: ``grpc.server`` on a thread pool (the router's shape, 16 threads), the
  ``argus.v1.Router`` servicer's ``Generate`` parsing the request and aborting with
  RESOURCE_EXHAUSTED and a ``retry-after-ms`` trailer;
* ``grpc-aio``: the same servicer, ``async``, on a ``grpc.aio`` server (one event loop);
* ``http-uvicorn``: uvicorn's h11 protocol, as the router's HTTP front door runs it, with a
  bare ASGI app that reads the JSON body, parses it and answers 429 with Argus's error JSON
  and ``Retry-After`` (no Starlette routing, no hardening: less than the router does);
* ``http-raw``: an ``asyncio.Protocol`` that finds the end of the headers, reads
  ``Content-Length`` bytes, parses the JSON and writes the same 429: about the least any
  Python HTTP server can do per request;
* ``grpc-argus`` and ``http-argus``: the router's own gRPC server (``create_server``) and
  HTTP API (``HttpServer`` over ``create_app``) in front of a real ``RouterCore`` (stub
  classifier) whose two workers take calls and never answer, filled until its admission
  refuses: every request of the burst is then refused by the core, as overloaded.

For each it prints the refusals' latency from each request's own send (p50 / p95 / max),
the server's CPU time per request (``/proc``), and the answers that were not the hinted
refusal; with an ``-argus`` server, also the CPU a refusal takes in the core alone, called in
a loop. The load generator is ``bench_concurrency``'s (gRPC futures over ``--grpc-channels``
connections; HTTP one connection per request)::

    .venv/bin/python benchmarks/bench_refusal_floor.py [--requests 1000] [--rounds 3]
        [--servers grpc-sync,grpc-aio,http-uvicorn,http-raw,grpc-argus,http-argus]
        [--grpc-channels 10] [--grpc-threads 16]

Needs two CPUs. Figures are for the machine it runs on; the header says which, with its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
from _machine import load_line, machine_line
from _pinning import cpu_list, cpu_seconds, pin_this_process, split_cpus
from bench_concurrency import (
    RETRY_KEY,
    grpc_burst,
    http_burst,
    raise_open_files,
    router_pb2_grpc,
)

SERVERS = ("grpc-sync", "grpc-aio", "http-uvicorn", "http-raw", "grpc-argus", "http-argus")
DEADLINE_MS = 5000
RETRY_MS = "1000"
ERROR_JSON = json.dumps(
    {"error": {"message": "overloaded: no level can finish in time", "type": "rate_limit"}}
).encode()


def _refusal_text(request: Any) -> str:
    return f"overloaded: {len(request.prompt)} characters, deadline {request.deadline_ms} ms"


class SyncRefuser(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata(((RETRY_KEY, RETRY_MS),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal_text(request))


class AioRefuser(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    async def Generate(self, request: Any, context: Any) -> Any:
        context.set_trailing_metadata(((RETRY_KEY, RETRY_MS),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal_text(request))


def _answer_429(body: bytes) -> bytes:
    """The raw server's whole answer: the body parsed as the router would, then Argus's 429."""
    json.loads(body)
    return (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
        + str(len(ERROR_JSON)).encode()
        + b"\r\n\r\n"
        + ERROR_JSON
    )


class RawRefuser(asyncio.Protocol):
    """One connection: read until the head and ``Content-Length`` bytes of body are in,
    answer 429, close."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, body = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(body) < length:
            return
        self.transport.write(_answer_429(body[:length]))
        self.transport.close()


async def asgi_refuser(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app for uvicorn: read the body, parse it, answer 429."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    json.loads(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", b"1"),
        (b"content-length", str(len(ERROR_JSON)).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": ERROR_JSON})


def serve(kind: str, cpus: Sequence[int], threads: int, ready: Connection) -> None:
    """The child: pinned to ``cpus``, one server of ``kind``, its port sent on ``ready``;
    runs until killed."""
    os.sched_setaffinity(0, cpus)
    raise_open_files()
    if kind.endswith("-argus"):
        serve_argus(kind, ready)
        return
    if kind == "grpc-sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
        router_pb2_grpc.add_RouterServicer_to_server(SyncRefuser(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        ready.send(port)
        server.wait_for_termination()
        return
    asyncio.run(_serve_async(kind, ready))


class SilentWorkers:
    """Workers that take every call and answer none until closed (then each fails)."""

    def __init__(self) -> None:
        self.never = threading.Event()

    def generate(self, address: str, call: Any, **_: Any) -> Any:
        from argus.router.core import WorkerError
        from argus.router.values import Refusal

        self.never.wait()
        raise WorkerError(Refusal.UNAVAILABLE, f"{address}: closed")

    def keep_only(self, addresses: set[str]) -> None:
        pass

    def close(self) -> None:
        self.never.set()


def refusing_core() -> Any:
    """``RouterCore`` as ``argus router`` builds it (stub classifier), on a plan of two workers
    that never answer, filled until its admission refuses: every request after that is
    refused as overloaded with a retry hint, before a worker is called."""
    from _plan import allocator_plan, scaled_profiles
    from bench_overload import load_classifier

    from argus.contracts.router_api import RouterRequest
    from argus.router.config import RouterServiceConfig
    from argus.router.core import RouterCore
    from argus.router.values import RouterError

    profiles = scaled_profiles(0.025)
    workers = [("worker-0", "127.0.0.1:9"), ("worker-1", "127.0.0.1:10")]
    classifier, _ = load_classifier("stub", 1)
    config = RouterServiceConfig(router_id="floor", max_in_flight=4096)
    core = RouterCore(profiles, classifier, config, workers=SilentWorkers())
    core.install(allocator_plan(profiles, workers, "floor"))
    refused = threading.Event()

    def fill(i: int) -> None:
        try:
            core.generate(RouterRequest(prompt=f"filler {i}", seed=i, deadline_ms=DEADLINE_MS))
        except RouterError:
            refused.set()

    for i in range(1000):
        threading.Thread(target=fill, args=(i,), daemon=True).start()
        if refused.wait(0.001):
            return core
    raise RuntimeError("the core admitted 1,000 requests without refusing one")


def core_refusal_ms(count: int = 2000) -> float:
    """CPU milliseconds a refusal takes in :func:`refusing_core`'s core alone, called in a
    loop on this thread (no transport)."""
    from argus.contracts.router_api import RouterRequest
    from argus.router.values import RouterError

    core = refusing_core()
    try:
        started = time.process_time()
        for i in range(count):
            with contextlib.suppress(RouterError):
                core.generate(
                    RouterRequest(prompt=f"one more {i}", seed=i, deadline_ms=DEADLINE_MS)
                )
        return (time.process_time() - started) * 1e3 / count
    finally:
        core.close()


def serve_argus(kind: str, ready: Connection) -> None:
    """The router's own gRPC server (``create_server``) or HTTP API (``HttpServer``)."""
    from argus.router.app import create_server
    from argus.router.http_app import create_app
    from argus.router.http_server import HttpServer

    core = refusing_core()
    if kind == "grpc-argus":
        server, port, _ = create_server(core)
        server.start()
        ready.send(port)
        server.wait_for_termination()
        return
    http = HttpServer(create_app(core), "127.0.0.1", 0)
    http.start()
    ready.send(http.port)
    threading.Event().wait()


async def _serve_async(kind: str, ready: Connection) -> None:
    if kind == "grpc-aio":
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(AioRefuser(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.send(port)
        await server.wait_for_termination()
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    if kind == "http-raw":
        raw = await asyncio.get_running_loop().create_server(RawRefuser, sock=sock, backlog=4096)
        ready.send(port)
        await raw.serve_forever()
        return
    import uvicorn

    config = uvicorn.Config(
        asgi_refuser, http="h11", log_level="error", access_log=False, backlog=4096
    )
    ready.send(port)
    await uvicorn.Server(config).serve(sockets=[sock])


def one_round(
    kind: str, server_cpus: Sequence[int], requests: int, channels: int, threads: int
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(
        target=serve, args=(kind, tuple(server_cpus), threads, theirs), daemon=True
    )
    child.start()
    try:
        if not mine.poll(60):
            raise RuntimeError(f"{kind}: the server did not start")
        port = mine.recv()
        time.sleep(0.5)  # let it settle into its wait
        cpu_before = cpu_seconds(child.pid or 0)
        if kind.startswith("grpc"):
            outcomes = grpc_burst(port, requests, DEADLINE_MS, channels)
        else:
            outcomes = http_burst(port, requests, DEADLINE_MS)
        cpu_ms = (cpu_seconds(child.pid or 0) - cpu_before) * 1e3
    finally:
        child.kill()
        child.join()
    refused = [o.own_ms for o in outcomes if o.kind == "argus"]
    others = Counter(f"{o.code} {o.detail[:30]}" for o in outcomes if o.kind != "argus")
    return {
        "refused": len(refused),
        "other": len(outcomes) - len(refused),
        "others": dict(others),
        "p50_ms": float(np.percentile(refused, 50)) if refused else float("nan"),
        "p95_ms": float(np.percentile(refused, 95)) if refused else float("nan"),
        "max_ms": max(refused, default=float("nan")),
        "cpu_ms_per_request": cpu_ms / max(len(outcomes), 1),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--grpc-channels", type=int, default=10)
    parser.add_argument("--grpc-threads", type=int, default=16, help="grpc-sync's pool")
    args = parser.parse_args(argv)
    kinds = [k for k in args.servers.split(",") if k]
    unknown = sorted(set(kinds) - set(SERVERS))
    if unknown:
        parser.error(f"--servers: unknown {unknown}; known: {', '.join(SERVERS)}")
    server_cpus, client_cpus = split_cpus()
    before = sorted(os.sched_getaffinity(0))
    pin_this_process(client_cpus)  # every thread of this process, gRPC's included
    try:
        results = _measure(args, kinds, server_cpus, client_cpus)
    finally:
        pin_this_process(before)  # a caller (a test) gets its CPUs back
    print(load_line("after"))
    return results


def _measure(
    args: argparse.Namespace,
    kinds: list[str],
    server_cpus: Sequence[int],
    client_cpus: Sequence[int],
) -> dict[str, list[dict[str, Any]]]:
    raise_open_files()
    print(machine_line())
    print(load_line("before"))
    print(
        f"server alone on {cpu_list(server_cpus)}, load generator on {cpu_list(client_cpus)}; "
        f"{args.requests} requests at once, {args.rounds} rounds per server"
    )
    results: dict[str, list[dict[str, Any]]] = {}
    for kind in kinds:
        results[kind] = [
            one_round(kind, server_cpus, args.requests, args.grpc_channels, args.grpc_threads)
            for _ in range(args.rounds)
        ]
        for r in results[kind]:
            print(
                f"{kind:13s} refused with the hint {r['refused']:5d}, other {r['other']:3d}; "
                f"own-send latency p50 {r['p50_ms']:7.1f} ms, p95 {r['p95_ms']:7.1f} ms, "
                f"max {r['max_ms']:7.1f} ms; server CPU {r['cpu_ms_per_request']:.3f} ms "
                "per request"
            )
            if r["others"]:
                print(f"{'':13s} other answers: {r['others']}")
    if any(kind.endswith("-argus") for kind in kinds):
        print(f"the core's own refusal, in a loop on one thread: {core_refusal_ms():.3f} ms CPU")
    return results


if __name__ == "__main__":
    main()
