"""The router's OpenAI-compatible HTTP endpoint (``/v1/images/generations``,
``/v1/images/edits``, ``/v1/models``, ``/healthz``, ``/readyz``), served by uvicorn beside the
gRPC port of the same process.

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

``/v1/images/edits`` takes OpenAI's multipart form: ``image`` (PNG, JPEG or WebP), ``mask``
(a PNG of its size whose fully transparent pixels are edited; without it, the image's own
alpha), ``prompt`` and the generation's other fields as form values, plus ``strength``
(img2img, without a mask); no adapters. The body is bounded as the JSON body is, in bytes
before it is parsed (:func:`parse_form`), and each edit is served as a generation is (the
same ``n``, stream and errors), its stream's events named ``image_edit.partial_image`` and
``image_edit.completed`` as OpenAI names them. The image and mask are checked by the core
(:func:`~argus.request_limits.check_edit`), so a bad one is a 400 naming ``image``, ``mask``
or ``strength``, as over gRPC.

A client that disconnects cancels its requests: the worker stops denoising at its next
step, and the router counts a CANCELLED request. An answer not yet begun (never sent) is
counted with HTTP status 499, as nginx counts a client that closed the connection; a stream
had begun with 200.

The front door bounds what a client can make it hold (the constants below say how much and
why): the body's size (413) and its arrays and objects, how many and how deep (400, checked
on the bytes before they are parsed), the time its request line and headers (408, by the
protocol) and its body (408, by the app) may take, the time an answer may wait for a client
that reads none of it (the connection is cut), and idle keep-alive connections (closed after
``KEEP_ALIVE_S``). Requests are bounded
twice, each refused at once on the event loop with Argus's 429 and ``Retry-After``, never
queued: ``max_requests`` HTTP requests in the app (the health routes aside), and image
requests in the core (``threads``). uvicorn's own ``limit_concurrency`` is set above both, so
that under a burst Argus refuses first.

Every answer is OpenAI's error JSON, 404 and 405 included. uvicorn answers some requests
itself, before the app sees them; its h11 protocol is subclassed here
(:class:`ArgusH11Protocol`) so that those answers are the same JSON too: a request h11 cannot
parse (400: a bad request line, a bad ``Content-Length``; 431: request line and headers over
``MAX_HEAD_BYTES``; 501: a transfer coding other than chunked), headers that do not arrive in
time (408) and more connections than ``limit_concurrency`` (503 with ``Retry-After``). These
protocol answers close the connection and are not counted in the HTTP metrics (no route was
reached). A connection closed while its client may still be sending (an answer given before
the body was read) lingers up to ``LINGER_S``: half-closed, the rest of the body read and
dropped, so that the answer is not lost to a reset. Still answered without a body: a TLS
handshake that fails or takes longer than asyncio's 60 s (the connection is closed), and a
client that closes the connection first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import http
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import anyio
import anyio.from_thread
import anyio.to_thread
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from argus.contracts.generate import Adapter, AdapterKind, Progress
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterReply, RouterRequest
from argus.request_limits import InvalidRequestError, check_image, parse_int, parse_size
from argus.router.core import CallCancel, RouterCore
from argus.router.values import Refusal, RouterError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # the gRPC endpoint's bound on a request
MAX_IMAGES = 10  # OpenAI's bound on n
MAX_USER_CHARS = 256
# ASCII digits only: Python's \d and int() also take other scripts' digits ("٦٤" is 64)

# -- what one client may make the front door hold, and for how long -------------------------
# The body nests at most 3 deep ({"adapters": [{...}]}); 32 leaves room for clients that wrap
# it, and keeps json's recursion (a RecursionError, so a 500, past about 1,000) far away.
MAX_JSON_DEPTH = 32
# Arrays and objects in a body: it has a handful (one per adapter, and adapters are few);
# millions of empty ones are cheap to send and slow to parse.
MAX_JSON_CONTAINERS = 1024
# Request line and headers, h11's default (set explicitly); more is answered 431.
MAX_HEAD_BYTES = 16 * 1024
# Request line and headers must arrive within this of the connection opening or of the
# previous answer on it (slowloris sending a header byte at a time); 408, or a silent close
# for a connection that sent nothing.
HEADER_TIMEOUT_S = 10.0
# The whole body must arrive within this of the headers (8 MiB needs about 280 KB/s); 408.
BODY_TIMEOUT_S = 30.0
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
# HTTP requests the app answers at once (the health routes aside); more are refused with 429
# before their body is read. It bounds the bodies held in memory (512 × 8 MiB at most).
MAX_REQUESTS = 512
# uvicorn's limit_concurrency (connections, or requests, at once): above MAX_REQUESTS and above
# a burst of 1,000 connections, so that Argus's 429 is the refusal clients see; past it the
# protocol answers 503 JSON.
MAX_CONNECTIONS = 2048
# listen() backlog: a burst of connections waits in the kernel's queue rather than losing SYNs
# (a client retries a dropped SYN only after 1, 3, 7 s...). Set on the socket bound here and
# in uvicorn's Config (its default), which asyncio applies again when serving starts; the
# socket's former 128 only held until then. (The kernel caps it at net.core.somaxconn.)
BACKLOG = 2048
_DECLARED_CHUNK = "argus.declared_chunk_bytes"  # scope key: what the protocol tells the app
_HEALTH = frozenset({"/healthz", "/readyz"})  # served beyond MAX_REQUESTS (health is its own path)

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
# an edit's form: the generation's fields less adapters (a JSON list has no form value), plus
# the template, its mask and img2img's strength
_EDIT_FIELDS = (_FIELDS - {"adapters"}) | {"image", "mask", "strength"}
_FILES = frozenset({"image", "mask"})
# form values read as numbers or a flag, to check them as the JSON body's are
_FORM_INTS = frozenset({"n", "seed", "steps", "deadline_ms", "max_level_index", "partial_images"})
_FORM_FLOATS = frozenset({"guidance_scale", "strength"})
MAX_FORM_FIELDS = 32  # an edit has 17 fields; each is given once
MAX_PREVIEWS = 1000  # one per step at most (steps are at most 1000)
_ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/models", "/healthz", "/readyz")


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
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})  # e.g. Connection: close, when the body is unread

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def all_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.all_headers())

    def raw(self) -> bytes:
        """The whole HTTP/1.1 answer, closing the connection: what the protocol writes when
        it answers without the app."""
        body = json.dumps(self.body()).encode()
        phrase = http.HTTPStatus(self.status).phrase
        head = [f"HTTP/1.1 {self.status} {phrase}", "content-type: application/json"]
        head += [f"content-length: {len(body)}", "connection: close"]
        head += [f"{name}: {value}" for name, value in self.all_headers().items()]
        return "\r\n".join([*head, "", ""]).encode("latin-1") + body


def invalid(param: str, message: str) -> ApiError:
    """400 naming ``param``; the message starts with it, as gRPC's details do."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


_CLOSE = {"Connection": "close"}  # answered before the body was read: the rest is not read


def too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"body: larger than {max_body_bytes} bytes",
        param="body",
        code="body_too_large",
        headers=_CLOSE,
    )


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
    return head if head in _FIELDS | _EDIT_FIELDS else None


# -- request body ---------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# keeps only brackets, each kind as "[" or "]": nesting is counted, matching is json's to check
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_json_shape(body: bytes, max_depth: int, max_containers: int) -> None:
    """Raise 400 naming body when the JSON text ``body`` has more than ``max_containers``
    arrays and objects, or nests them deeper than ``max_depth``: checked on the bytes, before
    ``json.loads`` recurses into 100,000 ``[`` (a RecursionError) or builds millions of empty
    lists (an 8 MiB body of ``[],`` took 0.7 s to parse).

    A body with at most ``max_depth`` brackets passes at once (the common case: two counts).
    Otherwise its strings are cut out and its brackets kept (regex and translate, tens of ms
    for 8 MiB); only when they are few enough are they walked for the depth. Brackets left
    unmatched count as levels, so malformed text may be refused here rather than by the
    parser; either answer is a 400 naming body."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    brackets = _JSON_STRING.sub(b"", body).translate(_AS_BRACKETS, _NOT_BRACKETS)
    if brackets.count(b"[") > max_containers or brackets.count(b"]") > max_containers:
        raise invalid("body", f"more than {max_containers} arrays and objects")
    depth = deepest = 0
    for bracket in brackets:
        depth += 1 if bracket == ord("[") else -1
        deepest = max(deepest, depth)
    if deepest > max_depth:
        raise invalid("body", f"arrays and objects nested deeper than {max_depth}")


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
            if size + request.scope.get(_DECLARED_CHUNK, 0) > max_body_bytes:
                raise too_large(max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(
        408,
        f"body: not received within {timeout_s:g} s",
        param="body",
        code="request_timeout",
        headers=_CLOSE,
    )


def decode_json(body: bytes, max_depth: int, max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """The JSON value of ``body``; 400 naming body when its shape is refused (see
    :func:`check_json_shape`) or it is not JSON."""
    check_json_shape(body, max_depth, max_containers)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: the depth check is the guard
        raise invalid("body", f"not valid JSON ({err})") from None


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


def parse_images_request(
    body: Any, model_id: str, core: RouterCore, fields: frozenset[str] = _FIELDS
) -> ImagesRequest:
    """Check a decoded JSON body (or an edit's form, as :func:`parse_edit_request` reads it);
    ApiError(400) names the first bad field. ``fields``: the names the body may have."""
    if not isinstance(body, dict):
        raise invalid("body", f"must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in fields:
            shown = name[:64]  # a client's key, echoed back: bounded
            raise invalid(shown, f"unknown field; supported: {', '.join(sorted(fields))}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "required, a string")
    if not prompt.strip():
        raise invalid("prompt", "empty; describe the image to generate")
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


def parse_edit_request(
    form: Mapping[str, str | bytes], model_id: str, core: RouterCore
) -> ImagesRequest:
    """Check an edit's form (:func:`parse_form`): its text values read as the JSON body's
    types, then checked as a generation's body is, with the image, mask and strength added
    (the core checks those). ApiError(400) names the first bad field."""
    body: dict[str, Any] = {}
    for name, value in form.items():
        if name not in _EDIT_FIELDS:
            shown = name[:64]
            supported = ", ".join(sorted(_EDIT_FIELDS))
            raise invalid(shown, f"unknown field; supported: {supported}")
        if (name in _FILES) is not isinstance(value, bytes):
            kind = "a file" if name in _FILES else "a text value, not a file"
            raise invalid(name, f"must be {kind}")
        body[name] = value if isinstance(value, bytes) else _form_value(name, value)
    image, mask = body.pop("image", b""), body.pop("mask", b"")
    strength = body.pop("strength", None)
    if not image:
        raise invalid("image", "required: the image to edit (PNG, JPEG or WebP)")
    parsed = parse_images_request(body, model_id, core, _EDIT_FIELDS)
    template = replace(parsed.template, image=image, mask=mask, strength=strength)
    return replace(parsed, template=template)


def _form_value(name: str, text: str) -> Any:
    """A form's text value as the JSON body would carry it: a number, a flag or the text."""
    try:
        if name in _FORM_INTS:
            return parse_int(text, name)
        if name in _FORM_FLOATS:
            number = float(text)
            if not math.isfinite(number):
                raise invalid(name, f"{text[:32]!r} is not a finite number")
            return number
    except ValueError as err:
        if isinstance(err, InvalidRequestError):
            raise invalid(name, str(err).removeprefix(f"{name}: ")) from None
        raise invalid(name, f"{text[:32]!r} is not a number") from None
    if name == "stream":
        if text not in ("true", "false"):
            raise invalid(name, f"{text[:32]!r}: 'true' or 'false'")
        return text == "true"
    return text


async def parse_form(body: bytes, headers: Headers) -> dict[str, str | bytes]:
    """A ``multipart/form-data`` body, already read (and so bounded in bytes), as its fields:
    text values as text, files as their bytes. 400 naming body when it is not such a form or
    has more than :data:`MAX_FORM_FIELDS` fields or more than two files, and naming a field
    given twice (``image[]``, as OpenAI's client names a list of images, is ``image``)."""
    if not headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid("body", "an edit is a multipart/form-data form (image, mask, prompt, ...)")

    async def stream() -> Any:
        yield body
        yield b""

    parser = MultiPartParser(headers, stream(), max_files=len(_FILES), max_fields=MAX_FORM_FIELDS)
    try:
        form = await parser.parse()
    except MultiPartException as err:
        raise invalid("body", f"not a form this endpoint reads ({err.message})") from None
    fields: dict[str, str | bytes] = {}
    try:
        for name, value in form.multi_items():
            name = name.removesuffix("[]")
            if name in fields:
                raise invalid(name[:64], "given more than once (one image and one mask an edit)")
            fields[name] = await value.read() if isinstance(value, UploadFile) else value
    finally:
        await form.close()
    return fields


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
    """``WIDTHxHEIGHT`` in ASCII digits (:func:`~argus.request_limits.parse_size`), within the
    workers' limits; 400 naming ``size`` otherwise."""
    try:
        width, height = parse_size(size)
        check_image(width, height, core.config.limits)
    except InvalidRequestError as err:
        raise invalid("size", str(err).removeprefix("size: ")) from None
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
            refusal = ApiError(
                431, f"request: {large}", code="invalid_http_request", headers=_CLOSE
            )
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


# -- the server -----------------------------------------------------------------------------


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
                headers=_CLOSE,
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
        if not isinstance(remaining, int) or remaining == scope.get(_DECLARED_CHUNK, 0):
            return
        grew = remaining > scope.get(_DECLARED_CHUNK, 0)
        scope[_DECLARED_CHUNK] = remaining
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
