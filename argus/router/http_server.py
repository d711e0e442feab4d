"""Serving the router's HTTP app: uvicorn on a socket bound here (:class:`HttpServer`), with
its h11 protocol hardened (:class:`ArgusH11Protocol`).

The protocol bounds what a client can make a connection hold (the constants below say how
much and why): the time its request line and headers may take (408), the time an answer may
wait for a client that reads none of it (the connection is cut), idle keep-alive connections
(closed after :data:`KEEP_ALIVE_S`) and connections at once (:data:`MAX_CONNECTIONS`, uvicorn's
``limit_concurrency``, set above the app's own request bound so that under a burst Argus's 429
is the refusal clients see).

uvicorn answers some requests itself, before the app sees them; here those answers are
OpenAI's error JSON too (:class:`~argus.router.openai_wire.ApiError`): a request h11 cannot
parse (400: a bad request line, a bad ``Content-Length``; 431: request line and headers over
:data:`MAX_HEAD_BYTES`; 501: a transfer coding other than chunked), headers that do not arrive
in time (408) and more connections than ``limit_concurrency`` (503 with ``Retry-After``). These
protocol answers close the connection and are not counted in the HTTP metrics (no route was
reached). A chunk's declared size is told to the app (:data:`DECLARED_CHUNK`), so that a body
declared too large is refused when the chunk's header arrives.

A connection closed while its client may still be sending (an answer given before the body
was read) lingers up to :data:`LINGER_S` (:class:`_LingeringTransport`): half-closed, the rest
of the body read and dropped, so that the answer is not lost to a reset. Still answered
without a body: a TLS handshake that fails or outlasts asyncio's handshake timeout (the
connection is closed), and a client that closes the connection first.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from argus.router.openai_wire import CLOSE, ApiError

log = logging.getLogger(__name__)

# Request line and headers, h11's default (set explicitly); more is answered 431.
MAX_HEAD_BYTES = 16 * 1024
# Request line and headers must arrive within this of the connection opening or of the
# previous answer on it (slowloris sending a header byte at a time); 408, or a silent close
# for a connection that sent nothing.
HEADER_TIMEOUT_S = 10.0
# A connection idle between requests is closed after this (uvicorn's timeout_keep_alive,
# its default, set explicitly).
KEEP_ALIVE_S = 5
# A client that stops reading an answer (the socket's buffers full, and the transport's past
# its high-water mark and not drained to its low one) for this long has its connection cut,
# which ends the answer; a client that never reads would otherwise hold it forever.
WRITE_TIMEOUT_S = 30.0
# A connection closed while its client may still be sending (an answer given before the body
# was read: 413, 429, 401) is half-closed first and what still arrives is read and dropped for
# up to this long: closing a socket with unread data resets it, and a reset can destroy the
# answer before the client has read it (a lingering close, as nginx's lingering_timeout).
LINGER_S = 2.0
# uvicorn's limit_concurrency (connections, or requests, at once): above the app's MAX_REQUESTS and
# a burst of 1,000 connections, so that Argus's 429 is the refusal clients see; past it the
# protocol answers 503 JSON.
MAX_CONNECTIONS = 2048
# listen() backlog: a burst of connections waits in the kernel's queue rather than losing SYNs
# (a client retries a dropped SYN only after 1, 3, 7 s...). Set on the socket bound here and
# in uvicorn's Config (its default), which asyncio applies again when serving starts; the
# socket's former 128 only held until then. (The kernel caps it at net.core.somaxconn.)
BACKLOG = 2048
DECLARED_CHUNK = "argus.declared_chunk_bytes"  # scope key: what the protocol tells the app


class _Connection(h11.Connection):
    """h11's server side, remembering the error that broke a request (uvicorn's protocol drops
    h11's reason and its status hint, and answers every such error with the same text)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as err:
            self.error = err
            raise


class _LingeringTransport:
    """The connection's transport as uvicorn's protocol sees it, whose :meth:`close` lingers:
    the answer is flushed and the write side shut (FIN, not a reset), and the connection stays
    open, dropping whatever the client still sends, until the client closes its side or
    ``linger_s`` passes. Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, linger_s: float) -> None:
        self._transport = transport
        self._linger_s = linger_s
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        transport = self._transport
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        self.lingering = True
        transport.write_eof()  # after what is buffered: the answer arrives whole
        transport.resume_reading()  # a body the app left unread may have paused it
        self._timer = asyncio.get_running_loop().call_later(self._linger_s, self.release)

    def abort(self) -> None:
        self.release(abort=True)

    def release(self, abort: bool = False) -> None:
        """Ends the linger: close (or abort) the transport now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if abort:
            self._transport.abort()
        elif not self._transport.is_closing():
            self._transport.close()


class ArgusH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines uvicorn lacks and OpenAI's error JSON where
    uvicorn answers in text (the module's docstring lists those answers).

    Deadlines: a connection's request line and headers within ``header_timeout_s`` of its
    opening or of its previous answer (the timer is checked when it fires: a request being
    answered is left to the app's body deadline and the core's deadlines); an answer the client
    reads none of for ``write_timeout_s`` cuts the connection. A chunk's declared size is told
    to the app through the request's scope, so that a chunk of 0xffffffffffffffff bytes is
    refused (413) when its header arrives rather than waited for: h11 accepts any size and
    delivers the data as it comes, and without this the request would last until the body
    deadline. ``HttpServer`` subclasses it to set the timeouts.
    """

    header_timeout_s: float = HEADER_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, config.h11_max_incomplete_event_size or MAX_HEAD_BYTES)
        self._connection_limit = self.limit_concurrency
        self.limit_concurrency = None  # checked by _bounded instead, which answers JSON
        self._app = self.app
        self.app = self._bounded
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # uvicorn's own answers, as JSON ------------------------------------------------------

    async def _bounded(self, scope: Any, receive: Any, send: Any) -> None:
        """uvicorn's ``limit_concurrency`` check (503 beyond it), answering JSON. This
        request's task is already among ``tasks`` (uvicorn checks before adding it)."""
        limit = self._connection_limit
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) > limit):
            refusal = ApiError(
                503,
                f"server busy: {limit} connections or requests at once",
                "server_error",
                code="too_many_connections",
                retry_after_s=1.0,
                headers=CLOSE,
            )
            await refusal.response()(scope, receive, send)
            return
        await self._app(scope, receive, send)

    def send_400_response(self, msg: str) -> None:
        """A request h11 could not parse: h11's status hint (400, 431, 501) and reason."""
        error = self.conn.error if isinstance(self.conn, _Connection) else None
        status = 400 if error is None else error.error_status_hint
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # broken inside a body
            cycle.disconnected = True  # the app sees a disconnect; its answer is dropped
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        reason = msg if error is None else str(error)
        if status == 431:  # h11's reason is "Receive buffer too long"
            reason = f"request line and headers larger than {MAX_HEAD_BYTES} bytes"
        self._answer(ApiError(status, f"request: {reason}", code="invalid_http_request"))

    def _answer(self, error: ApiError) -> None:
        """Write ``error`` as the connection's last answer, and close it."""
        if not self.transport.is_closing():
            self.transport.write(error.raw())
            self.transport.close()

    # the header deadline -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _LingeringTransport(transport, LINGER_S)
        super().connection_made(cast(asyncio.Transport, self._lingering))
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if not self._lingering.lingering:  # else: the rest of a body no answer needs
            super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering.lingering:  # the client has sent all it will: close now
            self._lingering.release()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lingering.release()  # the transport is gone: only the timer is left
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._write_timer = None
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        """No request came in time: 408 when part of one came, else close without a word."""
        self._head_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or (cycle is not None and not cycle.response_complete):
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            late = f"request line and headers not received within {self.header_timeout_s:g} s"
            self._answer(ApiError(408, f"request: {late}", code="request_timeout"))
        else:  # idle, or still sending a body the answer did not need
            self.transport.close()

    # the write deadline ------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_late(self) -> None:
        self._write_timer = None
        log.info(
            "http: a client read nothing for %g s; its connection is cut", self.write_timeout_s
        )
        self.transport.abort()

    # a chunk's declared size -------------------------------------------------------------

    def handle_events(self) -> None:
        super().handle_events()
        self._tell_declared_chunk()

    def _tell_declared_chunk(self) -> None:
        """Put in the request's scope how many bytes of the current chunk are still to come, as
        its header declared them, and wake the app when that grew (a new chunk's header), so
        that it refuses a body declared too large before waiting for it. The count is h11's
        chunked reader's (not public: where a later h11 lacks it, the app's body deadline
        still ends the request)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.conn.their_state is not h11.SEND_BODY:
            return
        remaining = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
        scope = cast(dict[str, Any], cycle.scope)
        if not isinstance(remaining, int) or remaining == scope.get(DECLARED_CHUNK, 0):
            return
        grew = remaining > scope.get(DECLARED_CHUNK, 0)
        scope[DECLARED_CHUNK] = remaining
        if grew:
            cycle.message_event.set()


class HttpServer:
    """uvicorn on a socket bound by ``bind_socket`` (so a taken port fails at once, naming it),
    serving in its own thread until ``stop``; HTTPS when given ``tls`` (certificate and key PEM
    files: the gRPC endpoint's). The protocol is :class:`ArgusH11Protocol` with the given
    timeouts; ``max_connections`` is uvicorn's ``limit_concurrency`` (see the constants)."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]] | Starlette,
        host: str,
        port: int,
        *,
        tls: tuple[str, str] | None = None,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        keep_alive_s: int = KEEP_ALIVE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self._socket = bind_socket(host, port)
        self.port: int = self._socket.getsockname()[1]
        self.scheme = "http" if tls is None else "https"

        class Protocol(ArgusH11Protocol):
            pass

        Protocol.header_timeout_s = header_timeout_s
        Protocol.write_timeout_s = write_timeout_s
        config = uvicorn.Config(
            app,
            http=Protocol,
            ws="none",  # no WebSocket routes: an upgrade request is served as plain HTTP
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=keep_alive_s,
            limit_concurrency=max_connections,
            backlog=BACKLOG,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            ssl_certfile=None if tls is None else tls[0],
            ssl_keyfile=None if tls is None else tls[1],
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="router-http", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve in the background; returns once uvicorn accepts connections."""
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"http server on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close()

    def _run(self) -> None:
        self._server.run(sockets=[self._socket])


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port) with a ``BACKLOG`` queue;
    OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        raise OSError(f"--http-port: cannot bind {host}:{port} ({err.strerror})") from None
    sock.set_inheritable(True)
    return sock
