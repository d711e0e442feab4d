"""A client of the public endpoint (``argus.v1.Router``): what ``argus client`` and the
``argus up --demo`` use, and a starting point for applications.

TLS and the bearer token are optional, as on the router. Each call carries a request id, so
the one retry this client makes on UNAVAILABLE (the router restarting) cannot run a prompt
twice; RESOURCE_EXHAUSTED comes back with the router's ``retry-after-ms`` hint.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from argus.contracts.router_api import RouterRequest, request_to_pb
from argus.plumbing import rpc
from argus.plumbing.grpc_server import reconnect_options
from argus.router.convert import RETRY_AFTER_KEY

common_pb2: Any = rpc.load("common_pb2")
worker_pb2: Any = rpc.load("worker_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")


class RequestFailed(Exception):
    """The router answered with an error status; ``retry_after_ms`` is its hint, if any."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int | None) -> None:
        hint = "" if retry_after_ms is None else f" (retry after {retry_after_ms} ms)"
        super().__init__(f"{code.name}: {details}{hint}")
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class Connection:
    """Where the router is and how to reach it."""

    address: str
    token: str | None = None  # bearer token
    tls_ca: str | None = None  # PEM file of the CA (or self-signed certificate) to trust
    tls_server_name: str | None = None  # name to check in the certificate, if not the host

    def channel(self) -> grpc.Channel:
        options = reconnect_options()
        if self.tls_server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))  # type: ignore[arg-type]
        if self.tls_ca is None:
            return grpc.insecure_channel(self.address, options=options)
        credentials = grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes())
        return grpc.secure_channel(self.address, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.token is None else (("authorization", f"Bearer {self.token}"),)


class RouterClient:
    """Sends Generate calls to one router over one channel; thread-safe."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._channel = connection.channel()
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(
        self,
        prompt: str,
        *,
        timeout_s: float = 300.0,
        **fields: Any,
    ) -> Any:
        """One image; returns the RouterGenerateResponse, raises :class:`RequestFailed`.
        ``fields``: those of :func:`generate_request`."""
        return self.call(generate_request(prompt, **fields), timeout_s)

    def generate_stream(
        self,
        prompt: str,
        on_progress: Callable[[Any], None],
        *,
        previews: int = 0,
        timeout_s: float = 300.0,
        **fields: Any,
    ) -> Any:
        """One image through GenerateStream: ``on_progress`` hears each argus.v1.Progress
        (routed, queued, running, every step, decoding); returns the RouterGenerateResponse,
        raises :class:`RequestFailed`. One retry on UNAVAILABLE before any event came."""
        request = generate_request(prompt, **fields)
        request.previews = previews
        for attempt in (1, 2):
            heard = False
            try:
                events = self._stub.GenerateStream(
                    request, timeout=timeout_s, metadata=self.connection.metadata()
                )
                for event in events:
                    heard = True
                    if event.WhichOneof("event") == "response":
                        return event.response
                    on_progress(event.progress)
            except grpc.RpcError as err:
                code = err.code()
                if code is grpc.StatusCode.UNAVAILABLE and attempt == 1 and not heard:
                    continue
                raise RequestFailed(code, err.details() or "", retry_after(err)) from None
            raise RequestFailed(grpc.StatusCode.INTERNAL, "the stream ended without an image", None)
        raise AssertionError("unreachable")

    def call(self, request: Any, timeout_s: float) -> Any:
        """Send a RouterGenerateRequest; one retry on UNAVAILABLE (same request id)."""
        for attempt in (1, 2):
            try:
                return self._stub.Generate(
                    request, timeout=timeout_s, metadata=self.connection.metadata()
                )
            except grpc.RpcError as err:
                if err.code() is grpc.StatusCode.UNAVAILABLE and attempt == 1:
                    continue
                raise RequestFailed(err.code(), err.details() or "", retry_after(err)) from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def generate_request(
    prompt: str,
    *,
    seed: int = 0,
    negative_prompt: str = "",
    size: int | None = None,
    steps: int | None = None,
    deadline_ms: int | None = None,
    max_level_index: int | None = None,
    request_id: str | None = None,
    image: bytes = b"",
    mask: bytes = b"",
    strength: float | None = None,
) -> Any:
    """A RouterGenerateRequest; a fresh request id unless one is given (a retry with the
    same id joins the first call instead of running again). ``image``: an edit of it (see
    ``RouterGenerateRequest``), inpainting where ``mask`` (or the image's own alpha) is
    transparent, or img2img at ``strength``."""
    typed = RouterRequest(
        prompt=prompt,
        request_id=request_id or uuid.uuid4().hex,
        negative_prompt=negative_prompt,
        seed=seed,
        width=size,
        height=size,
        steps=steps,
        deadline_ms=deadline_ms,
        max_level_index=max_level_index,
        image=image,
        mask=mask,
        strength=strength,
    )
    return request_to_pb(typed)


def retry_after(err: grpc.RpcError) -> int | None:
    """The ``retry-after-ms`` trailing metadata of a failed call, if present."""
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == RETRY_AFTER_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def summary(response: Any, out: Path | None = None) -> dict[str, Any]:
    """The response in one flat dict (what ``argus client`` prints per image)."""
    worker = response.worker_response
    return {
        "request_id": response.request_id,
        **({"out": str(out)} if out is not None else {}),
        "level": response.level,
        "classified_level": response.classified_level,
        "worker": response.worker_id,
        "strategy": common_pb2.Strategy.Name(response.strategy),
        "cache": worker_pb2.CacheOutcome.Name(worker.cache),
        "total_ms": round(response.timing.total_ms, 1),
        "worker_ms": round(response.timing.worker.total_ms, 1),
        "classify_ms": round(response.timing.classify_ms, 1),
        "attempts": response.timing.attempts,
    }
