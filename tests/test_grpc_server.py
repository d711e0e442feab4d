"""What every Argus server shares (argus/plumbing/grpc_server.py): calls beyond the concurrency
bound are refused at once instead of queued in front of the thread pool."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
import pytest

from argus.plumbing.grpc_server import bind, new_server

pytestmark = pytest.mark.integration


METHOD = "/test.Blocking/Call"


def blocking_server(release: threading.Event, running: threading.Semaphore) -> Any:
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        running.release()
        release.wait(30.0)
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        "test.Blocking", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = new_server(
        threads=8,
        thread_prefix="test",
        max_receive_bytes=1024,
        max_send_bytes=1024,
        max_concurrent_rpcs=2,
    )
    server.add_generic_rpc_handlers((handler,))
    return server


def test_calls_beyond_the_bound_are_refused_not_queued() -> None:
    release, running = threading.Event(), threading.Semaphore(0)
    server = blocking_server(release, running)
    port = bind(server, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(METHOD)
    pool = futures.ThreadPoolExecutor(2)
    try:
        held = [pool.submit(call, b"x", timeout=30.0) for _ in range(2)]
        for _ in range(2):
            assert running.acquire(timeout=10.0)  # both are in their handlers
        with pytest.raises(grpc.RpcError) as refused:
            call(b"x", timeout=10.0)  # a third: refused while the two run
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert [f.result(timeout=10.0) for f in held] == [b"done", b"done"]
        assert call(b"x", timeout=10.0) == b"done"  # room again
    finally:
        release.set()
        pool.shutdown()
        channel.close()
        server.stop(None)
