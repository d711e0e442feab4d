"""Tests of the Optimized Distribution Aligner (argus.allocator.oda)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from argus.allocator.oda import align
from argus.types import ShiftMap

pytestmark = pytest.mark.unit


Degradation = Callable[[int], float]


def names(n: int) -> tuple[str, ...]:
    return tuple(f"v{i}" for i in range(n))


def as_array(shift: ShiftMap) -> np.ndarray:
    array: np.ndarray = np.array(shift.matrix, dtype=float)
    return array


def normalised(values: Sequence[float]) -> np.ndarray:
    array: np.ndarray = np.array(values, dtype=float)
    result: np.ndarray = array / float(array.sum())
    return result


def transport(histogram: Sequence[float], shift: ShiftMap) -> np.ndarray:
    """T[origin][dest] = H[origin] * P[origin][dest], H normalised to 1."""
    return normalised(histogram)[:, None] * as_array(shift)


def expected_degradation(
    histogram: Sequence[float], shift: ShiftMap, degradation: Degradation
) -> float:
    """Argus Eq. 2 of a PASM, the tests' measure of ODA's plans: the expected quality loss per
    prompt, ``sum_i sum_{j > i} H[i] * P[i][j] * D(j - i)`` with H normalised to sum 1 (moves
    to slower levels cost nothing)."""
    moved = transport(histogram, shift)
    n = len(moved)
    return math.fsum(
        float(moved[i][j]) * degradation(j - i) for i in range(n) for j in range(i + 1, n)
    )


def square(g: int) -> float:
    return float(g * g)


# --- hand-worked examples -------------------------------------------------------------------


def test_identity_when_histogram_equals_load_share() -> None:
    h = [3.0, 1.0, 4.0, 1.0, 5.0]
    shift = align(h, h, names(5))
    assert shift == ShiftMap.identity(names(5))


def test_identity_when_scales_differ() -> None:
    # H counts prompts, F is QPM: same shape, different totals.
    shift = align([10, 20, 30, 40], [1.5, 3.0, 4.5, 6.0], names(4))
    np.testing.assert_allclose(as_array(shift), np.eye(4), atol=1e-12)
    assert expected_degradation([10, 20, 30, 40], shift, square) == pytest.approx(0.0, abs=1e-15)


def test_excess_pushed_left_when_load_is_on_slow_levels() -> None:
    # All load on the slowest level: everyone moves there, at no quality cost.
    shift = align([1, 1, 1, 1], [4, 0, 0, 0], names(4))
    np.testing.assert_allclose(as_array(shift), [[1, 0, 0, 0]] * 4, atol=1e-15)
    assert expected_degradation([1, 1, 1, 1], shift, square) == 0.0


def test_excess_keeps_natives_home() -> None:
    # H = [0, .5, .5], F = [.5, .5, 0]: level 2 pushes .5 into level 1, which now holds .5 of
    # its own natives and .5 of origin 2. The excess that continues to level 0 is origin 2's,
    # so level 1's natives stay home.
    shift = align([0, 1, 1], [1, 1, 0], names(3))
    np.testing.assert_allclose(as_array(shift), [[1, 0, 0], [0, 1, 0], [1, 0, 0]], atol=1e-15)


def test_partial_excess() -> None:
    # H = [.2, .3, .5], F = [.4, .4, .2]: level 2 keeps .2 of its .5 and pushes .3; level 1
    # then holds .3 native + .3 of origin 2 against F = .4, so .2 of origin 2 goes on to 0.
    shift = align([0.2, 0.3, 0.5], [0.4, 0.4, 0.2], names(3))
    expected = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.4, 0.2, 0.4]]
    np.testing.assert_allclose(as_array(shift), expected, atol=1e-12)


def test_deficit_pulled_from_nearest_level_first() -> None:
    # H = [.5, .5, 0], F = [0, .5, .5]: level 2 takes level 1's prompts (gap 1), level 1 then
    # takes level 0's prompts (gap 1). Jumping 0 -> 2 would cost D(2) instead.
    shift = align([1, 1, 0], [0, 1, 1], names(3))
    np.testing.assert_allclose(as_array(shift), [[0, 1, 0], [0, 0, 1], [0, 0, 1]], atol=1e-15)
    assert expected_degradation([1, 1, 0], shift, square) == pytest.approx(1.0)


def test_deficit_spans_several_levels() -> None:
    # H = [.6, .4, 0, 0], F = [0, 0, .5, .5]: level 3 drains level 2 (empty), then takes .4 of
    # origin 1 and .1 of origin 0; level 2 takes the remaining .5 of origin 0.
    shift = align([0.6, 0.4, 0, 0], [0, 0, 0.5, 0.5], names(4))
    expected = [
        [0.0, 0.0, 5 / 6, 1 / 6],
        [0.0, 0.0, 0.0, 1.0],
        [0.0, 0.0, 1.0, 0.0],
        [0.0] * 3 + [1.0],
    ]
    np.testing.assert_allclose(as_array(shift), expected, atol=1e-12)
    cost = 0.4 * square(2) + 0.1 * square(3) + 0.5 * square(2)
    assert expected_degradation([0.6, 0.4, 0, 0], shift, square) == pytest.approx(cost)


def test_single_level() -> None:
    assert align([7], [3], ("only",)) == ShiftMap.identity(("only",))


def test_zero_mass_row_stays_home_when_its_level_has_load() -> None:
    shift = align([1, 0, 1], [1, 1, 0], names(3))
    assert shift.row(1) == (0.0, 1.0, 0.0)


def test_zero_mass_row_goes_to_nearest_level_with_load() -> None:
    shift = align([1, 0, 0, 0, 1], [1, 0, 0, 1, 1], names(5))
    assert shift.row(1) == (1.0, 0.0, 0.0, 0.0, 0.0)  # level 0 is one step away
    assert shift.row(2) == (0.0, 0.0, 0.0, 1.0, 0.0)  # level 3 is one step away, level 0 two


def test_zero_mass_row_tie_goes_to_slower_level() -> None:
    shift = align([1, 0, 1], [1, 0, 1], names(3))
    assert shift.row(1) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("histogram", "load_share", "argument"),
    [
        ([1, 1], [1, 1, 1], "histogram"),
        ([1, 1, 1], [1, 1], "load_share"),
        ([1, -1, 1], [1, 1, 1], "histogram"),
        ([1, 1, 1], [1, math.nan, 1], "load_share"),
        ([1, math.inf, 1], [1, 1, 1], "histogram"),
        ([0, 0, 0], [1, 1, 1], "histogram"),
        ([1, 1, 1], [0, 0, 0], "load_share"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(
    histogram: list[float], load_share: list[float], argument: str
) -> None:
    with pytest.raises(ValueError, match=argument):
        align(histogram, load_share, names(3))


def test_huge_values_do_not_overflow() -> None:
    shift = align([1e308, 1e308, 1e308], [5e-324, 5e-324, 5e-324], names(3))
    np.testing.assert_allclose(as_array(shift), np.eye(3), atol=1e-12)


# --- property tests -------------------------------------------------------------------------

entry = st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=100.0))


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[float], list[float]]:
    """Random H and F of one length (2-12), non-negative with some zeros, random scales."""
    n = draw(st.integers(min_value=2, max_value=12))
    vector = st.lists(entry, min_size=n, max_size=n).filter(lambda v: sum(v) > 0.0)
    h, f = draw(vector), draw(vector)
    scale = draw(st.sampled_from([1e-3, 1.0, 60.0, 1e4]))
    return h, [scale * x for x in f]


@st.composite
def convex_degradations(draw: st.DrawFn) -> Degradation:
    """A random convex, non-decreasing D with D(0) = 0, as a power law or cumulative sums."""
    if draw(st.booleans()):
        a = draw(st.floats(min_value=0.01, max_value=1.0))
        p = draw(st.floats(min_value=1.0, max_value=3.0))
        return lambda g: a * float(g) ** p
    steps = draw(st.lists(st.floats(min_value=1e-3, max_value=10.0), min_size=11, max_size=11))
    values = [0.0, *np.cumsum(sorted(steps)).tolist()]
    return lambda g: values[g]


def lp_optimum(h: np.ndarray, f: np.ndarray, degradation: Degradation) -> float:
    """min sum_{i, j > i} T_ij D(j - i) s.t. row sums h, column sums f, T >= 0 (HiGHS)."""
    n = len(h)
    cost = [degradation(j - i) if j > i else 0.0 for i in range(n) for j in range(n)]
    rows = np.kron(np.eye(n), np.ones(n))
    cols = np.kron(np.ones(n), np.eye(n))
    result = linprog(
        cost,
        A_eq=np.vstack([rows, cols]),
        b_eq=np.concatenate([h, f]),
        bounds=(0, None),
        method="highs",
    )
    assert result.status == 0, result.message
    return float(result.fun)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_rows_are_distributions_and_load_is_met(instance: tuple[list[float], list[float]]) -> None:
    h, f = instance
    shift = align(h, f, names(len(h)))
    matrix = as_array(shift)
    assert shift.levels == names(len(h))
    assert (matrix >= 0.0).all()
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(normalised(h) @ matrix, normalised(f), rtol=0, atol=1e-9)
    # no prompt, however rare its class, is ever sent to a level that takes no load
    idle = np.asarray(f) == 0.0
    assert (matrix[:, idle] == 0.0).all()


@settings(max_examples=300, deadline=None)
@given(instances(), convex_degradations())
def test_expected_degradation_matches_lp_optimum(
    instance: tuple[list[float], list[float]], degradation: Degradation
) -> None:
    h, f = instance
    shift = align(h, f, names(len(h)))
    ours = expected_degradation(h, shift, degradation)
    best = lp_optimum(normalised(h), normalised(f), degradation)
    assert ours == pytest.approx(best, abs=1e-6)  # H normalised: total load is 1


@settings(max_examples=300, deadline=None)
@given(instances())
def test_no_move_to_faster_level_while_a_slower_level_has_room(
    instance: tuple[list[float], list[float]],
) -> None:
    # Origin o may go faster only if the levels <= o are filled by origins <= o alone, i.e.
    # nothing from a faster origin took a place that o's prompts could have had for free.
    h, f = instance
    n = len(h)
    plan = transport(h, align(h, f, names(n)))
    share = normalised(f)
    for origin in range(n):
        if plan[origin, origin + 1 :].sum() > 1e-12:
            filled_by_slower = plan[: origin + 1, : origin + 1].sum()
            assert filled_by_slower == pytest.approx(share[: origin + 1].sum(), abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_crossing_only_what_is_needed(instance: tuple[list[float], list[float]]) -> None:
    # Across each boundary, exactly the unavoidable mass moves up and none moves both ways.
    h, f = instance
    n = len(h)
    plan = transport(h, align(h, f, names(n)))
    hn, fn = normalised(h), normalised(f)
    for t in range(1, n):
        up = plan[:t, t:].sum()
        down = plan[t:, :t].sum()
        assert up == pytest.approx(max(0.0, fn[t:].sum() - hn[t:].sum()), abs=1e-9)
        assert min(up, down) <= 1e-12
