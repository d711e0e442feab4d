"""The HTTP front door under hostile or careless clients: bodies too deep, too large or too
slow, headers too slow, answers nobody reads, requests uvicorn cannot parse, bursts beyond
the bounds, and fields that only look valid. Each refusal is OpenAI's error JSON naming the
field at fault; none waits for a thread, and no connection is held past a deadline.

A real RouterCore on a fake worker transport (``FakeWorkers``: answers at once, or holds
until released) behind the real ``HttpServer`` on loopback; raw sockets where a client must
misbehave below what httpx would send. Deadlines are shortened for the tests; no test
asserts a duration: a fix that is missing shows as an answer that never comes (the socket
read times out) or that comes in the wrong shape.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.generate import GenerateCall, GenerateResult
from argus.contracts.progress import ProgressSink
from argus.contracts.workers import WorkerReport
from argus.router import http_app, http_server
from argus.router.app import PrometheusStats
from argus.router.config import RouterServiceConfig
from argus.router.core import RouterCore
from argus.router.http_app import create_app
from argus.router.http_server import HttpServer
from argus.router.metrics import RouterMetrics
from argus.router.stats import NO_STATS
from tests.router_cluster import PROFILES, TIMEOUT, FakeClock, StubClassifier
from tests.test_router_core import FakeWorkers, served

pytestmark = pytest.mark.integration


TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GENERATIONS = "/v1/images/generations"


def make_core(
    workers: FakeWorkers, config: RouterServiceConfig | None = None, metrics: Any = None
) -> RouterCore:
    """A core on the plan an allocator control makes for one worker ``w0`` at ``w0:1``."""
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    control.heartbeat(WorkerReport("w0", "w0:1", PROFILES.worker_classes[0]))
    core = RouterCore(
        PROFILES,
        StubClassifier(),
        config or RouterServiceConfig(),
        workers=workers,
        clock=clock,
        stats=NO_STATS if metrics is None else PrometheusStats(metrics),
    )
    assert core.install(control.current)
    return core


@contextmanager
def serving(
    core: RouterCore, server_options: dict[str, Any] | None = None, **app_options: Any
) -> Iterator[HttpServer]:
    server = HttpServer(
        create_app(core, token=TOKEN, **app_options), "127.0.0.1", 0, **(server_options or {})
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def workers() -> FakeWorkers:
    return FakeWorkers()


@pytest.fixture
def server(workers: FakeWorkers) -> Iterator[HttpServer]:
    with serving(make_core(workers)) as made:
        yield made


def post(server: HttpServer, body: Any = None, content: bytes | None = None) -> httpx.Response:
    url = f"http://127.0.0.1:{server.port}{GENERATIONS}"
    if content is not None:
        return httpx.post(url, content=content, headers=AUTH, timeout=TIMEOUT)
    return httpx.post(url, json=body, headers=AUTH, timeout=TIMEOUT)


def error_of(answer: httpx.Response) -> dict[str, Any]:
    """The answer's error object, after checking it is OpenAI's shape in JSON."""
    assert answer.headers["content-type"] == "application/json"
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- raw HTTP/1.1 over a socket -------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        assert self.headers["content-type"] == "application/json"
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error


def connect(server: HttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)


def read_answer(sock: socket.socket) -> Answer:
    """One answer with a Content-Length (every error answer has one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"connection closed before an answer: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "connection closed inside the answer"
        body += more
    return Answer(int(lines[0].split()[1]), headers, body[:length])


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reads until it does; a read that times out
    raises)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def head(path: str = GENERATIONS, *extra: str, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: argus", f"Authorization: Bearer {TOKEN}"]
    return "\r\n".join([*lines, *extra, "", ""]).encode("latin-1")


def wait_for(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` until it holds, for at most TIMEOUT seconds."""
    done = threading.Event()
    for _ in range(int(TIMEOUT / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()


@contextmanager
def holding_the_loop(server: HttpServer) -> Iterator[None]:
    """Block the server's event loop for the duration (requests arriving meanwhile wait in the
    kernel, to be read together)."""
    loop = server._server.servers[0].get_loop()
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:
        blocked.set()
        release.wait(TIMEOUT)

    loop.call_soon_threadsafe(block)
    assert blocked.wait(TIMEOUT)
    try:
        yield
    finally:
        release.set()


# -- the body -------------------------------------------------------------------------------


def test_a_body_nested_too_deep_or_with_too_many_arrays_is_400_naming_body_unparsed(
    server: HttpServer,
) -> None:
    brackets = post(server, content=b"[" * 100_000)  # json.loads recursed: a 500
    assert brackets.status_code == 400
    assert error_of(brackets)["param"] == "body"
    nested: Any = "x"
    for _ in range(40):  # well-formed, and within json's recursion: refused by the depth check
        nested = [nested]
    deep = post(server, {"prompt": "a fox", "user": nested})
    assert deep.status_code == 400 and error_of(deep)["param"] == "body"
    assert "nested deeper than 32" in error_of(deep)["message"]
    wide = post(server, {"prompt": "a fox", "user": [[]] * 2000})  # cheap to send, slow to parse
    assert wide.status_code == 400 and error_of(wide)["param"] == "body"
    assert "more than 1024 arrays and objects" in error_of(wide)["message"]
    in_a_string = post(server, {"prompt": "[{" * 5_000, "size": "64x64"})  # not nesting
    assert in_a_string.status_code == 200


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"a fox"', b"\xff\xfe{", b""])
def test_a_body_that_is_not_a_json_object_is_400_naming_body(
    server: HttpServer, content: bytes
) -> None:
    answer = post(server, content=content)
    assert answer.status_code == 400
    error = error_of(answer)
    assert error["param"] == "body" and error["message"].startswith("body: ")


def test_a_chunk_declared_beyond_the_body_limit_is_413_when_its_size_arrives(
    server: HttpServer,
) -> None:
    with connect(server) as sock:
        sock.sendall(head(GENERATIONS, "Transfer-Encoding: chunked") + b"ffffffffffffffff\r\n{")
        answer = read_answer(sock)  # without the fix: nothing until the body deadline (30 s)
        assert answer.status == 413 and answer.error()["param"] == "body"
        assert answer.headers["connection"] == "close" and closed(sock)


def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closed(
    workers: FakeWorkers,
) -> None:
    with serving(make_core(workers), body_timeout_s=0.2) as server, connect(server) as sock:
        sock.sendall(head(GENERATIONS, "Content-Length: 100") + b'{"prompt": ')
        answer = read_answer(sock)
        assert answer.status == 408 and answer.error()["param"] == "body"
        assert answer.headers["connection"] == "close" and closed(sock)
    assert workers.calls == []


def test_a_client_gone_while_sending_its_body_is_counted_499(workers: FakeWorkers) -> None:
    registry = CollectorRegistry()
    core = make_core(workers, metrics=RouterMetrics(PROFILES, registry))
    labels = {"route": GENERATIONS, "status": "499"}
    with serving(core) as server:
        with connect(server) as sock:
            sock.sendall(head(GENERATIONS, "Content-Length: 100") + b'{"prompt": ')
        counted = "argus_router_http_requests_total"
        assert wait_for(lambda: registry.get_sample_value(counted, labels) == 1.0)
        assert registry.get_sample_value(counted, {**labels, "status": "500"}) is None


# -- connections ----------------------------------------------------------------------------


def test_headers_that_do_not_arrive_in_time_are_408_and_a_silent_connection_is_closed(
    workers: FakeWorkers,
) -> None:
    with serving(make_core(workers), {"header_timeout_s": 0.2}) as server:
        with connect(server) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: arg")  # and no more
            answer = read_answer(sock)
            assert answer.status == 408 and answer.error()["code"] == "request_timeout"
            assert closed(sock)
        with connect(server) as silent:  # uvicorn never closed a connection that sent nothing
            assert silent.recv(1) == b""


def test_an_answer_nobody_reads_is_cut_after_the_write_deadline(workers: FakeWorkers) -> None:
    big = b"\x89PNG" + bytes(32 * 1024 * 1024)  # 43 MiB of base64: more than socket buffers

    def answer(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        return GenerateResult(request_id=call.request_id, png=big, level=call.level, worker_id="")

    workers.answers["w0:1"] = answer
    options = {"write_timeout_s": 0.2}
    with serving(make_core(workers), options) as server, connect(server) as sock:
        body = b'{"prompt": "a fox", "size": "64x64"}'
        sock.sendall(head(GENERATIONS, f"Content-Length: {len(body)}") + body)  # reads nothing
        connections = server._server.server_state.connections
        assert wait_for(lambda: workers.calls != [] and not connections)
        received = 0
        try:
            while more := sock.recv(1 << 20):
                received += len(more)
        except ConnectionResetError:
            pass
        assert received < len(big)  # cut: the rest was never sent


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"GARBAGE\r\n\r\n", 400, "illegal request line"),
        (head("/healthz", "Content-Length: abc", method="GET"), 400, "bad Content-Length"),
        (head("/healthz", "X-Pad: " + "a" * 20_000, method="GET"), 431, "larger than"),
        (head("/healthz", "X-Pad: " + "a" * (1 << 20), method="GET"), 431, "larger than"),
        (head(GENERATIONS, "Transfer-Encoding: gzip"), 501, "Transfer-Encoding"),
    ],
)
def test_requests_uvicorn_cannot_parse_are_answered_in_json(
    server: HttpServer, request_bytes: bytes, status: int, reason: str
) -> None:
    with connect(server) as sock:
        sock.sendall(request_bytes)
        answer = read_answer(sock)  # uvicorn answered 400 "Invalid HTTP request received."
        assert answer.status == status and reason in answer.error()["message"]
        assert answer.error()["code"] == "invalid_http_request" and closed(sock)


def test_connections_beyond_uvicorns_limit_are_503_in_json(workers: FakeWorkers) -> None:
    with serving(make_core(workers), {"max_connections": 2}) as server, connect(server) as first:
        first.sendall(head("/healthz", method="GET"))
        assert read_answer(first).status == 200  # kept alive: one of the two connections
        with connect(server) as second:
            second.sendall(head("/healthz", method="GET"))
            answer = read_answer(second)
            assert answer.status == 503 and answer.headers["retry-after"] == "1"
            assert answer.error()["code"] == "too_many_connections"


def test_the_bounds_are_set_so_that_argus_refuses_before_uvicorn(server: HttpServer) -> None:
    config = server._server.config
    assert config.limit_concurrency == http_server.MAX_CONNECTIONS
    assert http_app.MAX_REQUESTS < http_server.MAX_CONNECTIONS
    assert http_server.MAX_CONNECTIONS > 1000 and http_server.BACKLOG > 1000  # a burst of 1,000
    assert config.backlog == http_server.BACKLOG
    assert config.timeout_keep_alive == http_server.KEEP_ALIVE_S


# -- routes and fields ----------------------------------------------------------------------


def test_unknown_routes_and_methods_are_json_and_405_names_what_is_allowed(
    server: HttpServer,
) -> None:
    base = f"http://127.0.0.1:{server.port}"
    missing = httpx.get(f"{base}/v1/nothing", timeout=TIMEOUT)
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    wrong = httpx.get(f"{base}{GENERATIONS}", headers=AUTH, timeout=TIMEOUT)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert error_of(wrong)["code"] == "method_not_allowed"


@pytest.mark.parametrize("size", ["٦٤x٦٤", "６４x６４", "64x٦٤", "64x64\n"])
def test_size_takes_ascii_digits_only(server: HttpServer, size: str) -> None:
    answer = post(server, {"prompt": "a fox", "size": size})
    assert answer.status_code == 400 and error_of(answer)["param"] == "size"


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t \u3000"])
def test_an_empty_prompt_is_400_naming_prompt_before_the_core(
    workers: FakeWorkers, prompt: str
) -> None:
    registry = CollectorRegistry()
    with serving(make_core(workers, metrics=RouterMetrics(PROFILES, registry))) as server:
        answer = post(server, {"prompt": prompt})
    assert answer.status_code == 400
    error = error_of(answer)
    assert error["param"] == "prompt" and "empty" in error["message"]
    assert workers.calls == []
    refused = {"code": "INVALID_ARGUMENT"}  # the core counts every request it refused
    assert registry.get_sample_value("argus_router_requests_total", refused) is None


def test_401_carries_a_bearer_challenge(server: HttpServer) -> None:
    url = f"http://127.0.0.1:{server.port}/v1/models"
    missing = httpx.get(url, timeout=TIMEOUT)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="argus"'
    assert error_of(missing)["type"] == "authentication_error"
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=TIMEOUT)
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == 'Bearer realm="argus", error="invalid_token"'


# -- bursts ---------------------------------------------------------------------------------


def test_a_burst_beyond_the_core_bound_is_refused_429_while_the_admitted_are_held(
    workers: FakeWorkers,
) -> None:
    """300 requests at once on a core that serves 4: the 4 hold their worker until released;
    the other 296 are all answered before that, each Argus's 429 with Retry-After and JSON
    (before the fix, they waited for one of the 4 threads). The server's event loop is held
    while the burst arrives, as a busy loop would be, so that it reads all 300 in one turn."""
    hold = threading.Event()

    def held(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        hold.wait(TIMEOUT)
        return served(call, progress)

    workers.answers["w0:1"] = held
    core = make_core(workers, RouterServiceConfig(max_in_flight=4))
    burst, bound = 300, 4
    body = b'{"prompt": "a fox", "size": "64x64"}'
    request = head(GENERATIONS, f"Content-Length: {len(body)}") + body
    answers: list[Answer] = []
    with serving(core, threads=bound) as server, selectors.DefaultSelector() as ready:
        sockets = [connect(server) for _ in range(burst)]
        try:
            with holding_the_loop(server):
                for sock in sockets:
                    sock.sendall(request)
                    ready.register(sock, selectors.EVENT_READ)
            while len(answers) < burst - bound and ready.get_map():
                events = ready.select(TIMEOUT)
                if not events:
                    break  # the rest are held (or, before the fix, waiting for a thread)
                for key, _ in events:
                    ready.unregister(key.fileobj)
                    answers.append(read_answer(key.fileobj))
            answered_while_held = len(answers)
            hold.set()
            answers += [read_answer(key.fileobj) for key in ready.get_map().values()]
        finally:
            hold.set()
            for sock in sockets:
                sock.close()
    assert answered_while_held >= burst - bound
    refused = [a for a in answers if a.status != 200]
    assert len(answers) == burst and len(refused) >= burst - bound
    for answer in refused:
        assert answer.status == 429 and answer.headers["retry-after"] == "1"
        assert answer.error()["type"] == "rate_limit_error"


def test_requests_beyond_max_requests_are_429_before_their_body_and_health_still_answers(
    workers: FakeWorkers,
) -> None:
    with serving(make_core(workers), max_requests=2) as server:
        holders = [connect(server) for _ in range(2)]
        try:
            for sock in holders:  # two requests whose bodies never finish
                sock.sendall(head(GENERATIONS, "Content-Length: 100") + b"{")
            base = f"http://127.0.0.1:{server.port}"

            def refused() -> bool:
                return post(server, {"prompt": "a fox"}).status_code == 429

            assert wait_for(refused)
            answer = post(server, {"prompt": "a fox"})
            assert answer.headers["retry-after"] == "1"
            assert error_of(answer)["type"] == "rate_limit_error"
            assert httpx.get(f"{base}/healthz", timeout=TIMEOUT).status_code == 200
        finally:
            for sock in holders:
                sock.close()
        assert wait_for(lambda: post(server, {"prompt": "a fox"}).status_code == 200)
