"""The router's decision on its own (argus/router/policy.py): typed answers from a snapshot,
with no lock, clock, worker or metric behind it. RouterCore's tests cover it as served."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from argus.allocator.config import ControlConfig
from argus.allocator.control import AllocatorControl
from argus.contracts.generate import Adapter, AdapterKind
from argus.contracts.router_api import RouterRequest
from argus.contracts.workers import WorkerReport
from argus.router.admission import AdmissionRule
from argus.router.config import RouterServiceConfig, RoutingConfig
from argus.router.policy import (
    Admitted,
    Refused,
    RouterPolicy,
    Snapshot,
    StepCount,
    admit_on,
)
from argus.router.values import Refusal
from argus.types import Strategy
from tests.router_cluster import PROFILES, FakeClock, assigned_policy

pytestmark = pytest.mark.unit

CLASS = PROFILES.worker_classes[0]
REQUEST = RouterRequest(prompt="a fox")


def policy(ids: tuple[str, ...] = ("w1", "w2"), **config: object) -> RouterPolicy:
    """A policy on the plan an allocator control makes for workers ``ids``."""
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=FakeClock(), epoch="t"
    )
    for worker_id in ids:
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", CLASS))
    decider = RouterPolicy(PROFILES, RouterServiceConfig(**config))  # type: ignore[arg-type]
    published = control.current
    decider.install(published.plan, published.worker_classes(), 0.0)
    return decider


def snapshot(
    decider: RouterPolicy,
    queues: dict[str, int] | None = None,
    down: frozenset[str] = frozenset(),
    t_proc_s: float = 1.0,
) -> Snapshot:
    assert decider.plan is not None
    plan_levels = decider.plan.allocation.level_indices()
    return Snapshot(
        plan_levels,
        queues or {w: 0 for w in plan_levels},
        down,
        lambda _worker: 0.0,
        lambda _worker, _index: t_proc_s,
    )


def test_an_idle_cluster_admits_and_predicts_the_rules_completion() -> None:
    decider = policy()
    rule = decider.config.admission
    view = snapshot(decider, t_proc_s=2.0)
    assert decider.admit_early(REQUEST, 1.0, view, 10.0) is None
    outcome = decider.route(0, REQUEST, view, 10.0)
    assert isinstance(outcome, Admitted)
    assert outcome.decision.worker_id in ("w1", "w2")
    assert outcome.predicted_s == pytest.approx(rule.completion_s(0, 2.0, 0.0))


def test_what_no_idle_worker_can_finish_is_deadline_naming_the_fields() -> None:
    decider = policy()
    refused = decider.admit_early(REQUEST, 1.0, snapshot(decider, t_proc_s=5.0), 1.0)
    assert isinstance(refused, Refused) and refused.kind is Refusal.DEADLINE
    assert refused.details.startswith("width, height, steps, deadline_ms")
    assert refused.reason == "deadline" and refused.retry_after_s is None


def test_full_queues_are_overloaded_with_the_predicted_excess_as_hint() -> None:
    decider = policy()
    busy = snapshot(decider, {"w1": 9, "w2": 9}, t_proc_s=1.0)
    refused = decider.admit_early(REQUEST, 1.0, busy, 3.0)
    assert isinstance(refused, Refused) and refused.kind is Refusal.OVERLOADED
    assert refused.retry_after_s is not None and refused.retry_after_s > 5.0
    routed = decider.route(0, REQUEST, busy, 3.0)
    assert isinstance(routed, Refused) and routed.kind is Refusal.OVERLOADED
    assert routed.reason == "deadline"
    retried = decider.route(0, REQUEST, busy, 3.0, retry=True)
    assert isinstance(retried, Refused) and retried.reason == ""  # a retry is not counted


def test_down_workers_are_never_chosen_and_none_left_is_unavailable() -> None:
    decider = policy()
    half = decider.route(0, REQUEST, snapshot(decider, down=frozenset({"w1"})), 10.0)
    assert isinstance(half, Admitted) and half.decision.worker_id == "w2"
    none = snapshot(decider, down=frozenset({"w1", "w2"}))
    early = decider.admit_early(REQUEST, 1.0, none, 10.0)
    assert isinstance(early, Refused) and early.kind is Refusal.UNAVAILABLE


def test_a_requests_steps_are_worked_out_in_one_place() -> None:
    """Its own steps, else the workers' default, else (to price it and predict its service
    times) the reference request's; img2img runs the last ``strength`` of them. A decision
    given resolved steps counts those."""
    ref = PROFILES.reference.steps
    plain = RouterPolicy(PROFILES, RouterServiceConfig())
    assert plain.steps_of(RouterRequest(prompt="x", steps=20)) == StepCount(20, 20, 20)
    assert plain.steps_of(REQUEST) == StepCount(None, ref, ref)
    img2img = RouterRequest(prompt="x", image=b"png", strength=0.5)
    assert plain.steps_of(img2img) == StepCount(None, ref, ref // 2)
    defaulted = RouterPolicy(PROFILES, RouterServiceConfig(default_steps=30))
    assert defaulted.steps_of(REQUEST) == StepCount(30, 30, 30)
    four = defaulted.steps_of(RouterRequest(prompt="x", steps=4))
    long = RouterRequest(prompt="x", steps=40)
    assert defaulted.level_cap(Strategy.AC, long) == 5
    assert defaulted.level_cap(Strategy.AC, long, steps=four) == 0


def test_price_and_caps_refuse_what_the_deployment_cannot_run() -> None:
    decider = policy(max_cost=4.0, default_steps=30)
    assert decider.price(RouterRequest(prompt="x", width=1024, height=1024)) == pytest.approx(
        30 / 50
    )
    too_big = decider.price(RouterRequest(prompt="x", width=2048, height=2048, steps=100))
    assert isinstance(too_big, Refused) and too_big.kind is Refusal.INVALID
    assert too_big.details.startswith("width, height, steps")
    # 3 steps: only the levels that skip fewer than 3 (K = 0) may serve it
    assert decider.level_cap(Strategy.AC, RouterRequest(prompt="x", steps=3)) == 0
    assert decider.level_cap(Strategy.AC, RouterRequest(prompt="x")) == 5  # K 25 < 30
    nothing = RouterServiceConfig(default_steps=None)
    assert RouterPolicy(PROFILES, nothing).level_cap(Strategy.AC, REQUEST) is None


def test_a_capped_request_falls_back_to_a_worker_of_the_same_model() -> None:
    """The only worker serves ac-k25; a request of 3 steps may only run K = 0, which the
    same model runs: it goes there at level 0, marked a fallback. A request of the default
    30 steps is served at ac-k25 as planned."""
    decider = policy(("w1",), default_steps=30)
    assert decider.plan is not None
    plan, levels = decider.plan, decider.plan.allocation.levels
    allocation = replace(
        plan.allocation,
        assignment={"w1": "ac-k25"},
        workers_per_level=tuple(int(v == "ac-k25") for v in levels),
        load_share_qpm=tuple(10.0 * (v == "ac-k25") for v in levels),
    )
    decider.install(replace(plan, allocation=allocation), {"w1": CLASS}, 0.0)
    short = decider.route(0, RouterRequest(prompt="x", steps=3), snapshot(decider), 60.0)
    assert isinstance(short, Admitted)
    assert short.decision.fallback and short.decision.served_level == 0
    plain = decider.route(0, REQUEST, snapshot(decider), 60.0)
    assert isinstance(plain, Admitted) and plain.decision.served_level == levels.index("ac-k25")


def test_without_a_plan_every_decision_is_unavailable() -> None:
    decider = RouterPolicy(PROFILES, RouterServiceConfig())
    empty = Snapshot({}, {}, frozenset(), lambda _w: 0.0, lambda _w, _i: 1.0)
    for outcome in (
        decider.admit_early(REQUEST, 1.0, empty, 1.0),
        decider.route(0, REQUEST, empty, 1.0),
    ):
        assert isinstance(outcome, Refused) and outcome.kind is Refusal.UNAVAILABLE


def test_admit_on_is_the_rule_against_the_budget() -> None:
    rule = AdmissionRule()
    predicted = rule.completion_s(2, 1.0, 0.5)
    assert admit_on(rule, 2, 0.5, 1.0, predicted + 1e-9) == pytest.approx(predicted)
    late = admit_on(rule, 2, 0.5, 1.0, predicted - 0.5)
    assert isinstance(late, Refused) and late.retry_after_s == pytest.approx(0.5)
    assert isinstance(admit_on(rule, 0, 0.0, math.nan, 10.0), Refused)


def test_an_edit_on_an_ac_level_costs_its_full_steps_not_the_levels_resumed_ones() -> None:
    """An AC level's times are of runs resuming at its K; an edit runs its own steps from its
    image, so on ac-k20 (of 50 steps) it costs 50/30 of its price, on K = 0 and SM levels its
    price, and a generation its price everywhere."""
    decider = policy()
    edit = RouterRequest(prompt="a fox", image=b"png", steps=50)
    assert decider.level_cost(edit, 2.0, "ac-k20") == pytest.approx(2.0 * 50 / 30)
    assert decider.level_cost(replace(edit, steps=40), 2.0, "ac-k25") == pytest.approx(
        2.0 * 40 / 15
    )
    assert decider.level_cost(edit, 2.0, "ac-k0") == 2.0
    assert decider.level_cost(edit, 2.0, "sm-tiny-sd") == 2.0
    assert decider.level_cost(replace(edit, image=b""), 2.0, "ac-k20") == 2.0


def _spill_view(decider: RouterPolicy, extra: dict[str, int]) -> Snapshot:
    """The plan's workers full (a queue of 9 at 1 s each), and ``extra`` workers idle at the
    given level indices."""
    assert decider.plan is not None
    levels = {**decider.plan.allocation.level_indices(), **extra}
    queues = {w: 0 if w in extra else 9 for w in levels}
    return Snapshot(levels, queues, frozenset(), lambda _w: 0.0, lambda _w, _i: 1.0)


def test_a_request_its_worker_cannot_finish_spills_to_the_nearest_level_that_can() -> None:
    decider = policy()
    assert decider.plan is not None
    routed = set(decider.plan.allocation.level_indices().values())
    assert routed == {0}
    view = _spill_view(decider, {"far": 3, "near": 1})
    outcome = decider.route(0, REQUEST, view, 5.0)
    assert isinstance(outcome, Admitted)
    assert outcome.decision.worker_id == "near" and outcome.decision.served_level == 1
    assert outcome.decision.spilled and outcome.decision.target_level == 0
    rule = decider.config.admission
    assert outcome.predicted_s == pytest.approx(rule.completion_s(0, 1.0, 0.0))
    # nobody can: the chosen worker's refusal stands
    full = _spill_view(decider, {})
    refused = decider.route(0, REQUEST, full, 5.0)
    assert isinstance(refused, Refused) and refused.kind is Refusal.OVERLOADED


def test_the_spill_keeps_the_requests_level_cap_and_can_be_turned_off() -> None:
    capped = replace(REQUEST, max_level_index=1)
    decider = policy()
    outcome = decider.route(0, capped, _spill_view(decider, {"far": 3}), 5.0)
    assert isinstance(outcome, Admitted)  # the AC levels share one model: it runs level 1
    assert outcome.decision.worker_id == "far" and outcome.decision.served_level == 1
    off = policy(routing=RoutingConfig(spill_on_refusal=False))
    outcome = off.route(0, REQUEST, _spill_view(off, {"near": 1}), 5.0)
    assert isinstance(outcome, Refused) and outcome.kind is Refusal.OVERLOADED


def test_a_worker_still_loading_its_planned_model_is_priced_at_the_level_it_answers_at() -> None:
    decider = policy()
    sm = [level for level in PROFILES.levels if level.strategy is Strategy.SM]
    assert sm[0].model != sm[-1].model
    slow, fast = sm[0].name, sm[-1].name
    assert decider.serving_level(fast, slow) == slow  # its last reply ran another model
    assert decider.serving_level(fast, fast) == fast
    assert decider.serving_level(fast, None) == fast  # no reply yet
    assert decider.serving_level(fast, "no-such-level") == fast
    ac = [level.name for level in PROFILES.levels if level.strategy is Strategy.AC]
    assert decider.serving_level(ac[-1], ac[0]) == ac[-1]  # one model: a K change loads nothing


def sm_policy(assignment: dict[str, str]) -> RouterPolicy:
    """A policy on an SM plan whose workers serve ``assignment``'s levels, each prompt
    targeting its classified level (an identity shift map)."""
    return assigned_policy(assignment, Strategy.SM)


CONTROLNET = RouterRequest(
    prompt="a house", adapters=(Adapter(AdapterKind.CONTROLNET, "canny", 1.0, b"png"),)
)


def test_a_controlnet_request_is_served_only_on_levels_whose_model_runs_controlnets() -> None:
    """SM's ladder is SDXL, SD-2.0, SD-1.5, SD-1.4, small, tiny: SD-2.0's UNet takes no
    ControlNet, so a request naming one is capped at SDXL, whatever its class; one with only a
    LoRA, or none, is not. AC levels all run SDXL, which takes them."""
    assert PROFILES.levels_for(Strategy.SM)[0].model == "sdxl"
    decider = sm_policy({"xl": "sm-sd-xl", "tiny": "sm-tiny-sd"})
    assert decider.level_cap(Strategy.SM, CONTROLNET) == 0
    assert decider.level_cap(Strategy.AC, CONTROLNET) == 5
    lora = RouterRequest(prompt="a house", adapters=(Adapter(AdapterKind.LORA, "ink", 1.0),))
    assert decider.level_cap(Strategy.SM, lora) == decider.level_cap(Strategy.SM, REQUEST)
    tiny = len(PROFILES.levels_for(Strategy.SM)) - 1  # classified as tolerant as can be
    view = snapshot(decider, {"xl": 5, "tiny": 0})
    for _ in range(20):
        routed = decider.route(tiny, CONTROLNET, view, 600.0)
        assert isinstance(routed, Admitted) and routed.decision.worker_id == "xl"
    assert decider.admit_early(CONTROLNET, 1.0, snapshot(decider, t_proc_s=1.0), 600.0) is None
    plain = decider.route(tiny, REQUEST, view, 600.0)
    assert isinstance(plain, Admitted) and plain.decision.worker_id == "tiny"


def test_with_no_worker_whose_model_runs_controlnets_the_request_is_unavailable() -> None:
    """An SM plan of SD-1.5 and tiny workers: no worker may serve a ControlNet request at or
    before SDXL, so it is UNAVAILABLE with a retry hint (a later plan may have one), where a
    worker would have refused it INVALID_ARGUMENT as if the request were wrong."""
    decider = sm_policy({"a": "sm-sd-1.5", "b": "sm-tiny-sd"})
    view = snapshot(decider)
    early = decider.admit_early(CONTROLNET, 1.0, view, 600.0)
    assert isinstance(early, Refused) and early.kind is Refusal.UNAVAILABLE
    assert early.details.startswith("adapters: a ControlNet runs only on SM levels up to sm-sd-xl")
    routed = decider.route(0, CONTROLNET, view, 600.0)
    assert isinstance(routed, Refused) and routed.kind is Refusal.UNAVAILABLE
    assert routed.retry_after_s is not None and routed.details.startswith("adapters: ")
    everyone_down = snapshot(decider, down=frozenset({"a", "b"}))
    plain = decider.admit_early(REQUEST, 1.0, everyone_down, 600.0)
    assert isinstance(plain, Refused) and not plain.details.startswith("adapters")
    assert isinstance(decider.route(0, REQUEST, view, 600.0), Admitted)
