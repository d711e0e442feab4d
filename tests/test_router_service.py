"""The router service: plan-following routing, SLO admission, retries on a failing worker,
idempotent request ids and status codes for bad input.

An in-process allocator (fake clock, no loop thread) makes the plans from the heartbeats of
stub workers: tiny in-process Worker servicers that answer a fixed PNG at once, or fail.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from argus.contracts.router_api import MAX_REQUEST_BYTES
from argus.plumbing import rpc
from argus.router.admission import AdmissionRule, admit
from argus.router.app import StatsReporter
from argus.router.config import RouterServiceConfig
from argus.router.convert import RETRY_AFTER_KEY
from argus.router.ledger import RequestLedger
from tests.router_cluster import PNG, PROFILES, TIMEOUT, Cluster, FakeClock

pytestmark = pytest.mark.integration


common_pb2: Any = rpc.load("common_pb2")
router_pb2: Any = rpc.load("router_pb2")
router_pb2_grpc: Any = rpc.load("router_pb2_grpc")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.close()


def ask(stub: Any, **fields: Any) -> Any:
    fields.setdefault("prompt", "a red fox in the snow")
    return stub.Generate(router_pb2.RouterGenerateRequest(**fields), timeout=TIMEOUT)


def code_of(stub: Any, **fields: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as info:
        ask(stub, **fields)
    err: Any = info.value
    trailing = {k: v for k, v in (err.trailing_metadata() or ())}
    return err.code(), err.details(), trailing


def test_routing_follows_the_plan(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    stub = cluster.router()  # its classifier says level 0 for every prompt
    published = cluster.client.get_plan()
    assignment = {w.worker_id: w.level for w in published.workers}
    levels = published.plan.allocation.levels
    row = published.plan.shift_map.row(0)
    dictated = [levels[j] for j, p in enumerate(row) if p > 0.0]
    assert len(dictated) == 1  # the plan leaves the router no choice of level
    strategy = common_pb2.Strategy.Value(published.plan.strategy.value)
    for i in range(8):
        reply = ask(stub, seed=i)
        assert reply.png == PNG
        assert reply.plan_version == published.version
        assert reply.strategy == strategy
        assert reply.classified_level == levels[0]
        assert reply.target_level == dictated[0]
        assert reply.level == dictated[0] == assignment[reply.worker_id]
        assert reply.level_index == levels.index(dictated[0])
        assert reply.timing.attempts == 1
        assert reply.worker_response.png == b""
    sent = [c for w in cluster.workers.values() for c in w.calls]
    assert len(sent) == 8
    assert all(c.prompt == "a red fox in the snow" for c in sent)


def test_admission_rejects_what_misses_the_deadline_even_on_an_idle_worker(
    cluster: Cluster,
) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    code, details, trailing = code_of(stub, deadline_ms=1)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED  # a retry cannot help: no hint
    assert details.startswith("width, height, steps, deadline_ms:")
    assert RETRY_AFTER_KEY not in trailing
    assert cluster.workers["w1"].calls == []


def test_admission_counts_what_the_request_in_service_has_left(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    rule = AdmissionRule(service_scv=0.0)  # the mean alone: the test is about elapsed time
    stub = cluster.router(RouterServiceConfig(admission=rule))
    level = cluster.client.get_plan().workers[0].level
    t_proc = PROFILES.profile(PROFILES.worker_classes[0], level).latency_s
    worker.hold = threading.Event()
    first = threading.Thread(target=ask, args=(stub,), kwargs={"deadline_ms": 60_000})
    first.start()
    try:
        for _ in range(200):  # until the router has sent it (the worker holds it)
            if worker.calls:
                break
            threading.Event().wait(0.01)
        tight = int(1.5 * t_proc * 1e3)  # behind a whole t_proc, 2 t_proc > 1.5 t_proc
        code, _, _ = code_of(stub, deadline_ms=tight)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        cluster.clock.now += 0.75 * t_proc  # the request in service is three quarters done
        answers: list[Any] = []
        second = threading.Thread(target=lambda: answers.append(ask(stub, deadline_ms=tight)))
        second.start()
        for _ in range(200):  # admitted: it reaches the worker behind the first
            if len(worker.calls) == 2 or not second.is_alive():
                break
            threading.Event().wait(0.01)
        worker.hold.set()
        second.join(TIMEOUT)
        assert [a.png for a in answers] == [PNG]  # 2 t_proc - 0.75 t_proc fits
    finally:
        worker.hold.set()
        first.join(TIMEOUT)


def test_admission_rule_is_a_quantile_of_what_is_left() -> None:
    mean = AdmissionRule(service_scv=0.0)
    assert mean.completion_s(0, 2.0) == 2.0
    assert mean.completion_s(0, 2.0, head_elapsed_s=5.0) == 2.0  # idle: nothing to subtract
    assert mean.completion_s(2, 2.0, head_elapsed_s=1.5) == pytest.approx(4.5)
    assert mean.completion_s(2, 2.0, head_elapsed_s=9.0) == pytest.approx(4.0)  # overrun: 0 left
    spread = AdmissionRule(service_scv=0.05, confidence=0.9)
    z = 1.2815515655446004
    assert spread.completion_s(3, 2.0) == pytest.approx(8.0 + z * 2.0 * (0.05 * 4) ** 0.5)
    with pytest.raises(ValueError, match="confidence"):
        AdmissionRule(confidence=1.0)
    with pytest.raises(ValueError, match="service_scv"):
        AdmissionRule(service_scv=-0.1)


def test_failing_worker_is_retried_elsewhere(cluster: Cluster) -> None:
    bad = cluster.add_worker("w1", fail=grpc.StatusCode.UNAVAILABLE)
    cluster.add_worker("w2")
    stub = cluster.router()
    for i in range(6):
        reply = ask(stub, seed=i)
        assert reply.worker_id == "w2"
    assert len(bad.calls) <= 1  # marked down after its first failure


def test_worker_errors_other_than_unavailable_are_passed_on(cluster: Cluster) -> None:
    cluster.add_worker("w1", fail=grpc.StatusCode.INVALID_ARGUMENT)
    stub = cluster.router()
    code, details, _ = code_of(stub)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "w1" in details


def test_duplicate_request_id_calls_the_worker_once(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    stub = cluster.router()
    first = ask(stub, request_id="r-1", seed=7)
    again = ask(stub, request_id="r-1", seed=7)
    assert again == first
    assert len(worker.calls) == 1
    code, details, _ = code_of(stub, request_id="r-1", seed=8)
    assert code is grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in details


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"width": 63}, "width"),
        ({"height": 100000}, "height"),
        ({"steps": 0}, "steps"),
        ({"prompt": "x" * (1 << 20)}, "prompt"),
        ({"request_id": "r" * 500}, "request_id"),
        ({"adapters": [{"kind": 1}]}, "adapters[0]"),
        ({"previews": 1001}, "previews: 1001 outside 0..1000"),  # the HTTP API's bound
        ({"max_level_index": 2**31}, "max_level_index: 2147483648 outside 0..2147483647"),
        (
            {"adapters": [{"kind": 99, "name": "sketch"}]},
            "adapters[0]: unknown or unset kind; known kinds: LORA, CONTROLNET",
        ),
    ],
)
def test_garbage_gets_invalid_argument(cluster: Cluster, fields: Any, field: str) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    code, details, _ = code_of(stub, **fields)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field)
    assert ask(stub).png == PNG  # still serving


def test_a_request_over_the_byte_bound_is_invalid_argument_naming_its_field(
    cluster: Cluster,
) -> None:
    """A 20 MB prompt (and a 9 MiB image) is the client's error, not overload: gRPC's own
    RESOURCE_EXHAUSTED ("Received message larger than max") made clients retry it. Both
    Generate and GenerateStream answer it before the core, and the router serves on."""
    cluster.add_worker("w1")
    stub = cluster.router()
    limit = f"a request has at most {MAX_REQUEST_BYTES} bytes"
    code, details, trailing = code_of(stub, prompt="x" * 20_000_000)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("prompt: 20000000 bytes of a ") and details.endswith(limit)
    assert RETRY_AFTER_KEY not in trailing
    code, details, _ = code_of(stub, image=b"\x89PNG" + bytes(9 << 20))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("image: ")
    stream = stub.GenerateStream(
        router_pb2.RouterGenerateRequest(prompt="y" * 20_000_000), timeout=TIMEOUT
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    err: Any = info.value
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt")
    assert ask(stub).png == PNG
    assert cluster.workers["w1"].calls[-1].prompt == "a red fox in the snow"


def test_an_empty_or_blank_prompt_is_refused_naming_prompt(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    stub = cluster.router()
    for prompt in ("", "  \n"):
        code, details, _ = code_of(stub, prompt=prompt)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("prompt: empty")
    assert cluster.workers["w1"].calls == []


def test_no_worker_is_unavailable(cluster: Cluster) -> None:
    code, _, trailing = code_of(cluster.router())
    assert code is grpc.StatusCode.UNAVAILABLE
    assert RETRY_AFTER_KEY in trailing


def test_reports_reach_the_allocator(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    stub = cluster.router(level=2)  # every prompt's class is level index 2
    before = cluster.client.get_plan().plan
    assert before.forecast.ewma_qpm == 0.0
    assert before.histogram == pytest.approx([1 / 6] * 6)  # no class seen: uniform
    for i in range(3):
        ask(stub, seed=i)
    StatsReporter(cluster.core, cluster.client, cluster.clock).report_once()
    taken = cluster.core.take_report()
    arrivals, classified = list(taken.arrivals), list(taken.classified)
    assert arrivals == [] and classified == []  # handed over, not kept
    cluster.clock.now += 60.0  # the planning period ends: the allocator plans what it was told
    assert cluster.allocator.control.tick() is not None
    after = cluster.client.get_plan().plan
    assert after.version > before.version
    assert after.histogram == pytest.approx([0, 0, 1, 0, 0, 0])  # H holds the reported classes
    assert after.forecast.ewma_qpm == pytest.approx(3.0)  # 3 arrivals in the closed minute


def test_reports_name_the_classifier_and_the_allocator_checks_it(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.router()
    control = cluster.allocator.control
    control.classifier_key = "allocator-key"
    StatsReporter(cluster.core, cluster.client, cluster.clock, classifier_key="k1").report_once()
    assert control.routers_on_other_classifier() == 1
    StatsReporter(
        cluster.core, cluster.client, cluster.clock, classifier_key="allocator-key"
    ).report_once()
    assert control.routers_on_other_classifier() == 0


def test_admit_and_ledger_units() -> None:
    assert admit(1.0, 2.0).admitted
    late = admit(3.0, 1.0)
    assert not late.admitted and late.retry_after_s == pytest.approx(2.0)
    clock = FakeClock()
    ledger: RequestLedger[int] = RequestLedger(clock, window_s=10.0, max_entries=2)
    future, owner = ledger.claim("a", 1)
    assert owner
    joined, owner = ledger.claim("a", 1)
    assert joined is future and not owner
    ledger.finish("a", 5)
    assert joined.result() == 5
    clock.now += 11.0
    _, owner = ledger.claim("a", 1)
    assert owner  # expired: runs again
    ledger.claim("b", 1)
    ledger.finish("a", 1)
    ledger.claim("c", 1)  # full: the finished "a" is dropped
    assert len(ledger) == 2


def test_concurrent_duplicates_join_the_first_call() -> None:
    clock = FakeClock()
    ledger: RequestLedger[int] = RequestLedger(clock, window_s=10.0, max_entries=8)
    ledger.claim("x", 1)
    results: list[int] = []
    joiner = threading.Thread(target=lambda: results.append(ledger.claim("x", 1)[0].result()))
    joiner.start()
    ledger.finish("x", 42)
    joiner.join(TIMEOUT)
    assert results == [42]
