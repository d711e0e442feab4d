"""The router's core on typed values (argus.router.core), driven without gRPC: it loads
neither grpc nor a protobuf module, and it serves through any WorkerTransport (here a fake
that answers from a script), with its refusals typed and counted under gRPC's status names."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.generate import GenerateCall, GenerateResult, Progress, Stage
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.router.app import PrometheusStats
from argus.router.config import RouterServiceConfig
from argus.router.core import (
    CallCancel,
    InFlight,
    RouterCore,
    WorkerError,
)
from argus.router.metrics import RouterMetrics
from argus.router.stats import NO_STATS
from argus.router.values import Refusal, RouterError
from argus.types import Strategy
from tests.router_cluster import PROFILES, FakeClock, StubClassifier

pytestmark = pytest.mark.unit


PNG = b"\x89PNG\r\n\x1a\nfake"

Answer = Callable[[GenerateCall, ProgressSink | None], GenerateResult]


@pytest.mark.parametrize("module", ["argus.router.core", "argus.router.policy"])
def test_the_core_imports_neither_grpc_protobuf_nor_prometheus(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.partition('.')[0] in"
        " ('grpc', 'prometheus_client') or m.startswith('google.protobuf')"
        " or m.endswith('_pb2') or m.endswith('_pb2_grpc'))\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "", f"{module} loaded {done.stdout.strip()}"


def served(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
    if progress is not None:
        progress(Progress(Stage.QUEUED, queue_position=0))
        progress(Progress(Stage.STEP, step=1, total_steps=2, preview_png=b"p"))
    return GenerateResult(request_id=call.request_id, png=PNG, level=call.level, worker_id="")


class FakeWorkers:
    """A WorkerTransport whose workers answer by ``answers[address]``; calls are recorded."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.calls: list[tuple[str, GenerateCall]] = []

    def generate(
        self,
        address: str,
        call: GenerateCall,
        *,
        timeout_s: float,
        cancel: CallCancel,
        progress: ProgressSink | None,
    ) -> GenerateResult:
        assert timeout_s > 0.0
        self.calls.append((address, call))
        return self.answers.get(address, served)(call, progress)

    def keep_only(self, addresses: set[str]) -> None:
        pass

    def close(self) -> None:
        pass


def fails(kind: Refusal, details: str) -> Answer:
    def answer(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        raise WorkerError(kind, details)

    return answer


def make_core(
    workers: FakeWorkers, ids: tuple[str, ...], metrics: RouterMetrics | None = None
) -> RouterCore:
    """A core on the plan an allocator control makes for workers ``ids`` at ``ID:1``."""
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    for worker_id in ids:
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", PROFILES.worker_classes[0]))
    core = RouterCore(
        PROFILES,
        StubClassifier(),
        RouterServiceConfig(),
        workers=workers,
        clock=clock,
        stats=NO_STATS if metrics is None else PrometheusStats(metrics),
    )
    assert core.install(control.current)
    return core


def test_a_request_is_served_with_the_workers_answer_typed() -> None:
    workers = FakeWorkers()
    core = make_core(workers, ("w1",))
    reply = core.generate(RouterRequest(prompt="a fox", request_id="r1", width=64, height=64))
    assert reply.png == PNG and reply.request_id == "r1"
    assert reply.worker_id == "w1" and reply.timing.attempts == 1
    assert reply.worker_response.png == b""  # the image travels once
    address, call = workers.calls[0]
    assert address == "w1:1" and (call.width, call.height, call.level) == (64, 64, reply.level)
    assert call.previews == 0


def test_a_stream_hears_routed_then_the_workers_events_and_asks_for_previews() -> None:
    workers = FakeWorkers()
    core = make_core(workers, ("w1",))
    events: list[Progress] = []
    reply = core.generate(RouterRequest(prompt="a fox", previews=2), progress=events.append)
    assert [e.stage for e in events] == [Stage.ROUTED, Stage.QUEUED, Stage.STEP]
    assert events[0].worker_id == "w1" and events[0].level == reply.level
    assert workers.calls[0][1].previews == 2


def test_an_unavailable_worker_is_routed_around_and_a_failure_names_the_worker() -> None:
    workers = FakeWorkers()
    workers.answers["w0:1"] = fails(Refusal.UNAVAILABLE, "down")
    core = make_core(workers, ("w0", "w1"))
    reply = core.generate(RouterRequest(prompt="a fox"))
    assert reply.worker_id == "w1" and reply.timing.attempts == 2
    workers.answers["w1:1"] = fails(Refusal.NOT_FOUND, "adapters[0]: no LoRA 'ink'")
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox"))  # w0 is down for a while: w1 only
    assert caught.value.kind is Refusal.NOT_FOUND
    assert caught.value.details == "adapters[0]: no LoRA 'ink' (worker w1)"  # the field first


def test_refusals_are_counted_under_the_grpc_status_names() -> None:
    registry = CollectorRegistry()
    workers = FakeWorkers()
    core = make_core(workers, ("w1",), RouterMetrics(PROFILES, registry))
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox", width=63))
    assert caught.value.kind is Refusal.INVALID and caught.value.details.startswith("width:")
    core.generate(RouterRequest(prompt="a fox", request_id="r1", seed=1))
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox", request_id="r1", seed=2))
    assert caught.value.kind is Refusal.ID_CONFLICT
    count = registry.get_sample_value
    assert count("argus_router_requests_total", {"code": "INVALID_ARGUMENT"}) == 1
    assert count("argus_router_requests_total", {"code": "ALREADY_EXISTS"}) == 1
    assert len(workers.calls) == 1


def test_an_overload_refusal_is_timed_in_the_refusal_histogram_and_nothing_else_is() -> None:
    registry = CollectorRegistry()
    workers = FakeWorkers()
    core = make_core(workers, ("w1",), RouterMetrics(PROFILES, registry))
    with pytest.raises(RouterError):
        core.generate(RouterRequest(prompt="a fox", width=63))  # INVALID: not a refusal for load
    core._beliefs["w1"].queue = 100  # a long queue: 64 × 64 requests cannot make a 1 s deadline now
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox", width=64, height=64, deadline_ms=1000))
    assert caught.value.kind is Refusal.OVERLOADED
    assert registry.get_sample_value("argus_router_refusal_seconds_count") == 1


def test_a_retry_with_a_shorter_deadline_is_the_same_request() -> None:
    workers = FakeWorkers()
    core = make_core(workers, ("w1",))
    first = core.generate(RouterRequest(prompt="a fox", request_id="r1", deadline_ms=60_000))
    again = core.generate(RouterRequest(prompt="a fox", request_id="r1", deadline_ms=30_000))
    assert again is first and len(workers.calls) == 1
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox", request_id="r1", previews=1))
    assert caught.value.kind is Refusal.ID_CONFLICT


def test_a_cancelled_client_is_told_so_not_blamed_on_the_worker() -> None:
    workers = FakeWorkers()
    cancel = CallCancel()

    def cancelled(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        cancel.cancel()  # the client goes away while the worker runs
        raise WorkerError(Refusal.CANCELLED, "call ended")

    workers.answers["w1:1"] = cancelled
    core = make_core(workers, ("w1",))
    with pytest.raises(RouterError) as caught:
        core.generate(RouterRequest(prompt="a fox"), cancel=cancel)
    assert (caught.value.kind, caught.value.details) == (
        Refusal.CANCELLED,
        "the client cancelled the request",
    )


def in_flight(core: RouterCore, request: RouterRequest, cost: float) -> InFlight:
    """``request`` as ``core`` holds it while serving it, at ``cost`` (its steps resolved, its
    work counted as a generation's)."""
    steps = core.policy.steps_of(request)
    work = core._work(request, None, steps)
    return InFlight(request, steps, cost, work, core.now(), math.inf, None, CallCancel())


def test_the_cores_service_times_price_an_edit_at_the_steps_it_runs() -> None:
    """What admission sees of a worker at ac-k20 (50 steps): an edit's service time is 50/30
    of a generation's of the same cost, since the worker runs an edit's every step."""
    core = make_core(FakeWorkers(), ("w1",))
    index = next(i for i, lv in enumerate(PROFILES.levels_for(Strategy.AC)) if lv.skip_steps == 20)
    generation = RouterRequest(prompt="a fox", steps=50)
    edit = replace(generation, image=b"png")
    now = core._clock()
    with core._lock:
        plain = core._snapshot(in_flight(core, generation, 1.0), now).service_s("w1", index)
        edited = core._snapshot(in_flight(core, edit, 1.0), now).service_s("w1", index)
    assert edited == pytest.approx(plain * 50 / 30)


def test_a_worker_still_answering_on_its_old_model_is_priced_at_that_level() -> None:
    """A worker keeps serving its old model while the planned one loads in the background;
    until it answers on the planned model, admission prices it at the level it answers at."""
    workers = FakeWorkers()
    core = make_core(workers, ("w1",))
    request = RouterRequest(prompt="a fox")
    ac_model = PROFILES.levels_for(Strategy.AC)[0].model
    old = next(level for level in PROFILES.levels if level.model != ac_model)

    def price() -> float:
        with core._lock:
            return core._snapshot(in_flight(core, request, 1.0), core._clock()).service_s("w1", 0)

    planned = price()

    def on_old_model(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
        return GenerateResult(request_id=call.request_id, png=PNG, level=old.name, worker_id="")

    workers.answers["w1:1"] = on_old_model
    core.generate(request)
    with core._lock:
        expected = core._service_s("w1", old.name, 1.0, core._clock())
    assert price() == pytest.approx(expected) and expected != pytest.approx(planned)
    del workers.answers["w1:1"]  # the planned model has loaded: it answers at the planned level
    core.generate(request)
    assert price() == pytest.approx(planned)


def test_a_request_the_chosen_worker_cannot_finish_is_served_a_level_away_and_counted() -> None:
    """w1 holds ac-k0 (4.2 s), w2 ac-k25 (2.15 s); a 3.5 s deadline fits only w2. The PASM
    sends the prompt to ac-k0: the router spills it to w2 rather than refusing it."""
    registry = CollectorRegistry()
    workers = FakeWorkers()
    core = make_core(workers, ("w1", "w2"), RouterMetrics(PROFILES, registry))
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=FakeClock(), epoch="test"
    )
    for worker_id in ("w1", "w2"):
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", PROFILES.worker_classes[0]))
    published = control.current
    allocation = published.plan.allocation
    assert allocation.levels[0] == "ac-k0" and allocation.levels[-1] == "ac-k25"
    split = replace(allocation, assignment={"w1": "ac-k0", "w2": "ac-k25"})
    assert core.install(replace(published, plan=replace(published.plan, allocation=split)))
    reply = core.generate(RouterRequest(prompt="a fox", deadline_ms=3500))
    assert reply.worker_id == "w2" and reply.level == "ac-k25"
    count = registry.get_sample_value
    assert count("argus_router_spills_total", {"target": "ac-k0", "served": "ac-k25"}) == 1
