"""The planner's view of the cache evidence: AC service times and Q(v | c) as expectations over
similarity bins, the cold-start prior, the control's ageing, and the simulator feeding it."""

from __future__ import annotations

import math

import pytest

from argus.allocator.cache_plan import CachePlanner
from argus.allocator.config import ControlConfig
from argus.allocator.control import AllocatorControl
from argus.allocator.planner import make_plan
from argus.contracts.cache_outlook import BinCounts, CacheOutlook
from argus.profiles import default_profiles
from argus.types import ClassQuality, ClusterView, LoadForecast, Strategy

pytestmark = pytest.mark.unit

PROFILES = default_profiles()
AC = PROFILES.levels_for(Strategy.AC)  # ac-k0 … ac-k25
K25 = AC[-1]
BINS = 6  # the default rule's five floors plus the miss bin
TINY = 1e-9  # a prior too small to move a figure


def counts(**by_level: tuple[dict[int, float], float]) -> CacheOutlook:
    """``level=({bin: lookups}, similarity of each)`` → an outlook."""
    levels = {}
    for name, (bins, similarity) in by_level.items():
        row = [0.0] * BINS
        sums = [0.0] * BINS
        for index, n in bins.items():
            row[index] = n
            sums[index] = 0.0 if index == 0 else n * similarity
        levels[name.replace("_", "-")] = BinCounts(tuple(row), tuple(sums))
    return CacheOutlook(levels)


def test_a_level_missing_half_its_lookups_costs_the_mix_of_its_hit_and_k0_times() -> None:
    planner = CachePlanner(prior_lookups=TINY, lookup_s=0.25)
    outlook = counts(ac_k25=({0: 50.0, 5: 50.0}, 1.0))
    planned = planner.profiles(PROFILES, outlook)
    hit = PROFILES.profile("a100", "ac-k25")
    full = PROFILES.profile("a100", "ac-k0").latency_s
    expected = 0.5 * (full + 0.25) + 0.5 * hit.latency_s
    got = planned.profile("a100", "ac-k25")
    assert hit.latency_s < got.latency_s < full + 0.25
    assert got.latency_s == pytest.approx(expected, rel=1e-6)
    assert got.throughput_qpm == pytest.approx(
        hit.throughput_qpm * hit.latency_s / expected, rel=1e-6
    )
    # K = 0 runs no lookup and SM levels none: unchanged
    assert planned.profile("a100", "ac-k0") == PROFILES.profile("a100", "ac-k0")
    sm = PROFILES.levels_for(Strategy.SM)[0].name
    assert planned.profile("a100", sm) == PROFILES.profile("a100", sm)


def test_a_hit_resumes_only_where_its_bin_allows() -> None:
    # every lookup at similarity 0.85: K <= 15 whatever the ceiling
    planner = CachePlanner(prior_lookups=TINY)
    outlook = counts(ac_k25=({3: 100.0}, 0.85))
    planned = planner.profiles(PROFILES, outlook)
    k15 = PROFILES.profile("a100", "ac-k15").latency_s
    assert planned.profile("a100", "ac-k25").latency_s == pytest.approx(k15, rel=1e-6)


def test_quality_is_the_expectation_over_the_bins_with_the_reuse_loss() -> None:
    planner = CachePlanner(prior_lookups=TINY)
    quality = ClassQuality.from_levels(AC)
    outlook = counts(ac_k25=({0: 50.0, 5: 50.0}, 0.95))
    planned = planner.quality(PROFILES, quality, outlook)
    row = quality.quality[0]
    loss = planner.reuse.loss(0.95, 25) * max(row)
    assert planned.quality[0][-1] == pytest.approx(0.5 * row[0] + 0.5 * (row[-1] - loss))
    assert planned.quality[0][0] == row[0]  # K = 0 is what it was


def test_without_misses_and_with_identical_neighbours_the_plan_is_todays() -> None:
    planner = CachePlanner(prior_lookups=TINY)
    perfect = CacheOutlook(
        {level.name: BinCounts((0.0,) * 5 + (100.0,), (0.0,) * 5 + (100.0,)) for level in AC}
    )
    quality = ClassQuality.from_levels(AC)
    profiles = planner.profiles(PROFILES, perfect)
    for key, entry in PROFILES.table.items():
        assert profiles.table[key].latency_s == pytest.approx(entry.latency_s, rel=1e-6)
    planned_quality = planner.quality(PROFILES, quality, perfect)
    for row, today in zip(planned_quality.quality, quality.quality, strict=True):
        assert row == pytest.approx(today, rel=1e-6)
    workers, load = ClusterView.uniform(8), LoadForecast(160.0, 160.0, 160.0, 0.0)
    histogram = (5, 10, 40, 25, 10, 10)
    today = make_plan(PROFILES, Strategy.AC, workers, load, histogram, class_quality=quality)
    planned = make_plan(
        profiles, Strategy.AC, workers, load, histogram, class_quality=planned_quality
    )
    assert planned.allocation.assignment == today.allocation.assignment
    assert planned.allocation.objective == pytest.approx(today.allocation.objective, rel=1e-6)
    assert planned.shift_map == today.shift_map


def test_a_cold_start_is_neither_written_off_nor_perfect_and_borrows_other_levels() -> None:
    planner = CachePlanner()
    cold = planner.probabilities(CacheOutlook(), K25)
    assert cold == pytest.approx((1 / BINS,) * BINS)
    # only ac-k5 was looked up, and it always missed: ac-k25 leans that way too, not all
    seen = counts(ac_k5=({0: 200.0}, math.nan))
    borrowed = planner.probabilities(seen, K25)
    assert 1 / BINS < borrowed[0] < 1.0
    own = planner.probabilities(seen, AC[1])
    assert own[0] > borrowed[0]


def test_the_control_ages_the_evidence_and_plans_ac_with_it() -> None:
    now = [0.0]
    planner = CachePlanner(half_life_s=60.0)
    control = AllocatorControl(
        PROFILES, ControlConfig(), clock=lambda: now[0], epoch="t", cache=planner
    )
    control.report_cache(counts(ac_k25=({0: 10.0}, math.nan)))
    now[0] = 60.0
    control.report_cache(counts(ac_k25=({0: 10.0}, math.nan)))
    outlook = control._allocator.cache_outlook
    assert outlook.levels["ac-k25"].counts[0] == pytest.approx(15.0)
    # a plain control ignores the lookups: it plans every AC request as a hit
    plain = AllocatorControl(PROFILES, ControlConfig(), clock=lambda: now[0], epoch="t")
    plain.report_cache(counts(ac_k25=({0: 10.0}, math.nan)))
    assert plain._allocator.cache_outlook == CacheOutlook()


def test_planning_with_misses_serves_fewer_requests_from_the_same_workers() -> None:
    """Capacity counts the misses: with every lookup missing, the AC plan of the same cluster
    can serve less than the plan that takes every AC request for a hit."""
    workers = ClusterView.uniform(4)
    load = LoadForecast(1000.0, 1000.0, 1000.0, 0.0)
    histogram = (1, 1, 1, 1, 1, 10)
    missing = counts(**{level.name.replace("-", "_"): ({0: 100.0}, math.nan) for level in AC})
    planner = CachePlanner(prior_lookups=TINY)
    today = make_plan(PROFILES, Strategy.AC, workers, load, histogram)
    planned = make_plan(
        planner.profiles(PROFILES, missing),
        Strategy.AC,
        workers,
        load,
        histogram,
        class_quality=planner.quality(PROFILES, ClassQuality.from_levels(AC), missing),
    )
    assert planned.allocation.served_qpm < today.allocation.served_qpm
