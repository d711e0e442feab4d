"""The allocator plans edits by the edit cost model (issue 33, item 3): a router that places
inpainting edits with an edit balancer reports each arrival's weight in full requests (an
edit's share of a batched step, ``step_s(b, b·m) / b / step_s(1, 1)``: InstGenIE §4.4;
argus.router.edit_loads.arrival_cost), ``RouterReport.arrival_costs`` carries them
(argus.contracts.routers) and the allocator's demand is their sum (argus.allocator.control,
argus.allocator.predictor). With "plan" (the default) nothing changes: every arrival weighs 1
and the report is the one routers sent before."""

from __future__ import annotations

import math
from typing import Any

import pytest

from argus.allocator.config import ControlConfig
from argus.allocator.control import AllocatorControl
from argus.allocator.predictor import LoadPredictor
from argus.contracts.router_api import RouterRequest
from argus.contracts.routers import RouterReport, router_report_from_pb, router_report_to_pb
from argus.contracts.wire import FieldError
from argus.profiles.edit_cost import EditCostModel, default_cost_model
from argus.router.app import StatsReporter
from argus.router.core import RouterCore, RouterStatistics, check_request
from argus.router.edit_loads import arrival_cost
from argus.router.values import Refusal, RouterError
from argus.types import ProfileSet
from tests.router_cluster import PROFILES, Cluster, FakeClock
from tests.test_router_core import FakeWorkers
from tests.test_router_edit_balance_live import edit_request, make_core

COST = default_cost_model()
GENERATION = RouterRequest(prompt="a fox", steps=4)


def mask_ratio(request: RouterRequest) -> float:
    """The mask ratio the router reads from ``request``'s mask."""
    _, edit = check_request(request)
    assert edit is not None
    return edit.mask_ratio


def report_of(core: RouterCore, *requests: RouterRequest) -> RouterStatistics:
    """What ``core`` reports after serving ``requests`` in turn."""
    core.take_report()  # nothing before them
    for request in requests:
        core.generate(request)
    return core.take_report()


# -- the weight ----------------------------------------------------------------------------


@pytest.mark.unit
def test_an_edits_weight_is_its_share_of_a_batched_step() -> None:
    model = EditCostModel(base_s=0.02, per_edit_s=0.01, per_mask_s=0.03)
    assert arrival_cost(model, 1, 1.0) == 1.0  # alone, in full: one full request
    # a hit alone: only its region runs in the blocks
    assert arrival_cost(model, 1, 0.1) == pytest.approx((0.02 + 0.01 + 0.003) / 0.06)
    # a batch of 4 misses shares the step's fixed part
    assert arrival_cost(model, 4, 1.0) == pytest.approx((0.02 + 0.04 + 0.12) / 4 / 0.06)
    assert 0.0 < arrival_cost(model, 8, 0.05) < arrival_cost(model, 4, 0.05) < 1.0


# -- the report across the wire ------------------------------------------------------------


def sent_report(
    ages: tuple[float, ...], costs: tuple[float, ...] = (), **fields: Any
) -> RouterReport:
    """Router r1's report of arrivals ``ages`` seconds old weighing ``costs``."""
    return RouterReport(
        "r1", arrivals=len(ages), arrival_ages_s=ages, arrival_costs=costs, **fields
    )


@pytest.mark.unit
def test_arrival_costs_cross_the_wire_and_none_means_one_each() -> None:
    message = router_report_to_pb(sent_report((0.5, 0.2), (0.25, 1.0)), PROFILES)
    report = router_report_from_pb(message, PROFILES)
    assert report.arrival_costs == (0.25, 1.0)
    assert report.arrival_weights() == (0.25, 1.0)
    old = router_report_from_pb(router_report_to_pb(sent_report((0.5, 0.2)), PROFILES), PROFILES)
    assert old.arrival_costs == ()
    assert old.arrival_weights() == (1.0, 1.0)


@pytest.mark.unit
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -0.5, 1.5])
def test_a_bad_arrival_cost_is_refused_naming_it(value: float) -> None:
    message = router_report_to_pb(sent_report((0.5, 0.2), (0.5, value)), PROFILES)
    with pytest.raises(FieldError, match=r"arrival_costs\[1\]: must be finite, > 0 and <= 1"):
        router_report_from_pb(message, PROFILES)


@pytest.mark.unit
def test_arrival_costs_must_be_one_per_arrival() -> None:
    message = router_report_to_pb(sent_report((0.5, 0.2), (0.5,)), PROFILES)
    with pytest.raises(FieldError, match=r"arrival_costs: expected one weight per arrival \(2\)"):
        router_report_from_pb(message, PROFILES)


# -- the router ----------------------------------------------------------------------------


@pytest.mark.unit
def test_mask_aware_weighs_an_edit_of_a_held_template_below_a_generation() -> None:
    """Batches of 1: the first edit of a template runs in full (weight 1); once a worker
    answered it, a small-mask edit of it weighs its mask's share; a generation weighs 1."""
    core = make_core(FakeWorkers(), ("w1", "w2"), edit_balancer="mask-aware")
    small = edit_request(ratio=0.1)
    report = report_of(core, edit_request(ratio=0.1), small, GENERATION)
    assert len(report.arrivals) == 3
    hit = arrival_cost(core.policy.edit_cost, 1, mask_ratio(small))
    assert report.arrival_costs == pytest.approx((1.0, hit, 1.0))
    assert hit < 0.6  # 82 % of SDXL's work is in the blocks, a tenth of them runs


@pytest.mark.unit
def test_a_batching_router_weighs_even_a_miss_below_one() -> None:
    core = make_core(FakeWorkers(), ("w1",), edit_balancer="mask-aware", edit_batch=4)
    report = report_of(core, edit_request(seed=3, ratio=0.1), GENERATION)
    assert report.arrival_costs == pytest.approx((arrival_cost(COST, 4, 1.0), 1.0))
    assert report.arrival_costs[0] < 1.0


@pytest.mark.unit
def test_a_refused_edit_counts_at_its_weight() -> None:
    """An edit refused early (its deadline cannot be met) is load the allocator plans for:
    it weighs what it would have cost served."""
    core = make_core(FakeWorkers(), ("w1",), edit_balancer="mask-aware", edit_batch=4)
    core.take_report()
    late = RouterRequest(
        prompt="a hat", steps=4, image=edit_request().image, mask=edit_request().mask,
        deadline_ms=1,
    )  # fmt: skip
    with pytest.raises(RouterError) as refused:
        core.generate(late)
    assert refused.value.kind is Refusal.DEADLINE
    report = core.take_report()
    assert report.arrival_costs == pytest.approx((arrival_cost(COST, 4, 1.0),))


@pytest.mark.unit
def test_with_plan_every_arrival_weighs_one_and_the_report_is_unchanged() -> None:
    core = make_core(FakeWorkers(), ("w1", "w2"), edit_batch=4)  # edit_balancer "plan"
    with core._lock:
        assert core._arrival_costs == []
    requests = (edit_request(ratio=0.1), edit_request(ratio=0.1), GENERATION)
    core.take_report()
    for request in requests:
        core.generate(request)
    with core._lock:
        assert core._arrival_costs == [1.0, 1.0, 1.0]
    report = core.take_report()
    assert report.arrival_costs == ()
    ages = (1.0, 0.5, 0.25)
    today = router_report_to_pb(sent_report(ages, sequence=3, classifier="k"), PROFILES)
    now = router_report_to_pb(
        sent_report(ages, report.arrival_costs, sequence=3, classifier="k"), PROFILES
    )
    assert now.SerializeToString() == today.SerializeToString()


@pytest.mark.unit
def test_mask_aware_with_only_generations_sends_no_weights() -> None:
    core = make_core(FakeWorkers(), ("w1",), edit_balancer="mask-aware", edit_batch=4)
    report = report_of(core, GENERATION, GENERATION)
    assert len(report.arrivals) == 2 and report.arrival_costs == ()


# -- the allocator -------------------------------------------------------------------------


def demand_qpm(ages: tuple[float, ...], costs: tuple[float, ...] = ()) -> float:
    """The allocator's forecast after one 60 s period whose arrivals a router reported (through
    the wire) with ``costs``."""
    clock = FakeClock()
    control = AllocatorControl(PROFILES, ControlConfig(period_s=60.0), clock=clock)
    clock.now += 30.0
    message = router_report_to_pb(sent_report(ages, costs, sequence=1), PROFILES)
    control.report_router(router_report_from_pb(message, PROFILES))
    clock.now += 31.0  # the period has ended
    return control._allocator.forecast(clock.now).qpm


@pytest.mark.unit
def test_the_allocators_demand_is_the_sum_of_the_weights() -> None:
    ages = (20.0, 10.0, 5.0, 1.0)
    costs = (0.25, 1.0, 0.5, 0.125)
    assert demand_qpm(ages) == pytest.approx(4.0)  # an old router: one request each
    assert demand_qpm(ages, costs) == pytest.approx(sum(costs))  # 60 s: QPM = the sum
    assert demand_qpm(ages, (1.0,) * 4) == pytest.approx(4.0)


@pytest.mark.unit
def test_weights_without_ages_count_at_the_receive_time() -> None:
    clock = FakeClock()
    control = AllocatorControl(PROFILES, ControlConfig(period_s=60.0), clock=clock)
    clock.now += 30.0
    control.report_router(RouterReport("r1", 1, arrivals=2, arrival_costs=(0.5, 0.25)))
    clock.now += 31.0
    assert control._allocator.forecast(clock.now).qpm == pytest.approx(0.75)


@pytest.mark.unit
def test_the_predictor_refuses_a_weight_that_is_no_load() -> None:
    predictor = LoadPredictor(start_s=0.0, period_s=60.0)
    for weight in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="weight"):
            predictor.observe(1.0, weight)
    predictor.observe(1.0, 0.5)
    predictor.observe(2.0)
    assert predictor.arrivals == 2
    assert predictor.forecast(61.0).qpm == pytest.approx(1.5)


# -- the router's report reaches the allocator ----------------------------------------------


class RecordingClient:
    def __init__(self) -> None:
        self.reports: list[RouterReport] = []

    def report(self, report: RouterReport, profiles: ProfileSet) -> None:
        self.reports.append(report)


@pytest.mark.unit
def test_the_reporter_sends_each_arrivals_weight() -> None:
    core = make_core(FakeWorkers(), ("w1",), edit_balancer="mask-aware", edit_batch=4)
    core.generate(edit_request(seed=3, ratio=0.1))
    core.generate(GENERATION)
    client = RecordingClient()
    StatsReporter(core, client, core.now).report_once()  # type: ignore[arg-type]
    (sent,) = client.reports
    assert sent.arrival_costs == pytest.approx((arrival_cost(COST, 4, 1.0), 1.0))
    assert sent.arrivals == len(sent.arrival_ages_s) == 2


@pytest.mark.integration
def test_weights_cross_grpc_to_the_allocators_demand() -> None:
    cluster = Cluster()
    try:
        cluster.clock.now += 30.0  # the arrivals fall after the allocator started
        cluster.client.report(sent_report((3.0, 2.0), (0.5, 0.25), sequence=1), PROFILES)
        cluster.clock.now += 31.0  # its first period has ended
        assert cluster.allocator.control.tick() is not None
        assert cluster.client.get_plan().plan.forecast.ewma_qpm == pytest.approx(0.75)
    finally:
        cluster.close()
