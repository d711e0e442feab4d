"""The OpenAI images API's wire format, as the router's HTTP front door speaks it: request
bodies in, typed requests out, and answers and errors back in OpenAI's shapes.

A ``/v1/images/generations`` body (JSON) or a ``/v1/images/edits`` form (multipart) becomes
an :class:`ImagesRequest`: ``n`` :class:`~argus.contracts.router_api.RouterRequest` values
differing only in seed (``seed``, ``seed + 1``, ...), checked field by field so that a bad one
is a 400 naming it (:func:`invalid`). No protobuf is on this path: the body becomes the core's
typed request directly. An edit's form takes ``image`` (PNG, JPEG or WebP), ``mask`` (a PNG of
its size whose fully transparent pixels are edited; without it, the image's own alpha),
``prompt`` and the generation's other fields as form values, plus ``strength`` (img2img,
without a mask); no adapters. Its image and mask are checked by the core
(:func:`~argus.request_limits.check_edit`), so a bad one is a 400 naming ``image``, ``mask``
or ``strength``, as over gRPC.

Bodies are bounded before they are parsed: arrays and objects, how many and how deep, on the
bytes (:func:`check_json_shape`), a form's fields and files by the multipart parser
(:func:`parse_form`). Byte counts and time limits are the transport's
(:mod:`argus.router.http_app`, :mod:`argus.router.http_server`).

Every answer other than 200 is an :class:`ApiError`: OpenAI's error JSON ``{"error":
{"message", "type", "param", "code"}}`` with its status, as a Starlette response for the app
or as raw HTTP/1.1 bytes for the protocol, which answers some requests itself. The core's
refusals map to HTTP as in :data:`HTTP_STATUS` (:func:`from_router_error`). An image served is
:func:`image_entry` (the PNG and where and how fast it was made).
"""

from __future__ import annotations

import base64
import http
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.responses import JSONResponse

from argus.contracts.generate import Adapter, AdapterKind, CacheOutcome, GenerateResult
from argus.contracts.router_api import MAX_REQUEST_BYTES, RouterReply, RouterRequest
from argus.request_limits import (
    MAX_LEVEL_INDEX,
    MAX_PREVIEWS,
    InvalidRequestError,
    check_image,
    check_range,
    parse_int,
    parse_size,
)
from argus.router.core import RouterCore
from argus.router.values import Refusal, RouterError

MAX_BODY_BYTES = MAX_REQUEST_BYTES  # the gRPC endpoint's bound on a request too
MAX_IMAGES = 10  # OpenAI's bound on n
MAX_USER_CHARS = 256
# The body nests at most 3 deep ({"adapters": [{...}]}); 32 leaves room for clients that wrap
# it, and keeps json's recursion (a RecursionError, so a 500, past about 1,000) far away.
MAX_JSON_DEPTH = 32
# Arrays and objects in a body: it has a handful (one per adapter, and adapters are few);
# millions of empty ones are cheap to send and slow to parse.
MAX_JSON_CONTAINERS = 1024

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


CLOSE = {"Connection": "close"}  # answered before the body was read: the rest is not read


def too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"body: larger than {max_body_bytes} bytes",
        param="body",
        code="body_too_large",
        headers=CLOSE,
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
    max_level_index = _int(body, "max_level_index", 0, MAX_LEVEL_INDEX)
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
            kind = "a file" if name in _FILES else "a text field, not a file"
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
    has more than :data:`MAX_FORM_FIELDS` fields, and naming a field given twice (``image[]``,
    as OpenAI's client names a list of images, is ``image``). Files are counted as fields,
    not apart: the body's bytes bound them already, and a text field sent as a file (a
    third file) is then refused by :func:`parse_edit_request` naming it, not the body."""
    if not headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid("body", "an edit is a multipart/form-data form (image, mask, prompt, ...)")

    async def stream() -> Any:
        yield body
        yield b""

    parser = MultiPartParser(
        headers, stream(), max_files=MAX_FORM_FIELDS, max_fields=MAX_FORM_FIELDS
    )
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
    try:
        check_range(name, value, low, high)  # in the core's words (gRPC's previews, ...)
    except InvalidRequestError as err:
        raise invalid(name, str(err).removeprefix(f"{name}: ")) from None
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
    typed), and what the approximate cache gave it (:func:`cache_evidence`)."""
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
        "cache": cache_evidence(reply.worker_response),
    }


def cache_evidence(worker: GenerateResult) -> dict[str, Any]:
    """The ``cache`` object of a ``data`` item, an Argus extension (OpenAI's clients keep
    unknown fields): ``outcome`` hit, miss or not_used (null if the worker did not say);
    ``similarity`` of the nearest cached prompt the worker found, null when it found none or
    did not look; ``resumed_step`` the K resumed at (0 unless a hit); ``routed_step`` the
    routed level's K, the ceiling the similarity may lower; ``miss_reason`` ("" unless a
    miss), e.g. below-floor."""
    outcome = worker.cache
    hit = outcome is CacheOutcome.HIT
    return {
        "outcome": None if outcome is None else outcome.value.replace("-", "_"),
        "similarity": worker.similarity,
        "resumed_step": worker.start_step if hit else 0,
        "routed_step": worker.routed_step,
        "miss_reason": worker.cache_miss_reason if outcome is CacheOutcome.MISS else "",
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
