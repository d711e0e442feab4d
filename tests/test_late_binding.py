"""Late binding (argus.router.late_binding): the router holds admitted requests until a worker
has room, sends each to the first worker of its level that does, and refuses at once, with a
retry hint, a held request that can no longer finish by its deadline, instead of letting it
time out at the worker."""

from __future__ import annotations

import threading

import pytest

from argus.allocator.control import AllocatorControl, ControlConfig
from argus.contracts.generate import GenerateCall, GenerateResult, Timing
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.router.admission import AdmissionRule
from argus.router.config import RouterServiceConfig, RoutingConfig
from argus.router.core import CallCancel, RouterCore
from argus.router.late_binding import Held, LateBinder
from argus.router.service_times import ServiceTimeConfig
from argus.router.values import Refusal, RouterError
from tests.router_cluster import PROFILES, FakeClock, StubClassifier

pytestmark = pytest.mark.unit

RULE = AdmissionRule(service_scv=0.0)  # completion = (queue + 1) × t − elapsed, exactly


def held(token: int, worker: str, deadline: float, *, t: float = 1.0, level: int = 0,
         pinned: bool = False) -> Held:  # fmt: skip
    return Held(token, worker, level, level, deadline, lambda _worker: t, pinned=pinned)


# the rule alone -------------------------------------------------------------------------


def test_a_worker_with_room_takes_its_own_line_first_by_deadline() -> None:
    binder = LateBinder(1, RULE)
    binder.hold(held(1, "a", deadline=50.0))
    binder.hold(held(2, "a", deadline=20.0))
    taken, late = binder.take("a", 0, now=0.0)
    assert taken is not None and taken.token == 2 and taken.sent_to == "a" and late == []
    assert binder.sent("a") == 1 and not binder.has_room("a")
    assert binder.take("a", 0, now=0.0) == (None, [])  # full until it answers
    binder.done("a")
    taken, _ = binder.take("a", 0, now=0.0)
    assert taken is not None and taken.token == 1


def test_a_free_worker_takes_a_busy_peers_request_of_its_level_unless_tied_there() -> None:
    binder = LateBinder(1, RULE)
    binder.send("busy")
    binder.hold(held(1, "busy", deadline=10.0, pinned=True))  # its neighbour is on "busy"
    binder.hold(held(2, "busy", deadline=30.0, level=1))  # another level
    binder.hold(held(3, "busy", deadline=40.0))
    taken, late = binder.take("free", 0, now=0.0)
    assert taken is not None and taken.token == 3 and taken.sent_to == "free" and late == []
    assert [h.token for h in binder] == [1, 2]


def test_a_request_the_free_worker_cannot_finish_in_time_is_refused_not_sent() -> None:
    binder = LateBinder(1, RULE)
    binder.hold(held(1, "a", deadline=10.0, t=12.0))
    binder.hold(held(2, "a", deadline=20.0, t=12.0))
    taken, late = binder.take("a", 0, now=0.0)
    assert [h.token for h in late] == [1] and late[0].late
    assert (late[0].predicted_s, late[0].budget_s) == (12.0, 10.0)
    assert taken is not None and taken.token == 2


def test_the_check_at_sending_counts_what_the_running_request_has_done() -> None:
    binder = LateBinder(2, RULE)
    binder.send("a")  # running for 3 of its 4 s
    binder.hold(held(1, "a", deadline=6.0, t=4.0))  # 1 s left of it, then 4 s: in time
    taken, late = binder.take("a", 0, now=0.0, elapsed_s=3.0)
    assert late == [] and taken is not None and taken.token == 1
    binder.hold(held(2, "a", deadline=4.5, t=4.0))
    assert binder.take("a", 0, now=0.0, elapsed_s=3.0) == (None, [])  # a full window
    binder.done("a")  # one left running for 3 s: 1 + 4 s is still too late for 2
    taken, late = binder.take("a", 0, now=0.0, elapsed_s=3.0)
    assert taken is None and [h.token for h in late] == [2]
    assert (late[0].predicted_s, late[0].budget_s) == (5.0, 4.5)


def test_held_requests_are_predicted_again_when_their_worker_slows() -> None:
    binder = LateBinder(1, RULE)
    binder.send("a")
    times = {"t": 1.0}
    for token, deadline in ((1, 5.0), (2, 9.0), (3, 100.0)):
        binder.hold(Held(token, "a", 0, 0, deadline, lambda _w: times["t"]))
    assert binder.overdue("a", now=0.0, elapsed_s=0.0) == []  # 2, 3 and 4 s: all in time
    times["t"] = 3.0  # the worker's replies now say 3 s a request
    late = binder.overdue("a", now=0.0, elapsed_s=0.0)  # 6, 9 and 12 s
    assert [h.token for h in late] == [1] and [h.token for h in binder] == [2, 3]


def test_waiting_requests_are_checked_on_their_expected_time_and_sent_on_admissions() -> None:
    """Admission prices a request with a margin (2 s here); while it waits it is refused only
    when its expected time (1 s) says it is late, and it is sent only if the margin still
    fits."""
    binder = LateBinder(1, RULE)
    binder.send("a")
    request = Held(1, "a", 0, 0, 3.0, lambda _w: 2.0, expected_s=lambda _w: 1.0)
    binder.hold(request)
    assert binder.overdue("a", now=0.0, elapsed_s=0.0) == []  # 2 × 1 s fits the 3 s
    assert binder.expires_at(request) == 2.0
    binder.done("a")
    taken, late = binder.take("a", 0, now=1.5)  # 2 s with the margin > the 1.5 s left
    assert taken is None and late == [request] and request.predicted_s == 2.0


def test_a_held_request_expires_when_no_wait_could_save_it() -> None:
    binder = LateBinder(1, RULE)
    request = held(1, "a", deadline=10.0, t=4.0)
    binder.hold(request)
    assert binder.expires_at(request) == 6.0
    assert binder.expired(5.9) == []
    assert binder.expired(6.0) == [request] and request.late and len(binder) == 0


def test_a_worker_leaving_gives_its_held_requests_back() -> None:
    binder = LateBinder(2, RULE)
    binder.send("gone")
    binder.hold(held(1, "gone", deadline=10.0))
    binder.hold(held(2, "kept", deadline=10.0))
    assert [h.token for h in binder.forget({"kept"})] == [1]
    assert binder.sent("gone") == 0 and [h.token for h in binder] == [2]


def test_the_window_is_checked() -> None:
    with pytest.raises(ValueError, match="window"):
        LateBinder(0, RULE)
    with pytest.raises(ValueError, match="late_binding_window"):
        RoutingConfig(late_binding_window=-1)


# the live core ----------------------------------------------------------------------------


class GatedWorkers:
    """A WorkerTransport whose calls block until the test answers them, in order, with the
    service time it chooses."""

    def __init__(self) -> None:
        self.calls: list[GenerateCall] = []
        self._answers: list[tuple[threading.Event, list[float]]] = []
        self._lock = threading.Lock()
        self.arrived = threading.Semaphore(0)

    def generate(
        self,
        address: str,
        call: GenerateCall,
        *,
        timeout_s: float,
        cancel: CallCancel,
        progress: ProgressSink | None,
    ) -> GenerateResult:
        gate: tuple[threading.Event, list[float]] = (threading.Event(), [])
        with self._lock:
            self.calls.append(call)
            self._answers.append(gate)
        self.arrived.release()
        assert gate[0].wait(10.0), "the test never answered"
        total_ms = gate[1][0]
        timing = Timing(total_ms=total_ms)
        return GenerateResult(call.request_id, b"png", call.level, worker_id="w1", timing=timing)

    def answer(self, index: int, service_ms: float) -> None:
        with self._lock:
            gate = self._answers[index]
        gate[1].append(service_ms)
        gate[0].set()

    def keep_only(self, addresses: set[str]) -> None:
        pass

    def close(self) -> None:
        pass


def one_worker_core(workers: GatedWorkers, window: int) -> RouterCore:
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    control.heartbeat(WorkerReport("w1", "w1:1", PROFILES.worker_classes[0]))
    config = RouterServiceConfig(
        routing=RoutingConfig(late_binding_window=window),
        service_times=ServiceTimeConfig(min_samples=1),
    )
    core = RouterCore(PROFILES, StubClassifier(), config, workers=workers, clock=clock)
    assert core.install(control.current)
    return core


def start(core: RouterCore, name: str, results: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = core.generate(RouterRequest(prompt="a fox", width=64, height=64))
        except RouterError as err:
            results[name] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_worker_is_sent_no_more_than_the_window_and_takes_the_next_when_it_answers() -> None:
    workers = GatedWorkers()
    core = one_worker_core(workers, window=2)
    results: dict[str, object] = {}
    threads = [start(core, f"r{i}", results) for i in range(3)]
    assert workers.arrived.acquire(timeout=5) and workers.arrived.acquire(timeout=5)
    assert not workers.arrived.acquire(timeout=0.3)  # the third is held by the router
    assert len(workers.calls) == 2 and len(core.policy.binder or ()) == 1
    workers.answer(0, 100.0)
    assert workers.arrived.acquire(timeout=5)  # a slot came free: the held one went
    workers.answer(1, 100.0)
    workers.answer(2, 100.0)
    for thread in threads:
        thread.join(5)
    assert all(not isinstance(r, RouterError) for r in results.values()) and len(results) == 3


@pytest.mark.parametrize("window", [2, 0])
def test_a_held_request_is_refused_at_once_when_its_worker_slows(window: int) -> None:
    """A worker's first answer says it now takes 60 s a request (a noisy neighbour): the
    request held behind the second one cannot finish in its 30 s and is refused then, with a
    retry hint, never sent. Without late binding (window 0) it was sent at arrival and waits
    at the worker."""
    workers = GatedWorkers()
    core = one_worker_core(workers, window=window)
    results: dict[str, object] = {}
    threads = [start(core, f"r{i}", results) for i in range(2)]
    assert workers.arrived.acquire(timeout=5) and workers.arrived.acquire(timeout=5)
    third = start(core, "r2", results)
    sent_third = workers.arrived.acquire(timeout=0.5)
    assert sent_third == (window == 0)
    workers.answer(0, 60_000.0)
    if window:
        third.join(5)
        refusal = results["r2"]
        assert isinstance(refusal, RouterError) and refusal.kind is Refusal.OVERLOADED
        assert "while held" in refusal.details and refusal.retry_after_s
        assert len(workers.calls) == 2
        assert core._beliefs.queues()["w1"] == 1  # only the request still at the worker
    workers.answer(1, 100.0)
    if not window:
        workers.answer(2, 100.0)
    for thread in [*threads, third]:
        thread.join(5)


def test_a_held_request_whose_client_leaves_is_uncounted() -> None:
    workers = GatedWorkers()
    core = one_worker_core(workers, window=1)
    results: dict[str, object] = {}
    first = start(core, "r0", results)
    assert workers.arrived.acquire(timeout=5)
    cancel = CallCancel()

    def run() -> None:
        try:
            core.generate(RouterRequest(prompt="a fox", width=64, height=64), cancel=cancel)
        except RouterError as err:
            results["held"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(50):
        if len(core.policy.binder or ()):
            break
        thread.join(0.05)
    assert core._beliefs.queues()["w1"] == 2
    cancel.cancel()
    thread.join(5)
    err = results["held"]
    assert isinstance(err, RouterError) and err.kind is Refusal.CANCELLED
    assert core._beliefs.queues()["w1"] == 1 and len(core.policy.binder or ()) == 0
    workers.answer(0, 100.0)
    first.join(5)
    assert len(workers.calls) == 1


def test_a_held_request_goes_elsewhere_when_its_worker_leaves_the_plan() -> None:
    workers = GatedWorkers()
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    control.heartbeat(WorkerReport("w1", "w1:1", PROFILES.worker_classes[0]))
    config = RouterServiceConfig(routing=RoutingConfig(late_binding_window=1))
    core = RouterCore(PROFILES, StubClassifier(), config, workers=workers, clock=clock)
    assert core.install(control.current)
    results: dict[str, object] = {}
    first = start(core, "r0", results)
    assert workers.arrived.acquire(timeout=5)
    second = start(core, "r1", results)
    for _ in range(50):
        if len(core.policy.binder or ()):
            break
        second.join(0.05)
    other = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    other.heartbeat(WorkerReport("w2", "w2:1", PROFILES.worker_classes[0]))
    assert core.install(other.current)  # w1 left: its held request is routed again, to w2
    assert workers.arrived.acquire(timeout=5)
    workers.answer(1, 100.0)
    second.join(5)
    reply = results["r1"]
    assert not isinstance(reply, RouterError), reply
    workers.answer(0, 100.0)
    first.join(5)
