import random
from collections import Counter

import pytest

from argus.router.scheduler import NoLiveWorkerError, PromptScheduler
from argus.types import ShiftMap

pytestmark = pytest.mark.unit


LEVELS = ("k0", "k10", "k20")


def scheduler(matrix, workers_by_level, seed=7):
    return PromptScheduler(ShiftMap(LEVELS, matrix), workers_by_level, random.Random(seed))


IDENTITY = ShiftMap.identity(LEVELS).matrix
LEVELS_RANGE = range(len(LEVELS))
WORKERS = {"k0": [("a", 4.0), ("b", 2.0)], "k10": [("c", 3.0)], "k20": [("d", 2.0)]}


def test_samples_follow_the_pasm_row():
    matrix = ((0.2, 0.5, 0.3), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    sched = scheduler(matrix, WORKERS)
    counts = Counter(sched.route(0, {}).target_level for _ in range(20000))
    for level, p in enumerate(matrix[0]):
        assert counts[level] / 20000 == pytest.approx(p, abs=0.015)


def test_zero_probability_levels_are_never_sampled():
    matrix = ((0.0, 1.0, 0.0), (0.0, 1.0, 0.0), (0.5, 0.0, 0.5))
    sched = scheduler(matrix, WORKERS)
    targets = {sched.route(2, {}).target_level for _ in range(5000)}
    assert targets == {0, 2}
    assert {sched.route(0, {}).target_level for _ in range(1000)} == {1}


def test_same_seed_same_decisions():
    matrix = ((0.2, 0.5, 0.3), (0.3, 0.4, 0.3), (0.1, 0.1, 0.8))
    first = scheduler(matrix, WORKERS, seed=3)
    second = scheduler(matrix, WORKERS, seed=3)
    a = [first.route(i % 3, {}) for i in range(200)]
    b = [second.route(i % 3, {}) for i in range(200)]
    assert a == b


def test_picks_least_expected_completion_time():
    sched = scheduler(IDENTITY, WORKERS)
    # idle: the faster worker b (2 s) beats a (4 s) even though the paper's R*t is 0 for both
    assert sched.route(0, {}).worker_id == "b"
    # b has 2 queued: (2+1)*2 = 6 > (0+1)*4 = 4
    decision = sched.route(0, {"b": 2})
    assert (decision.worker_id, decision.score) == ("a", 4.0)


def test_ties_go_to_the_lowest_worker_id():
    sched = scheduler(IDENTITY, {"k0": [("z", 2.0), ("m", 2.0)], "k10": [("c", 1.0)], "k20": []})
    assert sched.route(0, {}).worker_id == "m"


def test_falls_back_to_nearest_level_and_counts_it():
    sched = scheduler(IDENTITY, WORKERS)
    decision = sched.route(1, {}, down={"c"})
    # k0 and k20 are equally near k10: the slower, better level wins
    assert (decision.served_level, decision.fallback) == (0, True)
    assert sched.route(2, {}, down={"d"}).served_level == 1
    assert sched.stats().fallbacks == 2
    assert sched.stats().decisions == 2


def test_level_without_workers_falls_back():
    sched = scheduler(IDENTITY, {"k0": [("a", 1.0)], "k10": [], "k20": []})
    decision = sched.route(2, {})
    assert (decision.worker_id, decision.served_level, decision.fallback) == ("a", 0, True)


def test_every_worker_down_raises():
    sched = scheduler(IDENTITY, WORKERS)
    with pytest.raises(NoLiveWorkerError):
        sched.route(0, {}, down={"a", "b", "c", "d"})


@pytest.mark.parametrize("level", [-1, 3])
def test_out_of_range_level_is_named(level):
    with pytest.raises(ValueError, match="optimal_level"):
        scheduler(IDENTITY, WORKERS).route(level, {})


def test_max_level_caps_sampled_and_served_levels():
    # every prompt would go to the fastest level; a minimum quality of level 1 caps it there
    fastest = tuple(
        tuple(1.0 if j == len(LEVELS) - 1 else 0.0 for j in LEVELS_RANGE) for _ in LEVELS
    )
    workers = {level: [(f"w-{level}", 1.0)] for level in LEVELS}
    sched = scheduler(fastest, workers)
    for optimal in LEVELS_RANGE:
        decision = sched.route(optimal, {}, max_level=1)
        assert decision.target_level <= 1 and decision.served_level <= 1
    # no worker at an allowed level: nothing faster is served instead
    only_fast = {LEVELS[-1]: [("w-fast", 1.0)]}
    with pytest.raises(NoLiveWorkerError, match="allowed level"):
        scheduler(IDENTITY, only_fast).route(0, {}, max_level=1)
    # without a cap the same scheduler serves the fast worker
    assert scheduler(IDENTITY, only_fast).route(0, {}).worker_id == "w-fast"
