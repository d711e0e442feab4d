"""The live router places and admits inpainting edits by the edit cost model (issue 33, item 3):
``--edit-balancer`` other than "plan" keeps the plan's level, chooses the worker with the
balancer on the router's account of each worker's requests in flight and the templates it
answered edits of (argus/router/edit_loads.py), and admits on the predicted finish
(argus/router/policy.py: ``RouterPolicy.place_edit``). Driven without gRPC, through
RouterCore with fake workers, and through the policy on hand-made snapshots."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from argus.allocator.config import ControlConfig
from argus.allocator.control import AllocatorControl
from argus.cli.main import main
from argus.contracts.generate import GenerateCall, GenerateResult, Timing
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.profiles.edit_cost import default_cost_model
from argus.router.app import PrometheusStats
from argus.router.config import RouterServiceConfig
from argus.router.core import CallCancel, InFlight, RouterCore, check_request
from argus.router.edit_balance import EditJob
from argus.router.edit_loads import EditLoads, InFlightEdit, WorkerEdits, worker_snapshot
from argus.router.metrics import RouterMetrics
from argus.router.policy import Admitted, Refused, RouterPolicy, Snapshot
from argus.router.stats import NO_STATS
from argus.router.values import Refusal, RouterError
from tests.editing_factories import encode, mask_png, region_of, template_rgb
from tests.router_cluster import PROFILES, FakeClock, StubClassifier
from tests.test_router_core import FakeWorkers, served

pytestmark = pytest.mark.unit

CLASS = PROFILES.worker_classes[0]
HOLD = "hold"  # a request with this prompt waits at its worker until released
COST = default_cost_model()


def edit_request(
    seed: int = 7, ratio: float = 0.1, steps: int = 4, prompt: str = "a hat"
) -> RouterRequest:
    """An inpainting edit of the seeded 64 × 64 template ``seed``, its top-left ``ratio``
    edited."""
    return RouterRequest(
        prompt=prompt,
        steps=steps,
        image=encode(template_rgb(seed=seed)),
        mask=mask_png(region_of(ratio)),
    )


class HeldWorkers(FakeWorkers):
    """Fake workers that answer at once, except a request whose prompt is :data:`HOLD`: it
    waits until :meth:`release` (``entered`` is set once it reached its worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self._release = threading.Event()

    def generate(self, address: str, call: GenerateCall, **kwargs: object) -> GenerateResult:
        if call.prompt == HOLD:
            self.calls.append((address, call))
            self.entered.set()
            assert self._release.wait(10)
            return served(call, None)
        return super().generate(address, call, **kwargs)  # type: ignore[arg-type]

    def release(self) -> None:
        self._release.set()


def make_core(
    workers: FakeWorkers,
    ids: tuple[str, ...],
    stats: PrometheusStats | None = None,
    **config: object,
) -> RouterCore:
    """A core on the plan an allocator control makes for workers ``ids`` (one level: ac-k0)."""
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    for worker_id in ids:
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", CLASS))
    core = RouterCore(
        PROFILES,
        StubClassifier(),
        RouterServiceConfig(**config),  # type: ignore[arg-type]
        workers=workers,
        clock=clock,
        stats=stats or NO_STATS,
    )
    assert core.install(control.current)
    assert set(core._beliefs.levels.values()) == {0}  # every worker at one level
    return core


@contextmanager
def held(core: RouterCore, workers: HeldWorkers, request: RouterRequest) -> Iterator[None]:
    """``request`` (prompt :data:`HOLD`) in flight at its worker for the ``with`` block."""
    failures: list[BaseException] = []

    def send() -> None:
        try:
            core.generate(request)
        except BaseException as err:  # reported after the join
            failures.append(err)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        assert workers.entered.wait(10), failures
        yield
    finally:
        workers.release()
        thread.join(10)
    assert not failures, failures


def timed(call: GenerateCall, progress: ProgressSink | None) -> GenerateResult:
    """A worker's answer that took it 1 s, all of it denoising."""
    return replace(served(call, progress), timing=Timing(denoise_ms=1000.0, total_ms=1000.0))


def edit_service_s(core: RouterCore, request: RouterRequest) -> float:
    """``request``'s service time on w1 at level 0, as the core's snapshot gives it."""
    checked, edit = check_request(request)
    steps = core.policy.steps_of(checked)
    cost = core.policy.price(checked, steps=steps)
    assert isinstance(cost, float)
    work = core._work(checked, edit, steps)
    flight = InFlight(checked, steps, cost, work, core.now(), math.inf, None, CallCancel())
    with core._lock:
        return core._snapshot(flight, core.now()).service_s("w1", 0)


# -- (a) the holder wins ------------------------------------------------------------------


def test_a_second_edit_of_a_template_goes_to_the_worker_that_answered_the_first() -> None:
    """Mask-aware: after w_a answered an edit of template T, another edit of T goes to w_a
    even while w_a has one more (small) request in flight than the other worker: elsewhere T
    would run in full. The placements are counted by balancer and template belief."""
    workers = HeldWorkers()
    metrics = RouterMetrics(PROFILES, CollectorRegistry())
    core = make_core(workers, ("w1", "w2"), PrometheusStats(metrics), edit_balancer="mask-aware")
    holder = core.generate(edit_request(ratio=0.1)).worker_id
    other = ({"w1", "w2"} - {holder}).pop()
    with held(core, workers, edit_request(ratio=0.05, prompt=HOLD)):
        assert workers.calls[-1][0] == f"{holder}:1"  # the small one went to the holder too
        now = core.now()
        with core._lock:
            assert len(core._edits.view(holder, now).in_flight) == 1
            assert len(core._edits.view(other, now).in_flight) == 0
        second = core.generate(edit_request(ratio=0.1))
    assert second.worker_id == holder
    placed = metrics.edits_placed
    assert placed.labels("mask-aware", "held")._value.get() == 2
    assert placed.labels("mask-aware", "not_held")._value.get() == 1


def test_the_plan_routes_the_same_edit_to_the_emptier_worker() -> None:
    """With "plan" (the default) an edit is a generation to the router: Eq. 3 sends it to
    the worker with the shorter queue, whatever it answered before; nothing is counted."""
    workers = HeldWorkers()
    metrics = RouterMetrics(PROFILES, CollectorRegistry())
    core = make_core(workers, ("w1", "w2"), PrometheusStats(metrics))
    with held(core, workers, edit_request(ratio=0.05, prompt=HOLD)):
        busy = workers.calls[-1][0].removesuffix(":1")
        assert core.generate(edit_request(ratio=0.1)).worker_id != busy
    assert metrics.edits_placed.labels("mask-aware", "held")._value.get() == 0


# -- (b) a miss is a full run -------------------------------------------------------------


def policy(**config: object) -> RouterPolicy:
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=FakeClock(), epoch="t"
    )
    for worker_id in ("w1", "w2"):
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", CLASS))
    decider = RouterPolicy(PROFILES, RouterServiceConfig(**config))  # type: ignore[arg-type]
    published = control.current
    decider.install(published.plan, published.worker_classes(), 0.0)
    return decider


def snapshot(edits: dict[str, WorkerEdits], service_s: float = 2.0) -> Snapshot:
    """Both workers at level 0, each request taking ``service_s`` in full there, alone."""
    queues = {w: len(e.in_flight) for w, e in edits.items()}
    return Snapshot(
        {"w1": 0, "w2": 0},
        queues,
        frozenset(),
        lambda _w: 0.0,
        lambda _w, _i: service_s,
        lambda w: edits[w],
    )


def hit_s(ratio: float, full_s: float) -> float:
    """An edit at ``ratio`` alone, on a worker where one in full takes ``full_s``."""
    return full_s * COST.step_s(1, ratio) / COST.step_s(1, 1.0)


def test_the_balancer_predicts_a_miss_as_a_full_run() -> None:
    """An edit of T: on w2, which holds no record of T, it is predicted to take the learned
    service time of a full run (after a miss ahead of it, a full run too); on w1, which holds
    T, its mask ratio's share; the holder gets it."""
    decider = policy(edit_balancer="mask-aware")
    job = EditJob(0.1, 4, "T")
    ahead = InFlightEdit(EditJob(0.2, 4, "U"), hit=False, running_s=0.0)
    view = snapshot({"w1": WorkerEdits(templates=frozenset({"T"})), "w2": WorkerEdits((ahead,))})
    full = decider.edit_finish_s(job, decider.edit_view(job, "w2", 0, view), idle=True)
    assert full == pytest.approx(2.0)
    behind_a_miss = decider.edit_finish_s(job, decider.edit_view(job, "w2", 0, view))
    assert behind_a_miss == pytest.approx(4.0)
    on_holder = decider.edit_finish_s(job, decider.edit_view(job, "w1", 0, view))
    assert on_holder == pytest.approx(hit_s(0.1, 2.0))
    outcome = decider.route(0, edit_request(), view, 10.0, edit=job)
    assert isinstance(outcome, Admitted)
    assert (outcome.decision.worker_id, outcome.balancer, outcome.held) == (
        "w1",
        "mask-aware",
        True,
    )
    assert outcome.predicted_s == pytest.approx(hit_s(0.1, 2.0))


def test_the_routers_account_runs_the_first_of_the_batch_and_believes_answered_templates() -> None:
    """EditLoads: the first ``bound`` requests in flight run (since they were sent, or since
    one ahead was answered), the rest wait; a template is believed held once an edit of it was
    answered OK, not before, nor after a failure; the LRU keeps ``templates``."""
    loads = EditLoads(bound=1, templates=1)
    assert loads.sent("w1", 1, EditJob(0.1, 4, "T"), now=10.0) is False
    assert loads.sent("w1", 2, EditJob(0.1, 4, "T"), now=11.0) is False  # T not answered yet
    flight = loads.view("w1", 12.0).in_flight
    assert [e.running_s for e in flight] == [2.0, None]
    loads.answered("w1", 1, ok=True, now=13.0)
    assert loads.view("w1", 14.0).in_flight[0].running_s == 1.0
    assert loads.view("w1", 14.0).templates == {"T"}
    assert loads.sent("w1", 3, EditJob(0.1, 4, "T"), now=14.0) is True
    loads.sent("w1", 4, EditJob(0.1, 4, "V"), now=14.0)
    loads.answered("w1", 4, ok=False, now=15.0)
    assert loads.view("w1", 15.0).templates == {"T"}  # a failed edit recorded nothing
    loads.sent("w1", 5, EditJob(0.1, 4, "U"), now=15.0)
    loads.answered("w1", 5, ok=True, now=16.0)
    assert loads.view("w1", 16.0).templates == {"U"}  # T out: one template kept


# -- (c) admission on the predicted finish ------------------------------------------------


def test_an_edit_predicted_past_its_deadline_is_refused_where_the_plan_admits_it() -> None:
    """Behind a 50-step generation in flight, a 4-step edit finishes after 50/4 runs of its
    own: mask-aware refuses it OVERLOADED with the excess as hint; "plan" counts the
    generation as one run of the edit's and admits it. Below one idle run: DEADLINE."""
    generation = InFlightEdit(EditJob(1.0, 50), hit=False, running_s=0.0)
    view = snapshot({"w1": WorkerEdits((generation,)), "w2": WorkerEdits((generation,))}, 1.0)
    job = EditJob(0.1, 4, "T")
    request = edit_request()
    predicted = 50 / 4 + 1.0
    refused = policy(edit_balancer="mask-aware").route(0, request, view, 5.0, edit=job)
    assert isinstance(refused, Refused) and refused.kind is Refusal.OVERLOADED
    assert refused.reason == "deadline"
    assert refused.retry_after_s == pytest.approx(predicted - 5.0)
    assert isinstance(policy().route(0, request, view, 5.0, edit=job), Admitted)
    too_short = policy(edit_balancer="mask-aware").route(0, request, view, 0.5, edit=job)
    assert isinstance(too_short, Refused) and too_short.kind is Refusal.DEADLINE
    assert too_short.details.startswith("deadline_ms") and too_short.retry_after_s is None


@pytest.mark.parametrize("balancer", ["plan", "mask-aware"])
def test_the_core_refuses_such_an_edit_at_once(balancer: str) -> None:
    """Through the core: a 50-step generation in flight on the one worker, then a 4-step edit
    due in 4 of its own runs. Mask-aware refuses it at once (no worker call) with a retry
    hint; "plan" serves it."""
    workers = HeldWorkers()
    workers.answers["w1:1"] = timed
    core = make_core(workers, ("w1",), edit_balancer=balancer)
    edit = edit_request()
    for _ in range(3):  # the router learns that such an edit takes 1 s there (+ headroom)
        core.generate(edit_request(seed=8))
    budget = 4 * edit_service_s(core, edit)
    assert budget == pytest.approx(4 * 1.1)
    with held(core, workers, RouterRequest(prompt=HOLD, steps=50, width=64, height=64)):
        calls = len(workers.calls)
        if balancer == "plan":
            assert core.generate(edit, deadline_s=core.now() + budget).worker_id == "w1"
            return
        with pytest.raises(RouterError) as caught:
            core.generate(edit, deadline_s=core.now() + budget)
        assert len(workers.calls) == calls
    assert caught.value.kind is Refusal.OVERLOADED
    assert caught.value.retry_after_s is not None
    assert caught.value.retry_after_s == pytest.approx(budget * (50 / 4 + 1) / 4 - budget, rel=0.05)


# -- (d) flags ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--edit-balancer", "fastest"], "--edit-balancer"),
        (["--edit-batch", "two"], "--edit-batch"),
        (["--edit-batch", "0"], "--edit-batch: must be >= 1"),
    ],
)
def test_bad_edit_flags_are_refused_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["router", "--allocator", "127.0.0.1:1", "--insecure-internal", *flags]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    assert code == 2
    assert named in capsys.readouterr().err


def test_bad_edit_config_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="edit_balancer: unknown 'fastest'"):
        RouterServiceConfig(edit_balancer="fastest")
    with pytest.raises(ValueError, match="edit_batch: must be >= 1"):
        RouterServiceConfig(edit_batch=0)


def test_a_running_edits_steps_left_come_from_how_long_it_ran() -> None:
    """worker_snapshot: an edit in full that has run 2.5 of its batch's steps has 8 − 2 steps
    left (the one in progress counted), half a step of the current one; with a bound of 2 the
    second request in flight runs beside it (a hit: its mask ratio), a third waits."""
    full = InFlightEdit(EditJob(0.3, 8, "T"), hit=False, running_s=None)
    small = InFlightEdit(EditJob(0.1, 8, "U"), hit=True, running_s=None)
    step = COST.step_s(2, 1.0 + 0.1) * 3.0  # the batch's step on a worker 3 × the model's time
    edits = WorkerEdits(
        (
            InFlightEdit(full.job, full.hit, 2.5 * step),
            InFlightEdit(small.job, small.hit, 0.0),
            InFlightEdit(EditJob(1.0, 8), hit=False, running_s=None),
        ),
        frozenset({"U"}),
    )
    view = worker_snapshot(edits, 2, COST, scale=3.0)
    assert [(e.steps_left, e.effective_ratio) for e in view.running] == [(6, 1.0), (8, 0.1)]
    assert [e.steps_left for e in view.waiting] == [8]
    assert view.step_left_s == pytest.approx(0.5 * step)
    assert (view.bound, view.scale, view.templates) == (2, 3.0, frozenset({"U"}))
