"""The router prices requests by cost and admits before it classifies: a request above the
cost cap is INVALID_ARGUMENT naming its fields, one that no idle worker can finish in time is
refused at once, one that is cheap enough fits a deadline its level's nominal latency would
miss, and under load a refused request never reaches the classifier.

A real router over gRPC on loopback, stub workers, an in-process allocator and a fake clock
(tests/router_cluster.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from argus.plumbing import rpc
from argus.router.admission import AdmissionRule, WorkerLoad, earliest_completion_s, request_cost
from argus.router.config import RouterServiceConfig
from argus.router.convert import RETRY_AFTER_KEY
from argus.types import ReferenceRequest, Strategy
from tests.router_cluster import PROFILES, TIMEOUT, Cluster, PngWorker, StubClassifier

pytestmark = pytest.mark.integration


router_pb2: Any = rpc.load("router_pb2")

EXACT = AdmissionRule(service_scv=0.0)  # the mean alone: these tests are about the cost


class CountingClassifier(StubClassifier):
    """The stub classifier, counting the prompts it was asked about."""

    def __init__(self) -> None:
        super().__init__(0)
        self.calls = 0
        self._lock = threading.Lock()

    def classify(self, prompt: str | bytes, timeout: float | None = None) -> dict[Strategy, int]:
        with self._lock:
            self.calls += 1
        return super().classify(prompt, timeout)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    made.worker_type = PngWorker  # the router checks an image is the size it asked for
    yield made
    made.close()


def ask(stub: Any, **fields: Any) -> Any:
    fields.setdefault("prompt", "a red fox in the snow")
    return stub.Generate(router_pb2.RouterGenerateRequest(**fields), timeout=TIMEOUT)


def refusal(stub: Any, **fields: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as info:
        ask(stub, **fields)
    err: Any = info.value
    return err.code(), err.details(), dict(err.trailing_metadata() or ())


def t_proc_of(cluster: Cluster) -> float:
    level = cluster.client.get_plan().workers[0].level
    return PROFILES.profile(PROFILES.worker_classes[0], level).latency_s


def test_cost_is_pixels_times_steps_over_the_reference() -> None:
    reference = ReferenceRequest(1024, 1024, 50)
    assert request_cost(2048, 2048, 1000, reference) == 80.0
    assert request_cost(512, 512, 50, reference) == 0.25
    assert request_cost(None, None, None, reference) == 1.0  # the worker's defaults: nominal
    assert PROFILES.reference == reference


def test_earliest_completion_takes_the_best_worker_and_the_requests_ahead() -> None:
    loads = [WorkerLoad(3, 1.0), WorkerLoad(0, 2.0), WorkerLoad(1, 0.5, head_elapsed_s=0.25)]
    loaded, idle = earliest_completion_s(EXACT, loads)
    assert idle == 0.5
    assert loaded == 0.75  # (1 + 1) × 0.5 − 0.25 done
    assert earliest_completion_s(EXACT, loads, ahead=3)[0] == 0.75 + 3 * 0.5 / 3


def test_a_request_above_the_cost_cap_is_invalid_argument_naming_its_fields(
    cluster: Cluster,
) -> None:
    cluster.add_worker("w1")
    classifier = CountingClassifier()
    stub = cluster.router(RouterServiceConfig(max_cost=0.5), classifier=classifier)
    code, details, _ = refusal(stub, width=2048, height=2048, steps=100, deadline_ms=10**6)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("width, height, steps: 2048×2048, 100 steps costs 8 ")
    assert (classifier.calls, cluster.workers["w1"].calls) == (0, [])
    code, details, _ = refusal(stub, width=1024, height=1024)  # cost 1
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 0.5" in details
    assert ask(stub, width=512, height=1024).png  # cost 0.5: at the cap, served


def test_an_oversized_request_is_refused_at_once_not_run(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    classifier = CountingClassifier()
    stub = cluster.router(classifier=classifier)  # no cap: the deadline alone refuses it
    code, details, trailing = refusal(stub, width=2048, height=2048, steps=1000)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert details.startswith("width, height, steps, deadline_ms: 2048×2048, 1000 steps (80 ")
    assert RETRY_AFTER_KEY not in trailing
    assert (classifier.calls, cluster.workers["w1"].calls) == (0, [])


def test_admission_prices_the_request_not_the_level(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    stub = cluster.router(RouterServiceConfig(admission=EXACT))
    half = int(0.5 * t_proc_of(cluster) * 1e3)
    code, _, _ = refusal(stub, deadline_ms=half)  # a default request takes the whole t_proc
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ask(stub, width=512, height=512, deadline_ms=half).png  # a quarter of it fits
    double = int(2.5 * t_proc_of(cluster) * 1e3)
    code, details, _ = refusal(stub, width=2048, height=1024, steps=75, deadline_ms=double)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED  # cost 3
    assert "2048×1024, 75 steps" in details


def test_under_load_a_refused_request_never_reaches_the_classifier(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    classifier = CountingClassifier()
    stub = cluster.router(RouterServiceConfig(admission=EXACT), classifier=classifier)
    tight = int(1.5 * t_proc_of(cluster) * 1e3)  # one request fits, not two
    worker.hold = threading.Event()
    first = threading.Thread(target=ask, args=(stub,), kwargs={"deadline_ms": tight})
    first.start()
    try:
        for _ in range(500):  # until the router has sent it (the worker holds it)
            if worker.calls:
                break
            threading.Event().wait(0.01)
        assert classifier.calls == 1
        for _ in range(5):
            code, details, trailing = refusal(stub, deadline_ms=tight)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details.startswith("deadline: the earliest completion")
            assert int(trailing[RETRY_AFTER_KEY]) >= 1
        assert classifier.calls == 1
        assert len(worker.calls) == 1
    finally:
        worker.hold.set()
        first.join(TIMEOUT)
