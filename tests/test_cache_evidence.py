"""The similarity → K rule, its bins, the SYNTHETIC reuse quality and the profile's cache table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from argus.profiles import ProfileError, load_cache_rules, load_profiles
from argus.profiles.cache_evidence import DEFAULT_RULE, KRule, ReuseQuality

pytestmark = pytest.mark.unit

RULE = KRule(((5, 0.65), (10, 0.75), (15, 0.82), (20, 0.88), (25, 0.93)))


@pytest.mark.parametrize(
    ("similarity", "expected"),
    [(0.2, 0), (0.6499, 0), (0.65, 5), (0.74, 5), (0.75, 10), (0.85, 15), (0.9, 20), (0.99, 25)],
)
def test_the_largest_step_the_similarity_allows(similarity: float, expected: int) -> None:
    assert RULE.allowed_step(similarity, 25) == expected


def test_below_the_lowest_floor_is_a_miss_at_any_ceiling() -> None:
    for ceiling in (5, 10, 25, 50):
        assert RULE.allowed_step(0.64, ceiling) == 0
    assert RULE.allowed_step(math.nan, 25) == 0  # no neighbour at all


def test_never_above_the_ceiling_nor_outside_the_cached_steps() -> None:
    assert RULE.allowed_step(1.0, 10) == 10
    assert RULE.allowed_step(1.0, 12) == 10
    assert RULE.allowed_step(1.0, 4) == 0
    assert RULE.allowed_step(0.9, 25, cached_steps=(5, 10)) == 10
    assert RULE.allowed_step(0.9, 25, cached_steps=()) == 0
    # a step between two K needs the larger K's floor; above the table, never
    assert RULE.allowed_step(0.80, 25, cached_steps=(12,)) == 0
    assert RULE.allowed_step(0.82, 25, cached_steps=(12,)) == 12
    assert RULE.allowed_step(1.0, 40, cached_steps=(30,)) == 0


def test_a_rule_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="ascending"):
        KRule(((10, 0.7), (5, 0.8)))
    with pytest.raises(ValueError, match="may not need less"):
        KRule(((5, 0.8), (10, 0.7)))
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        KRule(((5, 1.5),))


def test_bins_follow_the_floors() -> None:
    bins = RULE.bins()
    assert len(bins) == 6
    assert [bins.index(s) for s in (math.nan, 0.1, 0.65, 0.8, 0.85, 0.9, 0.95)] == [
        0,
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert [bins.max_step(i) for i in range(6)] == [0, 5, 10, 15, 20, 25]
    assert bins.lower(0) == -1.0 and bins.lower(3) == 0.82
    assert bins.labels()[0] == "miss (< 0.65)" and bins.labels()[-1] == "K<=25 [0.93, 1]"
    for s in (0.66, 0.77, 0.84, 0.9, 0.97):  # a bin's K is the rule's at its lower edge
        assert bins.max_step(bins.index(s)) == RULE.allowed_step(s, 25)


def test_reuse_quality_is_the_table_at_similarity_one_and_falls_with_it() -> None:
    quality = ReuseQuality()
    assert quality.score(19.0, 21.0, 1.0, 25) == 19.0
    assert quality.score(19.0, 21.0, 0.3, 0) == 19.0  # a full generation reuses nothing
    scores = [quality.score(19.0, 21.0, s, 25) for s in (1.0, 0.95, 0.9, 0.8)]
    assert scores == sorted(scores, reverse=True) and scores[-1] < scores[0]
    # more steps reused from the same neighbour cost more
    assert quality.score(20.0, 21.0, 0.9, 5) - 20.0 > quality.score(20.0, 21.0, 0.9, 25) - 20.0
    assert quality.loss(0.93, 25) == pytest.approx(0.5 * 0.07)
    assert quality.score(1.0, 21.0, -1.0, 50) > 0.0


def test_the_default_profile_carries_the_rule() -> None:
    rules = load_cache_rules("default")
    assert rules["sdxl"].floors == DEFAULT_RULE.floors
    assert load_cache_rules("default:monolithic") == rules


def test_a_profile_cache_table_is_checked(tmp_path: Path) -> None:
    text = Path("argus/profiles/default.toml").read_text(encoding="utf-8")
    good = tmp_path / "good.toml"
    good.write_text(text + '\n[models."sd-1.5".cache]\nfloors = { 10 = 0.7 }\n')
    load_profiles(good)
    assert load_cache_rules(good)["sd-1.5"].floors == ((10, 0.7),)
    bad = tmp_path / "bad.toml"
    bad.write_text(text + '\n[models."sd-1.5".cache]\nfloors = { 10 = 0.7, 5 = 0.9 }\n')
    with pytest.raises(ProfileError, match=r"models\.sd-1\.5\.cache\.floors"):
        load_profiles(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text(text + '\n[models."sd-1.5".cache]\nfloor = { 10 = 0.7 }\n')
    with pytest.raises(ProfileError, match="unknown key"):
        load_cache_rules(typo)
