"""The router's OpenAI-compatible HTTP app (Starlette): ``/v1/images/generations``,
``/v1/images/edits``, ``/v1/models``, ``/healthz``, ``/readyz`` on the same
:class:`~argus.router.core.RouterCore` as the gRPC port of the process (:func:`create_app`).

Requests run on the core from a thread pool bounded by the core's ``max_in_flight``, so gRPC
and HTTP share admission, the classifier and the metrics. Each of ``n`` images is its own
routed request and they run concurrently. When some fail and some are served, the answer is
200 with the served images in ``data`` and an ``errors`` list (each with the failed image's
``index`` and its error); when all fail, it is the first image's error and status. What the
bodies look like and how they are checked is :mod:`argus.router.openai_wire`'s.

``"stream": true`` (one image) answers with server-sent events once the request is routed
(:class:`_ImageStream`): ``argus.progress`` events (routed, queued with its position,
running, each step of N, decoding), an ``image_generation.partial_image`` event for each of
the ``partial_images`` latent previews asked for, and last ``image_generation.completed`` with
the image, in the shapes of OpenAI's image stream events (Argus's fields added; an edit's are
named ``image_edit.*``). A request refused before it is routed gets the same status and error
JSON as without ``stream``; a failure after that ends the stream with an ``error`` event.

A client that disconnects cancels its requests: the worker stops denoising at its next step
and the router counts a CANCELLED request; an answer not yet begun is counted with HTTP status
499 (nginx's count of a client that closed the connection), a stream already begun with 200.

The app bounds what a client can make it hold: the body's size (413, in bytes before it is
parsed) and the time it may take (408, :data:`BODY_TIMEOUT_S`), and requests twice, each
refused at once on the event loop with Argus's 429 and ``Retry-After``, never queued:
``max_requests`` HTTP requests in the app (the health routes aside) and image requests in the
core (``threads``). Every answer is OpenAI's error JSON, 404 and 405 included, and counted in
the core's metrics by route and status. How connections are served (the protocol's own
answers and deadlines) is :mod:`argus.router.http_server`'s.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from argus.contracts.generate import Progress
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterReply, RouterRequest
from argus.router.core import CallCancel, RouterCore
from argus.router.http_server import DECLARED_CHUNK, MAX_HEAD_BYTES
from argus.router.openai_wire import (
    CLOSE,
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    ApiError,
    ImagesRequest,
    decode_json,
    from_router_error,
    image_entry,
    models_body,
    parse_edit_request,
    parse_form,
    parse_images_request,
    too_large,
)
from argus.router.values import Refusal, RouterError

log = logging.getLogger(__name__)

# The whole body must arrive within this of the headers (8 MiB needs about 280 KB/s); 408.
BODY_TIMEOUT_S = 30.0
# HTTP requests the app answers at once (the health routes aside); more are refused with 429
# before their body is read. It bounds the bodies held in memory (512 × 8 MiB at most).
MAX_REQUESTS = 512
_HEALTH = frozenset({"/healthz", "/readyz"})  # served beyond MAX_REQUESTS (health is its own path)
_ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/models", "/healthz", "/readyz")


async def read_body(request: Request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The request's body: 413 above ``max_body_bytes`` (as declared by Content-Length, or by
    a chunk's size as the protocol reports it, or as counted), 408 when it has not all come
    within ``timeout_s``, 499 when the client closed the connection first. Refusals before
    the whole body was read close the connection (its rest is not read)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large(max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout_s):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ApiError(499, "body: the client closed the connection", "cancelled", "body")
            chunk = message.get("body", b"")
            size += len(chunk)
            # the protocol sets the scope's key when a chunk's header declares its size
            if size + request.scope.get(DECLARED_CHUNK, 0) > max_body_bytes:
                raise too_large(max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(
        408,
        f"body: not received within {timeout_s:g} s",
        param="body",
        code="request_timeout",
        headers=CLOSE,
    )


def create_app(
    core: RouterCore,
    *,
    token: str | None = None,
    model_id: str = "argus",
    max_body_bytes: int = MAX_BODY_BYTES,
    threads: int | None = None,
    max_requests: int = MAX_REQUESTS,
    body_timeout_s: float = BODY_TIMEOUT_S,
    max_json_depth: int = MAX_JSON_DEPTH,
) -> Starlette:
    """The Starlette app; every answer is counted in the core's metrics by route and status.

    ``threads`` bounds the core calls at once (default: the core's ``max_in_flight`` + 16, as
    the gRPC server's threads, so that the core's own in-flight bound refuses first); an image
    arriving when every thread is busy is refused at once on the event loop (429), as gRPC
    refuses calls beyond its threads, rather than queued where no deadline is watched.
    ``max_requests`` bounds the HTTP requests in the app at once, refused (429) before their
    body is read; ``body_timeout_s`` and ``max_json_depth`` bound the body (see the
    constants).
    """
    slots = _CoreSlots(threads or core.config.max_in_flight + 16)
    expected = None if token is None else f"Bearer {token}".encode()

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.getlist("authorization")
        if len(given) != 1 or not hmac.compare_digest(given[0].encode(), expected):
            # RFC 6750: the scheme and realm; error="invalid_token" only when a token came
            challenge = 'Bearer realm="argus"' + (', error="invalid_token"' if given else "")
            raise ApiError(
                401,
                "authorization: missing or wrong bearer token",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": challenge},
            )

    async def read_json(request: Request) -> Any:
        return decode_json(await read_body(request, max_body_bytes, body_timeout_s), max_json_depth)

    async def generate_one(
        request: RouterRequest, cancel: CallCancel, progress: ProgressSink | None = None
    ) -> RouterReply:
        run = functools.partial(core.generate, request, progress=progress, cancel=cancel)
        return await slots.run(run)

    async def generations(request: Request) -> Response:
        authorize(request)
        parsed = parse_images_request(await read_json(request), model_id, core)
        log.info("http images: n=%d user=%r stream=%s", parsed.n, parsed.user, parsed.stream)
        return await answer(request, parsed, "image_generation")

    async def edits(request: Request) -> Response:
        authorize(request)
        body = await read_body(request, max_body_bytes, body_timeout_s)
        parsed = parse_edit_request(await parse_form(body, request.headers), model_id, core)
        log.info("http edits: n=%d user=%r stream=%s", parsed.n, parsed.user, parsed.stream)
        return await answer(request, parsed, "image_edit")

    async def answer(request: Request, parsed: ImagesRequest, events: str) -> Response:
        """Serve ``parsed``'s images: a stream whose events are named ``events``.*, or one
        JSON answer."""
        requests = parsed.requests()
        cancels = [CallCancel() for _ in requests]
        if parsed.stream:
            return _ImageStream(
                functools.partial(generate_one, requests[0], cancels[0]),
                cancels[0],
                requests[0],
                events,
            )
        results: list[Any] = [None] * len(requests)

        async def run(i: int) -> None:
            try:
                results[i] = await generate_one(requests[i], cancels[i])
            except RouterError as err:
                results[i] = from_router_error(err)

        async with anyio.create_task_group() as watching:
            watching.start_soon(_cancel_on_disconnect, request.receive, cancels)
            async with anyio.create_task_group() as group:
                for i in range(len(requests)):
                    group.start_soon(run, i)
            watching.cancel_scope.cancel()
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, ApiError)]
        if len(failed) == len(results):
            raise failed[0][1]
        body: dict[str, Any] = {
            "created": int(time.time()),
            "data": [image_entry(r) for r in results if not isinstance(r, ApiError)],
        }
        if failed:
            body["errors"] = [{"index": i, "status": e.status, **e.body()} for i, e in failed]
        return JSONResponse(body)

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse(models_body(core, model_id))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        if core.can_serve():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no plan with a worker yet"}, status_code=503)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return starlette_error(request, exc).response()

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("http %s failed", request.url.path)
        return ApiError(500, "internal error", "server_error").response()

    app = Starlette(
        routes=[
            Route("/v1/images/generations", generations, methods=["POST"]),
            Route("/v1/images/edits", edits, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
    app.add_middleware(_Admission, limit=max_requests)
    # added last, so outermost: it counts the bound's refusals
    app.add_middleware(_CountMiddleware, observe=core.stats.http_answered)
    return app


def starlette_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's own refusals (no such route, a method the route does not take) as OpenAI's
    error, keeping their headers (``Allow`` on 405)."""
    path = request.url.path[:200]
    if exc.status_code == 404:
        message, code = f"path: no route {path}; routes: {', '.join(_ROUTES)}", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method: {request.method[:16]} not allowed on {path}; allowed: {allowed}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), "_".join(str(exc.detail).lower().split())
    return ApiError(exc.status_code, message, code=code, headers=exc.headers)


class _CoreSlots:
    """Core calls from the HTTP transport running at once, counted on the event loop: one
    beyond ``limit`` is refused at once (429) instead of waiting for a thread.

    The count is taken before any await. (anyio's ``to_thread.run_sync`` yields to the loop
    before it takes its limiter's token, so a check of the limiter's free tokens let a burst
    read in one turn of the loop pass it whole and then queue for threads: each refusal waited
    for a thread to come free, and none came while every thread held a request in service.)
    Each call holds one of ``limit`` threads, so the thread limiter never makes a call wait."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.busy = 0
        self._threads = anyio.CapacityLimiter(limit)

    async def run(self, call: Callable[[], RouterReply]) -> RouterReply:
        if self.busy >= self.limit:
            raise RouterError(
                Refusal.OVERLOADED, f"router busy: {self.limit} HTTP requests in the core", 1.0
            )
        self.busy += 1
        try:
            return await anyio.to_thread.run_sync(call, limiter=self._threads)
        finally:
            self.busy -= 1


class _Admission:
    """What every request passes before its route: a request line and headers of at most
    ``MAX_HEAD_BYTES`` (431: h11 checks only a head still incomplete when a read ends, so a
    larger one arriving whole would pass it), and at most ``limit`` requests being answered
    at once (429 with ``Retry-After``, on the event loop and before the body is read). The
    health routes are not counted nor refused by the limit (their answers are cheap, and a
    busy router is still alive)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.answering = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope["query_string"])
        head += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if head > MAX_HEAD_BYTES:
            large = f"request line and headers larger than {MAX_HEAD_BYTES} bytes"
            refusal = ApiError(431, f"request: {large}", code="invalid_http_request", headers=CLOSE)
            await refusal.response()(scope, receive, send)
            return
        if scope["path"] in _HEALTH:
            await self.app(scope, receive, send)
            return
        if self.answering >= self.limit:
            busy = ApiError(
                429,
                f"router busy: {self.limit} HTTP requests being answered",
                "rate_limit_error",
                code="overloaded",
                retry_after_s=1.0,
            )
            await busy.response()(scope, receive, send)
            return
        self.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.answering -= 1


async def _cancel_on_disconnect(receive: Any, cancels: list[CallCancel]) -> None:
    """Cancel the requests of an answer whose client disconnected (the body was read, so the
    next ASGI message is the disconnect, if any comes before the answer)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for cancel in cancels:
        cancel.cancel()


class _ImageStream(Response):
    """The answer to ``"stream": true``: the router request's progress as server-sent events.

    The status waits for the first event: a request refused before it was routed is answered
    as without a stream (its status and error JSON, ``Retry-After`` on 429); once routed the
    answer is 200 and events follow until ``<events>.completed`` or an ``error`` event
    (``events``: ``image_generation``, or ``image_edit`` for an edit, as OpenAI names each
    stream's events). A disconnect cancels the request (see the module's docstring)."""

    def __init__(
        self,
        start: Callable[[ProgressSink], Awaitable[RouterReply]],
        cancel: CallCancel,
        request: RouterRequest,
        events: str = "image_generation",
    ) -> None:
        super().__init__(media_type="text/event-stream")
        self._start = start
        self._cancel = cancel
        self._events = events
        size = "auto" if request.width is None else f"{request.width}x{request.height}"
        self._shape = {"size": size, "output_format": "png", "background": "auto"}
        self._shape["quality"] = "auto"
        self._previews = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        events_in, events = anyio.create_memory_object_stream[Any](math.inf)

        def sink(event: Progress) -> None:  # on the core's thread
            # once the answer is over the stream is closed; the cancel stops the request
            with contextlib.suppress(
                anyio.ClosedResourceError, anyio.BrokenResourceError, RuntimeError
            ):
                anyio.from_thread.run_sync(events_in.send_nowait, event)

        async def produce() -> None:
            async with events_in:
                reply: RouterReply | ApiError
                try:
                    reply = await self._start(sink)
                except RouterError as err:
                    reply = from_router_error(err)
                await events_in.send(reply)

        async def watch() -> None:
            await _cancel_on_disconnect(receive, [self._cancel])
            group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(produce)
            group.start_soon(watch)
            started = False
            async with events:
                async for event in events:
                    if isinstance(event, ApiError) and not started:
                        await event.response()(scope, receive, send)
                        break
                    if not started:
                        started = True
                        await send(
                            {
                                "type": "http.response.start",
                                "status": 200,
                                "headers": [
                                    (b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-store"),
                                ],
                            }
                        )
                    await send(
                        {"type": "http.response.body", "body": self._sse(event), "more_body": True}
                    )
                    if not isinstance(event, Progress):
                        break
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()  # the watcher; produce has finished

    def _sse(self, event: Any) -> bytes:
        """One event (or two: a step with a preview adds its partial image)."""
        created = int(time.time())
        if isinstance(event, ApiError):
            return _sse_event("error", event.body())
        if not isinstance(event, Progress):
            entry = image_entry(event)
            entry.pop("revised_prompt")
            usage: dict[str, Any] = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
            usage["input_tokens_details"] = {"image_tokens": 0, "text_tokens": 0}
            name = f"{self._events}.completed"
            completed = {"type": name, "created_at": created}
            return _sse_event(name, {**completed, **self._shape, **entry, "usage": usage})
        progress = {
            "type": "argus.progress",
            "stage": event.stage.value,
            "step": event.step,
            "total_steps": event.total_steps,
            "queue_position": event.queue_position,
            "level": event.level,
            "worker_id": event.worker_id,
            "elapsed_ms": event.elapsed_ms,
        }
        out = _sse_event("argus.progress", progress)
        if event.preview_png:
            name = f"{self._events}.partial_image"
            partial = {
                "type": name,
                "created_at": created,
                "b64_json": base64.b64encode(event.preview_png).decode("ascii"),
                "partial_image_index": self._previews,
                **self._shape,
                "step": event.step,
                "total_steps": event.total_steps,
            }
            self._previews += 1
            out += _sse_event(name, partial)
        return out


def _sse_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class _CountMiddleware:
    """Counts every HTTP answer by route (a fixed set; "other" for the rest) and status."""

    def __init__(self, app: Any, observe: Callable[[str, int], None]) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _ROUTES else "other"
        counted = False

        async def counting(message: Any) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True  # before the answer leaves, so a client sees it counted
                self.observe(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            if not counted:
                self.observe(route, 500)
