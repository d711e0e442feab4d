"""Measured queueing caps: the simulated FCFS queue with the simulator's service-time spread."""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, replace

import numpy as np
import pytest

from argus.allocator import queueing
from argus.allocator.config import ControlConfig
from argus.allocator.queueing import (
    CapSource,
    QueueModel,
    ServiceDraws,
    erlang_c,
    late_shares_at,
    measured_caps,
)
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.adapters import AdapterModel, draw_adapters, with_adapter_costs
from argus.sim.arrivals import poisson
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.planned import PlannedPolicy
from argus.sim.policies import PLANNED
from argus.sim.report import summarise
from argus.sim.service_times import SimServiceSpread
from argus.types import Strategy

pytestmark = pytest.mark.unit

PROFILES = default_profiles()
SLO_S = 12.6  # 3 × SDXL on a100
LATE = 0.02  # QueueModel's default late share
REQUESTS = 8_000  # a tenth of them warm-up
# one standard deviation of a measured cap is about 0.01, at most 0.02, at 20,000 requests
# (benchmarks/queueing_caps.py); at 8,000 about 1.6 times that, so 0.06 is two of the widest
TOLERANCE = 0.06


@dataclass(frozen=True)
class ExponentialService:
    """Exponential service times of mean ``mean_s`` for every level: M/M/c."""

    mean_s: float

    def key(self, worker_class: str, level: str) -> Hashable:
        return ("exponential", self.mean_s)

    def draws(self, worker_class: str, level: str, count: int, seed: int) -> ServiceDraws:
        rng = np.random.default_rng(seed + 7)
        fixed = rng.exponential(self.mean_s, count)
        return ServiceDraws(fixed, np.zeros(count), np.ones(count))


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """Each test measures its own tables (the cache is per process)."""
    monkeypatch.setattr(queueing, "_TABLES", {})


def katz_spread() -> SimServiceSpread:
    return SimServiceSpread.of(PROFILES, 0.05, AdapterModel())


def mmc_late_response(mean_s: float, servers: int, utilisation: float, slo_s: float) -> float:
    """P(wait + service > slo) in M/M/c, exactly: no wait with probability 1 − C (then the
    service alone), else an Exp(cμ − λ) wait plus an Exp(μ) service (Erlang C)."""
    mu = 1.0 / mean_s
    waits = erlang_c(servers, utilisation * servers)
    drain = servers * mu * (1.0 - utilisation)
    if math.isclose(drain, mu):
        both = (1.0 + mu * slo_s) * math.exp(-mu * slo_s)
    else:
        both = (drain * math.exp(-mu * slo_s) - mu * math.exp(-drain * slo_s)) / (drain - mu)
    return (1.0 - waits) * math.exp(-mu * slo_s) + waits * both


def exact_cap(mean_s: float, servers: int, slo_s: float, late: float) -> float:
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2.0
        if mmc_late_response(mean_s, servers, mid, slo_s) <= late:
            low = mid
        else:
            high = mid
    return low


def test_with_exponential_service_the_measured_cap_is_erlang_cs():
    """M/M/c: the response-time tail by Erlang C is exact, so the simulation must meet it. A
    late share of 8% (above the 5% that an exponential service alone is past 3 × its mean)."""
    service = ExponentialService(4.2)
    caps = measured_caps(service, [("a100", "any")], 8, SLO_S, 0.08, requests=REQUESTS)
    for servers in (1, 2, 4, 8):
        exact = exact_cap(4.2, servers, SLO_S, 0.08)
        assert 0.1 < exact < 0.99
        assert caps["a100", "any"][servers - 1] == pytest.approx(exact, abs=TOLERANCE)


@dataclass(frozen=True)
class FetchService:
    """Every request: ``fixed_s`` of compute after a ``hideable_s`` fetch that starts at its
    arrival (a LoRA the queue wait hides)."""

    fixed_s: float
    hideable_s: float

    def key(self, worker_class: str, level: str) -> Hashable:
        return ("fetch", self.fixed_s, self.hideable_s)

    def draws(self, worker_class: str, level: str, count: int, seed: int) -> ServiceDraws:
        rng = np.random.default_rng(seed + 5)
        fixed = self.fixed_s * rng.uniform(0.95, 1.05, count)
        return ServiceDraws(fixed, np.full(count, self.hideable_s), np.ones(count))


def test_a_pool_whose_queue_hides_a_fetch_is_capped_above_its_no_wait_time():
    """Utilisation counts the no-wait service (2.5 s here); under load the queue hides the
    0.5 s fetch and a server takes 2 s, so eight workers can be planned past utilisation 1
    (up to 1.25). Without the fetch the same pool stays below 1."""
    hidden = FetchService(2.0, 0.5)
    assert queueing.saturation(hidden.draws("a100", "x", 1_000, 0)) == pytest.approx(1.25, 0.01)
    caps = measured_caps(hidden, [("a100", "x")], 8, 30.0, LATE, requests=REQUESTS)
    assert 1.0 < caps["a100", "x"][-1] < 1.25
    plain = measured_caps(FetchService(2.0, 0.0), [("a100", "x")], 8, 30.0, LATE, requests=REQUESTS)
    assert plain["a100", "x"][-1] < 1.0
    assert list(queueing.coarse_grid(1.0)) == list(queueing.COARSE_GRID)


def test_the_cap_grows_with_the_pool_within_the_noise():
    cells = [("a100", "ac-k0"), ("a100", "sm-tiny-sd")]
    caps = measured_caps(katz_spread(), cells, 8, SLO_S, LATE, requests=REQUESTS)
    for cell in cells:
        row = caps[cell]
        assert row[-1] > row[0] + 0.3  # eight workers share a queue far better than one
        assert all(b >= a - 0.02 for a, b in itertools.pairwise(row)), row


def test_the_late_share_at_the_cap_is_the_tolerated_one_on_other_draws():
    spread = katz_spread()
    cell = ("a100", "sm-tiny-sd")
    caps = measured_caps(spread, [cell], 4, SLO_S, LATE, requests=REQUESTS)
    other = spread.draws(*cell, REQUESTS, seed=11)
    for servers in (1, 4):
        cap = caps[cell][servers - 1]
        at_cap = late_shares_at([other], [servers], np.asarray([[cap]]), SLO_S, seed=11)[0, 0]
        assert at_cap <= LATE + 0.015  # the tolerated share, plus the simulation's error
        above = late_shares_at(
            [other], [servers], np.asarray([[min(cap + 0.08, 0.999)]]), SLO_S, seed=11
        )[0, 0]
        assert above > at_cap  # and it is the largest: more load is later


def test_measured_caps_are_deterministic_for_a_seed(monkeypatch):
    spread = katz_spread()
    cells = [("a100", "ac-k10")]
    first = measured_caps(spread, cells, 3, SLO_S, LATE, requests=2_000, seed=3)
    monkeypatch.setattr(queueing, "_TABLES", {})
    assert measured_caps(spread, cells, 3, SLO_S, LATE, requests=2_000, seed=3) == first
    other = measured_caps(spread, cells, 3, SLO_S, LATE, requests=2_000, seed=4)
    assert other != first  # the seed is used


def test_tables_are_cached_and_extended_for_larger_pools(monkeypatch):
    calls = []
    spread = ExponentialService(2.0)
    original = spread.draws

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(ExponentialService, "draws", lambda self, *a, **k: counted(*a, **k))
    two = measured_caps(spread, [("a100", "x"), ("a100", "y")], 2, SLO_S, LATE, requests=1_000)
    assert len(calls) == 1  # one distribution, drawn once for both levels
    measured_caps(spread, [("a100", "x")], 2, SLO_S, LATE, requests=1_000)
    assert len(calls) == 1
    four = measured_caps(spread, [("a100", "x")], 4, SLO_S, LATE, requests=1_000)
    assert len(calls) == 2 and len(four["a100", "x"]) == 4
    assert four["a100", "x"][:2] == two["a100", "x"]


def test_the_spread_is_the_simulators_service_time():
    """Its mean after no wait is what the policies plan with (the profile plus the mean
    adapter seconds), and its SCV is the simulator's (widest with Tiny-SD's short base)."""
    model = AdapterModel()
    spread = SimServiceSpread.of(PROFILES, 0.05, model)
    plan = with_adapter_costs(PROFILES, model, draw_adapters(50_000, np.random.default_rng(0)))
    for level in ("ac-k0", "ac-k25", "sm-tiny-sd"):
        drawn = spread.draws("a100", level, 50_000, seed=0).at_no_wait()
        assert drawn.mean() == pytest.approx(plan.profile("a100", level).latency_s, rel=0.01)
    tiny = spread.draws("a100", "sm-tiny-sd", 50_000, 0).at_no_wait()
    sdxl = spread.draws("a100", "ac-k0", 50_000, 0).at_no_wait()
    assert tiny.var() / tiny.mean() ** 2 > 2 * sdxl.var() / sdxl.mean() ** 2
    bare = SimServiceSpread.of(PROFILES, 0.0, None).draws("a100", "ac-k0", 10, 0)
    assert np.all(bare.at_no_wait() == 4.2)


def test_the_queue_model_asks_the_measured_table_only_when_told():
    spread = ExponentialService(4.2)
    analytic = QueueModel(SLO_S)
    assert analytic.cap("a100", "ac-k0", 4.2, 2) == analytic.max_utilisation(4.2, 2)
    measured = QueueModel(SLO_S, caps="measured", spread=spread)
    assert measured.caps is CapSource.MEASURED
    assert (
        measured.cap("a100", "ac-k0", 4.2, 2)
        == measured_caps(spread, [("a100", "ac-k0")], 2, SLO_S, LATE)["a100", "ac-k0"][1]
    )
    with pytest.raises(ValueError, match="spread"):
        QueueModel(SLO_S, caps="measured")
    with pytest.raises(ValueError):
        QueueModel(SLO_S, caps="guessed")


def test_the_simulated_planner_plans_with_measured_caps(monkeypatch):
    """The planned policies get the simulator's spread, and their plans change with it."""
    asked: list[tuple[str, str]] = []
    original = queueing.measured_caps

    def spy(spread, cells, *args, **kwargs):
        cells = list(cells)
        asked.extend(cells)
        assert isinstance(spread, SimServiceSpread)
        return original(spread, cells, *args, **{**kwargs, "requests": 2_000})

    monkeypatch.setattr(queueing, "measured_caps", spy)
    workload = poisson(mean_qpm=45.0, duration_min=4, seed=1)
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in PROFILES.levels_for(s)])
        for s in Strategy
    }
    config = SimConfig(gpus=4, adapters=AdapterModel())
    sim = Simulation(PROFILES, quality, workload, config)
    base = PLANNED["pac"]
    results = {}
    for caps in ("analytic", "measured"):
        control = replace(base.control, caps=caps)
        policy = PlannedPolicy("pac", replace(base, control=control))
        results[caps] = summarise(sim.run(policy))
    assert ("a100", "ac-k0") in asked
    assert results["measured"].effective_quality != results["analytic"].effective_quality


def test_a_measured_config_without_a_spread_fails_when_planning():
    config = ControlConfig(caps="measured", slo_s=SLO_S)
    with pytest.raises(ValueError, match="spread"):
        config.planner_config(PROFILES)


def test_the_choices_are_the_enums_and_make_policy_sets_them():
    from argus import defaults
    from argus.allocator.config import StrategyChoice
    from argus.sim.policies import make_policy

    assert tuple(c.value for c in CapSource) == defaults.CAPS
    assert defaults.CAPS[0] == ControlConfig().caps
    argus = make_policy("argus", caps="measured", strategy_choice="best")
    assert isinstance(argus, PlannedPolicy)
    assert argus.config.control.caps is CapSource.MEASURED
    assert argus.config.control.strategy_choice is StrategyChoice.BEST
    paper = make_policy("argus-paper", caps="measured", strategy_choice="best")
    assert isinstance(paper, PlannedPolicy)  # the paper's prototype stays AC-first
    assert paper.config.control.strategy_choice is StrategyChoice.AC_FIRST
    assert paper.config.control.caps is CapSource.MEASURED
    # the simulated policies plan with measured caps, the live allocator's default is analytic
    assert {c.control.caps for c in PLANNED.values()} == {CapSource.MEASURED}
    assert ControlConfig().caps is CapSource.ANALYTIC
    own = make_policy("pac")
    assert isinstance(own, PlannedPolicy) and own.config.control == PLANNED["pac"].control
