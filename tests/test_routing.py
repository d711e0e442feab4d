"""Routing on the installed plan (argus.router.routing): the published PASM as it is, the
prompt-agnostic rows, the backlog signal."""

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from argus.allocator.planner import make_plan
from argus.profiles import default_profiles
from argus.router.config import RoutingConfig
from argus.router.routing import PlanRouter
from argus.types import ClusterView, LoadForecast, Plan, Strategy

pytestmark = pytest.mark.unit


PROFILES = default_profiles()
VIEW = ClusterView.uniform(8)
CLASSES = {w.worker_id: w.worker_class for w in VIEW.workers}


def plan(histogram: Sequence[float], qpm: float = 150.0) -> Plan:
    return make_plan(PROFILES, Strategy.AC, VIEW, LoadForecast(qpm, qpm, qpm, 0.0), histogram)


def router(**config: Any) -> PlanRouter:
    return PlanRouter(PROFILES, random.Random(3), RoutingConfig(**config))


def distance(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


def test_routing_follows_the_published_pasm_whatever_the_mix() -> None:
    """The allocator owns the PASM: a plan made for one mix, then prompts of another arrive
    (every one classified as the best level). Between plans the router keeps sampling the
    published row, not a row re-aligned to the load shares F on its own recent prompts."""
    installed = plan((1, 1, 1, 1, 1, 1))
    published_row = installed.shift_map.row(0)
    shares = installed.allocation.load_share_qpm
    realigned_row = [s / sum(shares) for s in shares]  # what ODA on this mix would route by
    assert distance(published_row, realigned_row) > 0.3  # the two are told apart below

    r = router()
    r.install(installed, CLASSES, now_s=0.0)
    counts = Counter(r.route(0, {}, frozenset()).target_level for _ in range(6000))
    routed = [counts[j] / 6000 for j in range(6)]
    assert distance(routed, published_row) < 0.05
    assert r.plan is installed


def test_prompt_agnostic_routing_uses_load_shares() -> None:
    """Without the prompt, every class is routed by the plan's load shares F; with it, by the
    PASM, whose rows differ from F (the best level's class goes where it is best served)."""
    installed = plan((10, 0, 0, 0, 0, 0))
    shares = installed.allocation.load_share_qpm
    f = [s / sum(shares) for s in shares]
    assert max(f) < 1.0  # F spreads the load: a row equal to F is not a one-level row
    agnostic = router(prompt_aware=False)
    agnostic.install(installed, CLASSES, now_s=0.0)
    assert agnostic.plan is not None
    for row in agnostic.plan.shift_map.matrix:
        assert row == pytest.approx(f)
    aware = router()
    aware.install(installed, CLASSES, now_s=0.0)
    assert aware.plan is not None
    rows = aware.plan.shift_map.matrix
    assert rows == installed.shift_map.matrix
    assert any(row != pytest.approx(f) for row in rows)


def test_wants_replan_on_backlog_but_not_too_often() -> None:
    r = router(backlog_replan_per_worker=2.0, min_replan_interval_s=10.0)
    r.install(plan((1,) * 6), CLASSES, now_s=100.0)
    busy = dict.fromkeys(CLASSES, 3)
    calm = dict.fromkeys(CLASSES, 1)
    assert not r.wants_replan(105.0, busy, frozenset())  # too soon after the last plan
    assert r.wants_replan(111.0, busy, frozenset())
    assert not r.wants_replan(111.0, calm, frozenset())
    # down workers do not count as capacity
    assert r.wants_replan(111.0, calm, frozenset(list(CLASSES)[:5]))


def test_route_before_install_and_bad_config() -> None:
    with pytest.raises(RuntimeError, match="install"):
        router().route(0, {}, frozenset())
    with pytest.raises(ValueError, match="backlog_replan_per_worker"):
        RoutingConfig(backlog_replan_per_worker=0.0)
