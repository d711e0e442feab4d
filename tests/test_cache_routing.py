"""Cache-aware worker choice (argus/router/cache_routing.py) through the router's decision
(RouterPolicy.route) and the simulator's argus: the request goes where its close neighbour
is, is admitted at the step that neighbour allows, and the plan learns what the caches hold
even while it serves SM."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pytest

from argus.contracts.router_api import RouterRequest
from argus.profiles.cache_evidence import DEFAULT_RULE
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.router.cache_routing import CacheRouting
from argus.router.policy import Admitted, RouterPolicy, Snapshot
from argus.sim.arrivals import poisson
from argus.sim.classifiers import NoisyOracleClassifier
from argus.sim.cluster import RunResult, SimConfig, Simulation
from argus.sim.cluster_cache import CacheSetup, ClusterCache
from argus.sim.policies import make_policy
from argus.sim.report import summarise
from argus.sim.worker_cache import Eviction
from argus.sim.workloads import Workload
from argus.types import Strategy
from tests.router_cluster import PROFILES, assigned_policy

pytestmark = pytest.mark.unit

CLASS = PROFILES.worker_classes[0]
AC = [level.name for level in PROFILES.levels_for(Strategy.AC)]  # ac-k0 … ac-k25
K25 = AC.index("ac-k25")
REQUEST = RouterRequest(prompt="a red fox in the snow")
RULES = {"sdxl": DEFAULT_RULE}


def latency(level: str) -> float:
    return PROFILES.profile(CLASS, level).latency_s


def ac_policy(assignment: dict[str, str], *, cache_aware: bool = True) -> RouterPolicy:
    """A policy on an AC plan whose workers serve ``assignment``'s levels, every prompt
    targeting its classified level (an identity shift map)."""
    return assigned_policy(assignment, Strategy.AC, cache_rules=RULES if cache_aware else None)


ASKED: list[tuple[str, str]] = []  # (worker, model) the last view's neighbours were asked


def view(
    decider: RouterPolicy,
    held: Mapping[str, float],
    queues: Mapping[str, int] | None = None,
) -> Snapshot:
    """Workers answer at the profile's latencies; ``held[w]`` is the similarity of the
    request's nearest neighbour in w's cache (absent: none); what is asked goes to ASKED."""
    assert decider.plan is not None
    levels = decider.plan.allocation.level_indices()
    names = decider.plan.allocation.levels
    ASKED.clear()

    def neighbours(worker: str, model: str) -> float | None:
        ASKED.append((worker, model))
        return held.get(worker)

    return Snapshot(
        levels,
        dict(queues or dict.fromkeys(levels, 0)),
        frozenset(),
        lambda _worker: 0.0,
        lambda _worker, index: latency(names[index]),
        neighbours=neighbours,
    )


def routed(decider: RouterPolicy, snapshot: Snapshot, request: RouterRequest = REQUEST) -> Admitted:
    outcome = decider.route(K25, request, snapshot, 60.0)
    assert isinstance(outcome, Admitted), outcome
    return outcome


def test_the_prompt_goes_to_the_worker_holding_its_close_neighbour() -> None:
    decider = ac_policy({"w1": "ac-k25", "w2": "ac-k25"})
    # w1 would win Eq. 3 (equal queues, the lower id); w2 holds a neighbour allowing K = 25
    outcome = routed(decider, view(decider, {"w2": 0.97}))
    assert outcome.decision.worker_id == "w2"
    assert outcome.cache is not None
    assert (outcome.cache.step, outcome.cache.similarity) == (25, 0.97)
    # admitted at the step the neighbour allows: the K = 25 time, not a miss's full run
    rule = decider.config.admission
    assert outcome.predicted_s == pytest.approx(rule.completion_s(0, latency("ac-k25"), 0.0))
    swapped = routed(decider, view(decider, {"w1": 0.97}))
    assert swapped.decision.worker_id == "w1"


def test_a_closer_neighbour_wins_when_both_allow_a_step_and_a_queue_can_outweigh_it() -> None:
    decider = ac_policy({"w1": "ac-k25", "w2": "ac-k25"})
    # 0.80 allows K = 10 on w1; 0.90 allows K = 20 on w2, a shorter run
    assert routed(decider, view(decider, {"w1": 0.80, "w2": 0.90})).decision.worker_id == "w2"
    # a long queue on the neighbour's worker costs more than the steps it saves
    busy = view(decider, {"w2": 0.97}, queues={"w1": 0, "w2": 6})
    chosen = routed(decider, busy)
    assert chosen.decision.worker_id == "w1" and chosen.cache is not None
    assert chosen.cache.step == 0  # a miss on w1, priced as the full run
    rule = decider.config.admission
    assert chosen.predicted_s == pytest.approx(rule.completion_s(0, latency("ac-k0"), 0.0))


def test_below_the_floor_is_a_miss_and_blind_routing_never_asks() -> None:
    decider = ac_policy({"w1": "ac-k25", "w2": "ac-k25"})
    low = routed(decider, view(decider, {"w2": DEFAULT_RULE.floors[0][1] - 0.01}))
    assert low.cache is not None and low.cache.step == 0
    blind = ac_policy({"w1": "ac-k25", "w2": "ac-k25"}, cache_aware=False)
    snapshot = view(blind, {"w2": 0.99})
    outcome = routed(blind, snapshot)
    assert outcome.decision.worker_id == "w1" and outcome.cache is None
    assert ASKED == []


def test_an_edit_and_a_full_generation_level_never_look_at_the_caches() -> None:
    decider = ac_policy({"w1": "ac-k0", "w2": "ac-k0"})
    snapshot = view(decider, {"w2": 0.99})
    outcome = decider.route(AC.index("ac-k0"), REQUEST, snapshot, 60.0)
    assert isinstance(outcome, Admitted) and outcome.cache is None
    assert ASKED == []


def test_the_rule_gives_each_similarity_its_step_and_level() -> None:
    routing = CacheRouting(PROFILES, RULES)
    assert routing.looks_up(Strategy.AC, K25) and not routing.looks_up(Strategy.AC, 0)
    assert not routing.looks_up(Strategy.SM, K25)
    assert routing.allowed(K25, None) == (0, 0)
    assert routing.allowed(K25, 0.99) == (25, K25)
    assert routing.allowed(AC.index("ac-k10"), 0.99) == (10, AC.index("ac-k10"))
    assert routing.allowed(K25, 0.80) == (10, AC.index("ac-k10"))


# -- the simulator -----------------------------------------------------------------------------


def text_embed(texts: Sequence[str]) -> np.ndarray:
    """Deterministic stand-in for the encoder: each text its own seeded random direction, so
    only a prompt's own copy is a close neighbour."""
    rows = [np.random.default_rng(list(text.encode()) or [0]).normal(size=64) for text in texts]
    return np.asarray(rows, dtype=np.float32)


def realistic_runs(names: Sequence[str]) -> dict[str, RunResult]:
    """Four workers whose caches each hold a quarter of the prompts the requests will use."""
    workload = poisson(mean_qpm=150.0, duration_min=2, seed=2)
    quality = {
        s: synthetic_quality_table(
            workload.prompts, s, [lv.name for lv in PROFILES.levels_for(s)], seed=2
        )
        for s in Strategy
    }
    warm = tuple(dict.fromkeys(record.prompt for record in workload.prompts))
    config = SimConfig(
        gpus=4,
        seed=2,
        cache="realistic",
        cache_warm=warm,
        cache_warm_dealt=True,
        cache_rules=tuple(RULES.items()),
    )
    sim = Simulation(PROFILES, quality, workload, config, embed=text_embed)
    runs = {}
    for name in names:
        policy = make_policy(
            name,
            classifier=NoisyOracleClassifier(0.8, seed=2),
            seed=2,
            strategy_choice="ac-first",
        )
        runs[name] = sim.run(policy)
    return runs


def test_the_simulated_argus_finds_closer_neighbours_than_argus_text() -> None:
    runs = realistic_runs(["argus", "argus-text"])
    aware, text = (summarise(runs[n]) for n in ("argus", "argus-text"))
    assert aware.cache_lookups > 50 and text.cache_lookups > 50
    # every prompt's copy is on one worker of four: blind, a lookup finds it about one time
    # in four (or where an earlier miss fed it); cache-aware, nearly always
    assert text.hit_rate < 0.6
    assert aware.hit_rate > 0.9
    assert aware.mean_similarity > text.mean_similarity


def test_dealt_warm_prompts_give_each_worker_its_share() -> None:
    vectors = np.eye(6, dtype=np.float32)
    setup = CacheSetup(
        vectors=vectors,
        warm=(0, 1, 2, 3, 4, 5),
        warm_models=("sdxl",),
        rules=RULES,
        cached_steps={"sdxl": (5, 10, 15, 20, 25)},
        adapter_keys=[()] * 6,
        capacity=10,
        eviction=Eviction.LRU,
        warm_dealt=True,
    )
    caches = ClusterCache(setup, 3)
    for worker in range(3):
        for row in range(6):
            similarity = caches.similarity(worker, row, row, "sdxl", 0.0)
            holds = row % 3 == worker
            assert (similarity == pytest.approx(1.0)) is holds
    everyone = ClusterCache(replace(setup, warm_dealt=False), 3)
    assert all(
        everyone.similarity(w, r, r, "sdxl", 0.0) == pytest.approx(1.0)
        for w in range(3)
        for r in range(6)
    )


def test_a_plan_serving_sm_still_learns_what_the_caches_hold() -> None:
    workload = poisson(mean_qpm=120.0, duration_min=1, seed=4)
    short = Workload(workload.name, workload.arrivals_s, workload.prompts[:40], "40 prompts")
    quality = {
        s: synthetic_quality_table(short.prompts, s, [lv.name for lv in PROFILES.levels_for(s)])
        for s in Strategy
    }
    config = SimConfig(gpus=2, seed=4, cache="realistic", cache_rules=tuple(RULES.items()))
    sim = Simulation(PROFILES, quality, short, config, embed=text_embed)
    counts = {}
    for name in ("argus", "argus-text"):
        policy = make_policy(name, classifier=NoisyOracleClassifier(0.8, seed=4), seed=4)
        policy.config = replace(  # type: ignore[attr-defined]
            policy.config,  # type: ignore[attr-defined]
            control=replace(policy.config.control, strategies=(Strategy.SM,)),  # type: ignore[attr-defined]
        )
        result = sim.run(policy)
        assert summarise(result).cache_lookups == 0  # SM only: nothing looks the cache up
        outlook = policy.control._allocator.cache_outlook  # type: ignore[attr-defined]
        counts[name] = sum(row.total for row in outlook.levels.values())
    # the cache-aware router probes every request; the blind one has no lookup to report
    assert counts["argus"] > 0 and counts["argus-text"] == 0
    assert not math.isnan(counts["argus"])
