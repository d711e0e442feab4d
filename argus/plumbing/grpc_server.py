"""What every Argus gRPC server has: a bounded thread pool, message size limits, standard health
checking, server reflection, requests parsed so that malformed bytes are the caller's error
(INVALID_ARGUMENT), a bind that fails loudly (no port sharing), and a clean stop on
SIGINT/SIGTERM; and what the public endpoint adds: TLS and bearer-token authentication. Clients
take their reconnect options from here. (The internal plane's mutual TLS and per-method roles
are :mod:`argus.plumbing.internal_tls`.)

The worker, ControlNet, allocator and router services build on these, so a probe, ``grpcurl``
or a Kubernetes gRPC health check sees the same things on each.
"""

from __future__ import annotations

import contextlib
import hmac
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def new_server(
    *,
    threads: int,
    thread_prefix: str,
    max_receive_bytes: int,
    max_send_bytes: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_concurrent_rpcs: int | None = None,
) -> grpc.Server:
    """A server (not started) on a pool of ``threads`` threads with the given message limits.

    ``max_concurrent_rpcs``: calls beyond this many at once are refused at once by gRPC with
    RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded!", no retry hint). Without it a server
    whose threads are all busy queues new calls without bound in front of its pool, where no
    admission sees them (under overload the router's clients waited 9-11 s there while each
    request spent 0.3 s inside it). gRPC counts a call from its arrival until its handler
    returns, calls queued for a thread included; a service that wants its own refusal to be
    the one clients see bounds its calls with :class:`InFlightLimit` well below this.

    ``interceptors`` run in order, outermost first; :class:`ParseRequests` comes last, so
    requests are parsed only once they passed authentication. Port reuse is off: gRPC sets
    SO_REUSEPORT by default, which lets a second process bind a taken port and take a share
    of its connections; without it that bind fails.
    """
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
        interceptors=[*interceptors, ParseRequests()],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )


class InvalidMessageError(ValueError):
    """Bytes that are not the method's request message (a streaming servicer that maps its
    own errors maps this one to INVALID_ARGUMENT)."""


class ParseRequests(grpc.ServerInterceptor):
    """Parses requests in the handler rather than in gRPC's deserializer, which answers
    malformed bytes with INTERNAL (a server fault): here they get INVALID_ARGUMENT naming
    the message type, and the server keeps serving. Handlers that take raw bytes already
    (no deserializer) are left alone."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = _parser(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(raw: bytes, context: grpc.ServicerContext) -> Any:
                return inner_uu(_parsed(parse, raw, context), context)

            return handler._replace(request_deserializer=None, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(raw: bytes, context: grpc.ServicerContext) -> Any:
                yield from inner_us(_parsed(parse, raw, context), context)

            return handler._replace(request_deserializer=None, unary_stream=unary_stream)

        def each(raws: Iterator[bytes]) -> Iterator[Any]:
            for raw in raws:
                yield parse(raw)

        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            def stream_stream(raws: Iterator[bytes], context: grpc.ServicerContext) -> Any:
                try:
                    yield from inner_ss(each(raws), context)
                except InvalidMessageError as err:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

            return handler._replace(request_deserializer=None, stream_stream=stream_stream)
        inner = handler.stream_unary

        def stream_unary(raws: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            try:
                return inner(each(raws), context)
            except InvalidMessageError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

        return handler._replace(request_deserializer=None, stream_unary=stream_unary)


class InFlightLimit(grpc.ServerInterceptor):
    """Runs at most ``limit`` calls of ``methods`` at once; a call beyond that is refused in
    its handler thread, before its request is parsed, with RESOURCE_EXHAUSTED, ``message``
    and the ``trailing`` metadata (a retry hint); ``on_refuse`` is called for each refusal
    (the service's metrics count it).

    This is the service's own bound, so it must bind before gRPC's ``max_concurrent_rpcs``
    does (whose refusal carries no hint and gRPC's words): give the server a pool of more
    than ``limit`` threads, so a refusal never waits behind a call being served, and a
    ``max_concurrent_rpcs`` well above the pool. A slot is taken when the handler starts and
    given back when it returns (a unary call) or its stream ends; calls still queued for a
    thread hold none. Other methods (health checks, reflection) pass unbounded, and so do
    request-streaming methods of ``methods`` (the router has none).
    """

    def __init__(
        self,
        limit: int,
        methods: Sequence[str],
        message: str,
        trailing: Sequence[tuple[str, str]] = (),
        on_refuse: Callable[[], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._methods = frozenset(methods)
        self._message = message
        self._trailing = tuple(trailing)
        self._on_refuse = on_refuse

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(details)
        if handler is None or details.method not in self._methods:
            return handler
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                self._enter(context)
                try:
                    return inner_uu(request, context)
                finally:
                    self._slots.release()

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                self._enter(context)
                try:
                    yield from inner_us(request, context)
                finally:  # the stream ended, failed, or was closed when its call ended
                    self._slots.release()

            return handler._replace(unary_stream=unary_stream)
        return handler

    def _enter(self, context: grpc.ServicerContext) -> None:
        """Take a slot, or refuse the call (``context.abort`` raises)."""
        if not self._slots.acquire(blocking=False):
            if self._on_refuse is not None:
                self._on_refuse()
            if self._trailing:
                context.set_trailing_metadata(self._trailing)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._message)


def _parser(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserialize`` raising :class:`InvalidMessageError` (naming the message type) on bad
    bytes. Generated code passes ``Message.FromString``, whose owner names the type."""
    owner = getattr(deserialize, "__self__", None)
    name = getattr(owner, "__name__", "request message")

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as err:
            raise InvalidMessageError(f"request: not a valid {name} ({err})") from None

    return parse


def _parsed(parse: Callable[[bytes], Any], raw: bytes, context: grpc.ServicerContext) -> Any:
    try:
        return parse(raw)
    except InvalidMessageError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


def add_health_and_reflection(
    server: grpc.Server, health_servicer: health.HealthServicer, services: Sequence[str]
) -> None:
    """Serve ``grpc.health.v1`` and reflection for ``services`` (full names) on ``server``."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*services, HEALTH_SERVICE)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)


def set_serving(health_servicer: health.HealthServicer, service: str, serving: bool) -> None:
    """Report ``service`` (and the server as a whole, name "") SERVING or NOT_SERVING."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", service):
        health_servicer.set(name, status)


def bind(
    server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Bind ``address``, with TLS when ``credentials`` are given; returns the port (useful with
    port 0). OSError naming the address if it fails, e.g. because another process holds the
    port (:func:`new_server` turns port sharing off)."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC's "Failed to bind", which names no cause
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {address}: the port is taken or the address is not local")
    return int(port)


def start_metrics(host: str, port: int) -> None:
    """Serve Prometheus ``/metrics`` on ``host:port``; OSError naming the port if it is taken."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host)
    except OSError as err:
        raise OSError(f"metrics port {host}:{port}: cannot bind ({err.strerror or err})") from None


def tls_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """Server TLS from a PEM certificate chain and its private key; OSError names a bad file."""
    with open(cert_path, "rb") as cert, open(key_path, "rb") as key:
        chain, private = cert.read(), key.read()
    if b"-----BEGIN" not in chain or b"-----BEGIN" not in private:
        raise OSError(f"{cert_path} / {key_path}: expected PEM certificate and key")
    return grpc.ssl_server_credentials([(private, chain)])


def read_token(path: str) -> str:
    """A bearer token from a file (surrounding whitespace dropped); OSError if empty."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise OSError(f"{path}: the token file is empty")
    return token


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without exactly one ``authorization: Bearer <token>`` with
    UNAUTHENTICATED.

    Health checks stay open (Kubernetes probes carry no credentials). Tokens are compared in
    constant time. A call with two ``authorization`` headers is refused even when one is
    right: proxies and servers disagree on which of several counts.
    """

    def __init__(self, token: str, open_services: Sequence[str] = (HEALTH_SERVICE,)) -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = tuple(f"/{name}/" for name in open_services)

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong token")

        self._deny: Any = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream: Any = grpc.stream_stream_rpc_method_handler(
            lambda requests, context: deny(None, context)
        )

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        if details.method.startswith(self._open):
            return continuation(details)
        given = [v for k, v in details.invocation_metadata if k == "authorization"]
        if len(given) == 1:
            value = given[0].encode() if isinstance(given[0], str) else given[0]
            if hmac.compare_digest(value, self._expected):
                return continuation(details)
        handler = continuation(details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny


def reconnect_options(max_reconnect_s: float = 2.0) -> list[tuple[str, int]]:
    """Client channel options: reconnect after at most ``max_reconnect_s`` (gRPC's default
    backoff grows to two minutes, far longer than a restarted peer takes to come back)."""
    ms = max(1, int(max_reconnect_s * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(ms, 500)),
        ("grpc.min_reconnect_backoff_ms", min(ms, 500)),
        ("grpc.max_reconnect_backoff_ms", ms),
        ("grpc.use_local_subchannel_pool", 1),  # its backoff is its own
    ]


@contextlib.contextmanager
def shutdown_signals() -> Iterator[threading.Event]:
    """For the block, SIGINT and SIGTERM set the yielded event (a service waits on it, then
    shuts down in order); the previous handlers come back afterwards."""
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_shutdown(ready: threading.Event | None = None) -> None:
    """Set ``ready`` and block until SIGINT or SIGTERM; returns with the default handlers back,
    so a second Ctrl-C during the caller's shutdown stops the process at once."""
    with shutdown_signals() as stop:
        if ready is not None:
            ready.set()
        stop.wait()


def check_port(value: int | None, name: str) -> None:
    """ValueError naming ``name`` unless ``value`` is None (off) or a port in 0..65535 (0: any
    free port)."""
    if value is not None and not 0 <= value < 65536:
        raise ValueError(f"{name}: {value} outside 0..65535")


def check_address(value: str, name: str) -> str:
    """``value`` if it is HOST:PORT with a port in 1..65535; else ValueError naming ``name``."""
    host, sep, port = value.rpartition(":")
    digits = port.isascii() and port.isdigit()  # str.isdigit alone takes "５" and "²"
    if not sep or not host.strip() or not digits or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected HOST:PORT with a port in 1..65535, got {value!r}")
    if any(c.isspace() for c in value):
        raise ValueError(f"{name}: expected HOST:PORT without spaces, got {value!r}")
    return value
