import random
from collections import Counter
from typing import Any

import pytest

from argus.allocator.planner import make_plan
from argus.profiles import default_profiles
from argus.router.routing import PlanRouter, RouterConfig
from argus.types import ClusterView, LoadForecast, Plan, Strategy

PROFILES = default_profiles()
VIEW = ClusterView.uniform(8)
CLASSES = {w.worker_id: w.worker_class for w in VIEW.workers}


def plan(histogram: tuple[float, ...], qpm: float = 150.0) -> Plan:
    return make_plan(PROFILES, Strategy.AC, VIEW, LoadForecast(qpm, qpm, qpm, 0.0), histogram)


def router(**config: Any) -> PlanRouter:
    return PlanRouter(PROFILES, random.Random(3), RouterConfig(**config))


def test_realignment_follows_the_recent_mix():
    """A plan made for one affinity mix; prompts of another arrive. Re-aligned routing still
    sends every level about its share F, the stale PASM does not."""
    installed = plan((1, 1, 1, 1, 1, 1))
    shares = installed.allocation.load_share_qpm
    expected = [s / sum(shares) for s in shares]

    def served_mix(realign_every):
        r = router(realign_every=realign_every, realign_window=100)
        r.install(installed, CLASSES, now_s=0.0)
        counts = Counter()
        for _ in range(6000):
            level = 0  # every prompt now says: best level
            r.observe(Strategy.AC, level)
            counts[r.route(level, {}, frozenset()).served_level] += 1
        return [counts[j] / 6000 for j in range(6)]

    realigned = served_mix(realign_every=50)
    stale = served_mix(realign_every=0)
    error = lambda mix: sum(abs(a - b) for a, b in zip(mix, expected, strict=True))  # noqa: E731
    assert error(realigned) < 0.05
    assert error(stale) > 0.3


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


def test_wants_replan_on_backlog_but_not_too_often():
    r = router(backlog_replan_per_worker=2.0, min_replan_interval_s=10.0)
    r.install(plan((1,) * 6), CLASSES, now_s=100.0)
    busy = dict.fromkeys(CLASSES, 3)
    calm = dict.fromkeys(CLASSES, 1)
    assert not r.wants_replan(105.0, busy, frozenset())  # too soon after the last plan
    assert r.wants_replan(111.0, busy, frozenset())
    assert not r.wants_replan(111.0, calm, frozenset())
    # down workers do not count as capacity
    assert r.wants_replan(111.0, calm, frozenset(list(CLASSES)[:5]))


def test_route_before_install_and_bad_config():
    with pytest.raises(RuntimeError, match="install"):
        router().route(0, {}, frozenset())
    with pytest.raises(ValueError, match="realign_window"):
        RouterConfig(realign_window=0)
    with pytest.raises(ValueError, match="backlog_replan_per_worker"):
        RouterConfig(backlog_replan_per_worker=0.0)
