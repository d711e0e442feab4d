"""The router's OpenAI-compatible HTTP endpoint (``/v1/images/generations``, ``/v1/models``,
``/healthz``, ``/readyz``), served by uvicorn beside the gRPC port of the same process.

Requests go to the same :class:`~argus.router.core.RouterCore` as gRPC calls, from a thread
pool bounded by the core's ``max_in_flight``, so both share admission, the classifier and
the metrics. The body becomes the core's typed request directly (no protobuf on this path).
Each of ``n`` images is its own routed request (seeds ``seed``, ``seed + 1``, ...) and they
run concurrently.

Errors are OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}``; the core's
refusals map to HTTP as in :data:`HTTP_STATUS`. When some of ``n`` images fail and some are
served, the answer is 200 with the served images in ``data`` and an ``errors`` list (each with
the failed image's ``index`` and its error); when all fail, the answer is the first image's
error and status.

``"stream": true`` (one image) answers with server-sent events once the request is routed:
``argus.progress`` events (routed, queued with its position, running, each step of N,
decoding), an ``image_generation.partial_image`` event for each of the ``partial_images``
latent previews asked for, and last ``image_generation.completed`` with the image, in the
shapes of OpenAI's image stream events (Argus's fields added). A request refused before it
is routed gets the same status and error JSON as without ``stream``; a failure after that
ends the stream with an ``error`` event holding the error JSON.

A client that disconnects cancels its requests: the worker stops denoising at its next
step, and the router counts a CANCELLED request. An answer not yet begun (never sent) is
counted with HTTP status 499, as nginx counts a client that closed the connection; a stream
had begun with 200.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from argus.request_limits import InvalidRequestError, check_image
from argus.router.core import CallCancel, ProgressSink, RouterCore
from argus.router.values import (
    Adapter,
    AdapterKind,
    Progress,
    Refusal,
    RouterError,
    RouterReply,
    RouterRequest,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # the gRPC endpoint's bound on a request
MAX_IMAGES = 10  # OpenAI's bound on n
MAX_USER_CHARS = 256
SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")

# the core's refusal → (HTTP status, OpenAI error type); the others are 500
HTTP_STATUS: dict[Refusal, tuple[int, str]] = {
    Refusal.INVALID: (400, "invalid_request_error"),
    Refusal.UNAUTHENTICATED: (401, "authentication_error"),
    Refusal.ID_CONFLICT: (409, "invalid_request_error"),
    Refusal.OVERLOADED: (429, "rate_limit_error"),
    Refusal.FAILED: (502, "server_error"),  # a worker failed, or its answer was refused
    Refusal.UNAVAILABLE: (503, "server_error"),
    Refusal.DEADLINE: (504, "timeout_error"),
    Refusal.CANCELLED: (499, "cancelled"),  # the client went away; never sent
}
_ADAPTER_KINDS = {kind.value: kind for kind in AdapterKind}  # "lora", "controlnet"
_FIELDS = frozenset(
    {
        "prompt",
        "n",
        "size",
        "response_format",
        "user",
        "model",
        "seed",
        "steps",
        "negative_prompt",
        "guidance_scale",
        "deadline_ms",
        "max_level_index",
        "adapters",
        "stream",
        "partial_images",
    }
)
MAX_PREVIEWS = 1000  # one per step at most (steps are at most 1000)
_ROUTES = ("/v1/images/generations", "/v1/models", "/healthz", "/readyz")


class ApiError(Exception):
    """An answer other than 200: ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(param: str, message: str) -> ApiError:
    """400 naming ``param``; the message starts with it, as gRPC's details do."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_router_error(err: RouterError) -> ApiError:
    """The HTTP answer for a request the core refused or failed."""
    status, kind = HTTP_STATUS.get(err.kind, (500, "server_error"))
    param = None
    if err.kind is Refusal.INVALID:
        param = _param_of(err.details)
    retry = err.retry_after_s if status in (429, 503) else None
    return ApiError(status, err.details, kind, param, err.kind.status_name.lower(), retry)


def _param_of(details: str) -> str | None:
    """The body field an INVALID refusal names ("width: ..." → "size")."""
    head = details.split(":", 1)[0]
    if head.startswith(("width", "height")):
        return "size"
    if head.startswith("adapters"):
        return "adapters"
    return head if head in _FIELDS else None


# -- request body ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ImagesRequest:
    """A checked ``/v1/images/generations`` body: ``n`` router requests differing in seed."""

    template: RouterRequest  # with seed = the first image's
    n: int
    user: str | None
    stream: bool = False

    def requests(self) -> list[RouterRequest]:
        """One router request per image, seeds ``seed``, ``seed + 1``, ... (mod 2**64)."""
        seed = self.template.seed
        return [replace(self.template, seed=(seed + i) % 2**64) for i in range(self.n)]


def parse_images_request(body: Any, model_id: str, core: RouterCore) -> ImagesRequest:
    """Check a decoded JSON body; ApiError(400) names the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    for name in body:
        if name not in _FIELDS:
            raise invalid(name, f"unknown field; supported: {', '.join(sorted(_FIELDS))}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "required, a string")
    model = body.get("model")
    if model is not None and model != model_id:
        raise invalid("model", f"{model!r} is not served here; the served model is {model_id!r}")
    response_format = body.get("response_format")
    if response_format not in (None, "b64_json"):
        if response_format == "url":
            raise invalid("response_format", "'url' is not supported (no files are served)")
        raise invalid("response_format", f"{response_format!r}: only 'b64_json'")
    user = _optional(body, "user", str)
    if user is not None and len(user) > MAX_USER_CHARS:
        raise invalid("user", f"at most {MAX_USER_CHARS} characters")
    n = _int(body, "n", 1, MAX_IMAGES)
    negative_prompt = _optional(body, "negative_prompt", str) or ""
    size = _optional(body, "size", str)
    width, height = _size(size, core) if size is not None and size != "auto" else (None, None)
    seed = _int(body, "seed", 0, 2**64 - 1) or 0
    steps = _int(body, "steps", 1, 1000)
    deadline_ms = _int(body, "deadline_ms", 1, 2**32 - 1)
    max_level_index = _int(body, "max_level_index", 0, 2**31)
    guidance = _optional(body, "guidance_scale", (int, float))
    adapters = _adapters(body.get("adapters"))
    stream = bool(_optional(body, "stream", bool))
    previews = _int(body, "partial_images", 0, MAX_PREVIEWS)
    if previews and not stream:
        raise invalid("partial_images", 'previews are streamed: needs "stream": true')
    if stream and (n or 1) > 1:
        raise invalid("n", 'a stream carries one image: n must be 1 with "stream": true')
    template = RouterRequest(
        prompt=prompt,
        negative_prompt=negative_prompt,
        seed=seed,
        width=width,
        height=height,
        steps=steps,
        guidance_scale=None if guidance is None else float(guidance),
        adapters=adapters,
        deadline_ms=deadline_ms,
        max_level_index=max_level_index,
        previews=previews or 0,
    )
    return ImagesRequest(template, n or 1, user, stream)


def _optional(body: dict[str, Any], name: str, kind: Any) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else "a number"
        raise invalid(name, f"must be {expected}, got {type(value).__name__}")
    return value


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise invalid(name, f"{value} outside {low}..{high}")
    return value


def _size(size: str, core: RouterCore) -> tuple[int, int]:
    match = SIZE.fullmatch(size)
    if match is None:
        raise invalid("size", f"{size[:32]!r} is not WIDTHxHEIGHT (e.g. '512x512')")
    width, height = int(match[1]), int(match[2])
    try:
        check_image(width, height, core.config.limits)
    except InvalidRequestError as err:
        raise invalid("size", str(err)) from None
    return width, height


def _adapters(given: Any) -> tuple[Adapter, ...]:
    """``[{"kind": "lora"|"controlnet", "name", "scale", "control_image": base64 PNG}]``."""
    if given is None:
        return ()
    if not isinstance(given, list):
        raise invalid("adapters", "must be a list")
    out = []
    for i, item in enumerate(given):
        where = f"adapters[{i}]"
        if not isinstance(item, dict) or item.get("kind") not in _ADAPTER_KINDS:
            raise invalid(where, "needs kind 'lora' or 'controlnet' and a name")
        name, scale, image = item.get("name"), item.get("scale", 1.0), item.get("control_image")
        if not isinstance(name, str) or not name:
            raise invalid(where, "name: a non-empty string")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise invalid(where, "scale: a number")
        control = b""
        if image is not None:
            try:
                control = base64.b64decode(image, validate=True)
            except (TypeError, ValueError):
                raise invalid(where, "control_image: base64 PNG") from None
        out.append(Adapter(_ADAPTER_KINDS[item["kind"]], name, float(scale), control))
    return tuple(out)


# -- responses ------------------------------------------------------------------------------


def image_entry(reply: RouterReply) -> dict[str, Any]:
    """One ``data`` item: the PNG and where and how fast it was made (the worker's timing
    without its zero entries, as protobuf's JSON mapping wrote it before the reply was
    typed)."""
    timing = reply.timing
    return {
        "b64_json": base64.b64encode(reply.png).decode("ascii"),
        "revised_prompt": None,
        "level": reply.level,
        "level_index": reply.level_index,
        "classified_level": reply.classified_level,
        "worker_id": reply.worker_id,
        "plan_version": reply.plan_version,
        "timing": {
            "classify_ms": timing.classify_ms,
            "route_ms": timing.route_ms,
            "forward_ms": timing.forward_ms,
            "total_ms": timing.total_ms,
            "attempts": timing.attempts,
            "worker": {name: ms for name, ms in asdict(timing.worker).items() if ms},
        },
    }


def models_body(core: RouterCore, model_id: str) -> dict[str, Any]:
    levels = [
        {"name": level.name, "strategy": level.strategy.value, "quality": level.quality}
        for level in core.profiles.levels
    ]
    model = {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "argus",
        "levels": levels,
    }
    return {"object": "list", "data": [model]}


# -- the application ------------------------------------------------------------------------


def create_app(
    core: RouterCore,
    *,
    token: str | None = None,
    model_id: str = "argus",
    max_body_bytes: int = MAX_BODY_BYTES,
    threads: int | None = None,
) -> Starlette:
    """The Starlette app; every answer is counted in the core's metrics by route and status.

    ``threads`` bounds the core calls at once (default: the core's ``max_in_flight`` + 16, as
    the gRPC server's threads, so that the core's own in-flight bound refuses first); an image
    arriving when every thread is busy is refused at once (429), as gRPC refuses calls beyond
    its threads, rather than queued where no deadline is watched.
    """
    limiter = anyio.CapacityLimiter(threads or core.config.max_in_flight + 16)
    expected = None if token is None else f"Bearer {token}".encode()

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.getlist("authorization")
        if len(given) != 1 or not hmac.compare_digest(given[0].encode(), expected):
            raise ApiError(
                401, "authorization: missing or wrong bearer token", "authentication_error"
            )

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"body: larger than {max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise ApiError(413, f"body: larger than {max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"body: not valid JSON ({err})") from None

    async def generate_one(
        request: RouterRequest, cancel: CallCancel, progress: ProgressSink | None = None
    ) -> RouterReply:
        if limiter.available_tokens < 1:
            raise RouterError(Refusal.OVERLOADED, "router busy", 1.0)
        run = functools.partial(core.generate, request, progress=progress, cancel=cancel)
        return await anyio.to_thread.run_sync(run, limiter=limiter)

    async def generations(request: Request) -> Response:
        authorize(request)
        parsed = parse_images_request(await read_json(request), model_id, core)
        log.info("http images: n=%d user=%r stream=%s", parsed.n, parsed.user, parsed.stream)
        requests = parsed.requests()
        cancels = [CallCancel() for _ in requests]
        if parsed.stream:
            return _ImageStream(
                functools.partial(generate_one, requests[0], cancels[0]), cancels[0], requests[0]
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
        return ApiError(exc.status_code, str(exc.detail), code="not_found").response()

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("http %s failed", request.url.path)
        return ApiError(500, "internal error", "server_error").response()

    app = Starlette(
        routes=[
            Route("/v1/images/generations", generations, methods=["POST"]),
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
    if core.metrics is not None:
        app.add_middleware(_CountMiddleware, observe=core.metrics.observe_http)
    return app


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
    answer is 200 and events follow until ``image_generation.completed`` or an ``error``
    event. A disconnect cancels the request (see the module's docstring)."""

    def __init__(
        self,
        start: Callable[[ProgressSink], Awaitable[RouterReply]],
        cancel: CallCancel,
        request: RouterRequest,
    ) -> None:
        super().__init__(media_type="text/event-stream")
        self._start = start
        self._cancel = cancel
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
            completed = {"type": "image_generation.completed", "created_at": created}
            return _sse_event(
                "image_generation.completed", {**completed, **self._shape, **entry, "usage": usage}
            )
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
            partial = {
                "type": "image_generation.partial_image",
                "created_at": created,
                "b64_json": base64.b64encode(event.preview_png).decode("ascii"),
                "partial_image_index": self._previews,
                **self._shape,
                "step": event.step,
                "total_steps": event.total_steps,
            }
            self._previews += 1
            out += _sse_event("image_generation.partial_image", partial)
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


# -- the server -----------------------------------------------------------------------------


class HttpServer:
    """uvicorn on a socket bound by ``bind_socket`` (so a taken port fails at once, naming it),
    serving in its own thread until ``stop``; HTTPS when given ``tls`` (certificate and key PEM
    files: the gRPC endpoint's)."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]] | Starlette,
        host: str,
        port: int,
        *,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.host = host
        self._socket = bind_socket(host, port)
        self.port: int = self._socket.getsockname()[1]
        self.scheme = "http" if tls is None else "https"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
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
    """A listening TCP socket on ``host:port`` (0: a free port); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise OSError(f"--http-port: cannot bind {host}:{port} ({err.strerror})") from None
    sock.set_inheritable(True)
    return sock
