"""The router's request-id ledger under its byte budget: answers are dropped oldest first, a
retry of a dropped answer is refused naming its id (never run twice), evictions are counted,
and the count bound forgets ids without an answer first."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from argus.cli.main import main
from argus.plumbing import rpc
from argus.router.config import RouterServiceConfig
from argus.router.ledger import (
    AnswerDroppedError,
    IdConflictError,
    LedgerStats,
    RequestLedger,
)
from argus.router.metrics import RouterMetrics
from tests.router_cluster import PROFILES, TIMEOUT, Cluster, FakeClock

router_pb2: Any = rpc.load("router_pb2")


def make_ledger(
    clock: FakeClock, *, max_bytes: int, max_entries: int = 100, window_s: float = 300.0
) -> tuple[RequestLedger[bytes], list[int]]:
    """A ledger of ``bytes`` answers sized by their length; the list counts ``on_evict``."""
    evictions: list[int] = []
    ledger: RequestLedger[bytes] = RequestLedger(
        clock,
        window_s=window_s,
        max_entries=max_entries,
        max_bytes=max_bytes,
        size_of=len,
        on_evict=lambda: evictions.append(1),
    )
    return ledger, evictions


def serve(ledger: RequestLedger[bytes], request_id: str, answer: bytes) -> None:
    future, owner = ledger.claim(request_id, "same request")
    assert owner
    ledger.finish(request_id, answer)
    assert future.result() == answer


@pytest.mark.unit
def test_answers_are_dropped_oldest_first_to_stay_within_the_budget() -> None:
    clock = FakeClock()
    ledger, evictions = make_ledger(clock, max_bytes=250)
    serve(ledger, "a", b"x" * 100)
    serve(ledger, "b", b"y" * 100)
    assert ledger.stats() == LedgerStats(running=0, answers=2, dropped=0, bytes=200, evicted=0)
    serve(ledger, "c", b"z" * 100)  # 300 > 250: "a", the oldest, goes
    assert ledger.stats() == LedgerStats(running=0, answers=2, dropped=1, bytes=200, evicted=1)
    assert len(evictions) == 1
    kept, owner = ledger.claim("b", "same request")
    assert not owner and kept.result() == b"y" * 100  # a kept answer is returned, not rerun
    with pytest.raises(AnswerDroppedError, match=r"request_id: 'a'"):
        ledger.claim("a", "same request")


@pytest.mark.unit
def test_an_answer_larger_than_the_budget_is_never_kept_but_reaches_its_joiners() -> None:
    clock = FakeClock()
    ledger, evictions = make_ledger(clock, max_bytes=50)
    serve(ledger, "small", b"s" * 40)
    future, _ = ledger.claim("big", "same request")
    joined, owner = ledger.claim("big", "same request")
    assert joined is future and not owner
    ledger.finish("big", b"b" * 60)
    assert joined.result() == b"b" * 60
    # the small answer stays: one oversized answer does not flush the others
    assert ledger.stats() == LedgerStats(running=0, answers=1, dropped=1, bytes=40, evicted=1)
    assert len(evictions) == 1
    with pytest.raises(AnswerDroppedError):
        ledger.claim("big", "same request")


@pytest.mark.unit
def test_a_dropped_id_still_conflicts_and_is_forgotten_after_the_window() -> None:
    clock = FakeClock()
    ledger, _ = make_ledger(clock, max_bytes=0, window_s=10.0)
    serve(ledger, "a", b"answer")
    with pytest.raises(IdConflictError, match="request_id"):
        ledger.claim("a", "another request")
    clock.now += 11.0
    _, owner = ledger.claim("a", "same request")
    assert owner  # past the window the id is new again
    assert ledger.stats().dropped == 0


@pytest.mark.unit
def test_answers_past_the_window_give_their_bytes_back() -> None:
    clock = FakeClock()
    ledger, evictions = make_ledger(clock, max_bytes=100, window_s=10.0)
    serve(ledger, "a", b"a" * 80)
    clock.now += 11.0
    serve(ledger, "b", b"b" * 80)  # fits: "a" expired, so nothing is evicted for it
    assert ledger.stats() == LedgerStats(running=0, answers=1, dropped=0, bytes=80, evicted=0)
    assert evictions == []


@pytest.mark.unit
def test_when_full_ids_without_an_answer_are_forgotten_first() -> None:
    clock = FakeClock()
    ledger, _ = make_ledger(clock, max_bytes=100, max_entries=3)
    serve(ledger, "old", b"o" * 60)
    serve(ledger, "kept", b"k" * 60)  # "old" loses its answer
    serve(ledger, "newer", b"n" * 30)
    assert ledger.stats() == LedgerStats(running=0, answers=2, dropped=1, bytes=90, evicted=1)
    ledger.claim("new", "same request")  # full: the answerless "old" goes, "kept" stays
    assert ledger.stats() == LedgerStats(running=1, answers=2, dropped=0, bytes=90, evicted=1)
    _, owner = ledger.claim("old", "same request")
    assert owner  # forgotten: it runs again


@pytest.mark.unit
def test_byte_budget_needs_a_size() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        RequestLedger(FakeClock(), window_s=1.0, max_entries=1, max_bytes=10)
    with pytest.raises(ValueError, match="max_id_bytes"):
        RouterServiceConfig(max_id_bytes=-1)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.close()


@pytest.mark.integration
def test_router_refuses_a_retry_whose_answer_was_dropped(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    registry = CollectorRegistry()
    metrics = RouterMetrics(PROFILES, registry)
    stub = cluster.router(RouterServiceConfig(max_id_bytes=0), metrics=metrics)
    request = router_pb2.RouterGenerateRequest(prompt="a red fox", request_id="r-7", seed=7)
    first = stub.Generate(request, timeout=TIMEOUT)
    assert first.png
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=TIMEOUT)
    err: Any = info.value
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "request_id: 'r-7'" in err.details()
    assert len(worker.calls) == 1  # refused, not run twice
    assert registry.get_sample_value("argus_router_id_answers_evicted_total") == 1


@pytest.mark.unit
def test_concurrent_claims_and_finishes_keep_the_byte_count() -> None:
    clock = FakeClock()
    ledger, evictions = make_ledger(clock, max_bytes=1000, max_entries=10_000)

    def run(k: int) -> None:
        for i in range(200):
            serve(ledger, f"{k}-{i}", b"x" * (i % 37))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    stats = ledger.stats()
    assert stats.bytes <= 1000
    assert stats.answers + stats.dropped == 800
    assert stats.evicted == stats.dropped == len(evictions)


@pytest.mark.unit
def test_router_command_refuses_a_negative_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["router", "--insecure-internal", "--allocator", "127.0.0.1:1"]
    assert main([*argv, "--max-id-bytes", "-1"]) == 2
    assert "--max-id-bytes: must be >= 0, got -1" in capsys.readouterr().err
