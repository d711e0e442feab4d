"""The ControlNet cache: LRU and LFU eviction by count and by bytes, leases, single flight."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from argus.worker.adapters.controlnet.cache import ModelCache, Policy

pytestmark = pytest.mark.unit


SIZES = {"a": 10, "b": 20, "c": 30, "d": 40, "e": 50}


class Loader:
    """A fake loader: the 'model' is its key; counts loads; can be made to block or fail."""

    def __init__(self) -> None:
        self.loads: Counter[str] = Counter()
        self.gate: threading.Event | None = None
        self.fail: set[str] = set()

    def __call__(self, key: str) -> str:
        self.loads[key] += 1
        if self.gate is not None:
            assert self.gate.wait(10)
        if key in self.fail:
            raise OSError(f"{key}: corrupt weights")
        return key


def make_cache(policy: str = "lru", **bounds: int) -> tuple[ModelCache[str], Loader]:
    loader = Loader()
    cache = ModelCache(loader, size_of=SIZES.__getitem__, policy=Policy.parse(policy), **bounds)
    return cache, loader


def use(cache: ModelCache[str], *keys: str) -> None:
    for key in keys:
        cache.acquire(key).release()


def test_lru_by_count_evicts_the_least_recently_used() -> None:
    cache, loader = make_cache("lru", max_entries=2)
    use(cache, "a", "b", "a", "c")  # b is the least recently used when c arrives
    assert set(cache.stats().resident) == {"a", "c"}
    use(cache, "b")
    stats = cache.stats()
    assert stats.resident == ("c", "b")
    assert (stats.hits, stats.misses, stats.loads, stats.evictions) == (1, 4, 4, 2)
    assert loader.loads == Counter({"a": 1, "b": 2, "c": 1})


def test_lfu_by_count_keeps_the_popular_ones_even_after_a_burst() -> None:
    cache, _ = make_cache("lfu", max_entries=2)
    use(cache, "a", "a", "a", "a", "b", "b", "c")  # c pushes out b (2 requests), not a (4)
    assert set(cache.stats().resident) == {"a", "c"}
    use(cache, "b")  # b now has 3 requests; c, with 1, goes
    assert set(cache.stats().resident) == {"a", "b"}
    use(cache, "d", "e")  # newcomers displace b (3), then each other, never a (4)
    stats = cache.stats()
    assert set(stats.resident) == {"a", "e"}
    assert stats.policy == "lfu"
    # LRU on the same sequence would have dropped a, the least recently used
    lru, _ = make_cache("lru", max_entries=2)
    use(lru, "a", "a", "a", "a", "b", "b", "c", "b", "d", "e")
    assert set(lru.stats().resident) == {"d", "e"}


def test_lfu_ties_are_broken_by_recency() -> None:
    cache, _ = make_cache("lfu", max_entries=2)
    use(cache, "a", "b", "c")  # all once: a is the oldest
    assert set(cache.stats().resident) == {"b", "c"}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bytes_bound_evicts_until_the_budget_holds(policy: str) -> None:
    cache, _ = make_cache(policy, max_bytes=60)
    use(cache, "a", "b", "c")  # 10 + 20 + 30 = 60 fits
    assert cache.stats().resident_bytes == 60
    use(cache, "d")  # 40 more: a (10) and b (20) must go, in policy order, to fit 30 + 40 > 60
    stats = cache.stats()
    assert stats.resident_bytes <= 60
    assert "d" in stats.resident
    assert stats.evictions >= 2


def test_estimates_make_room_before_a_load() -> None:
    seen: list[tuple[str, ...]] = []
    loader = Loader()

    def load(key: str) -> str:
        seen.append(cache.stats().resident)  # what is resident while the load runs
        return loader(key)

    cache: ModelCache[str] = ModelCache(
        load, size_of=SIZES.__getitem__, estimate=SIZES.__getitem__, max_bytes=50
    )
    use(cache, "a", "b", "d")
    assert seen[-1] == ()  # a and b were evicted before d (40) loaded, not after
    assert cache.stats().resident == ("d",)


def test_a_model_larger_than_the_budget_is_served_but_not_kept() -> None:
    cache, _ = make_cache(max_bytes=30)
    with cache.acquire("e") as lease:  # 50 bytes
        assert lease.value == "e"
        assert cache.stats().resident == ("e",)  # held while in use
    assert cache.stats().resident == ()


def test_leased_entries_are_not_evicted_until_released() -> None:
    cache, _ = make_cache(max_entries=1)
    lease = cache.acquire("a")
    use(cache, "b")  # a is in use: the cache goes over its bound instead of dropping it
    stats = cache.stats()
    assert "a" in stats.resident
    assert stats.leased == 1
    lease.release()
    lease.release()  # idempotent
    assert len(cache.stats().resident) == 1


def test_concurrent_misses_on_a_cold_key_load_it_once() -> None:
    cache, loader = make_cache(max_entries=4)
    loader.gate = threading.Event()
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(cache.acquire, "c") for _ in range(6)]
        while cache.stats().misses < 6:  # everyone is waiting on the one load
            threading.Event().wait(0.01)
        loader.gate.set()
        leases = [f.result(timeout=10) for f in futures]
    assert loader.loads["c"] == 1
    stats = cache.stats()
    assert (stats.misses, stats.loads, stats.hits) == (6, 1, 0)
    assert {lease.value for lease in leases} == {"c"}
    assert not any(lease.hit for lease in leases)
    for lease in leases:
        lease.release()
    assert cache.stats().leased == 0
    assert cache.acquire("c").hit


def test_a_failed_load_reaches_every_waiter_and_is_retried_next_time() -> None:
    cache, loader = make_cache(max_entries=4)
    loader.fail.add("b")
    loader.gate = threading.Event()
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(cache.acquire, "b") for _ in range(3)]
        while cache.stats().misses < 3:
            threading.Event().wait(0.01)
        loader.gate.set()
        for future in futures:
            with pytest.raises(OSError, match="corrupt"):
                future.result(timeout=10)
    stats = cache.stats()
    assert (stats.loads, stats.load_failures, stats.resident) == (1, 1, ())
    loader.fail.clear()
    loader.gate = None
    assert cache.acquire("b").value == "b"
    assert loader.loads["b"] == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries 0"):
        make_cache(max_entries=0)
    with pytest.raises(ValueError, match="'mru'"):
        Policy.parse("mru")
