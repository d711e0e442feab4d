"""The live router routes on its workers' approximate caches (argus/router/cache_mirror.py):
it sends each worker its cursor, mirrors the cache events their replies carry, sends an AC
prompt to the worker holding its close neighbour, forgets a restarted or truncated worker,
skips bad events while serving on, routes by Eq. 3 with the mirror off, and reports its
probes to the allocator, whose cache planner prices AC levels with them. Driven without gRPC,
through RouterCore with fake workers that keep the workers' own event log."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client import CollectorRegistry

from argus.allocator.cache_plan import CachePlanner
from argus.allocator.control import AllocatorControl, ControlConfig
from argus.allocator.feed import LatestFeed
from argus.allocator.service import AllocatorServicer
from argus.contracts.cache_outlook import CacheOutlook
from argus.contracts.generate import (
    CacheEvents,
    CacheEvict,
    CacheInsert,
    CacheKey,
    GenerateCall,
    GenerateResult,
)
from argus.contracts.plans import PublishedPlan
from argus.contracts.progress import ProgressSink
from argus.contracts.router_api import RouterRequest
from argus.contracts.routers import (
    RouterReport,
    router_report_from_pb,
    router_report_to_pb,
)
from argus.contracts.wire import FieldError
from argus.contracts.workers import WorkerReport
from argus.plumbing import rpc
from argus.profiles.cache_evidence import DEFAULT_RULE
from argus.router.app import PrometheusStats, StatsReporter
from argus.router.cache_mirror import CacheMirror
from argus.router.config import RouterServiceConfig, RoutingConfig
from argus.router.core import CallCancel, RouterCore, WorkerError
from argus.router.metrics import RouterMetrics
from argus.router.values import Refusal
from argus.types import Strategy
from argus.worker.approx_cache.events import CacheEventLog
from tests.router_cluster import PROFILES, FakeClock, StubClassifier

pytestmark = pytest.mark.unit

allocator_pb2: Any = rpc.load("allocator_pb2")

DIM = 8
STEPS, SIZE = 50, 64
LEVEL = "ac-k20"  # both workers serve it
PNG = b"\x89PNG\r\n\x1a\nfake"
FOX, FOX_AT_DUSK, BOAT = "a red fox", "a red fox at dusk", "a sail boat"


def unit(*parts: tuple[int, float]) -> tuple[float, ...]:
    vector = np.zeros(DIM, dtype=np.float32)
    for axis, value in parts:
        vector[axis] = value
    return tuple((vector / np.linalg.norm(vector)).tolist())


VECTORS = {FOX: unit((0, 1.0)), FOX_AT_DUSK: unit((0, 1.0), (1, 0.05)), BOAT: unit((3, 1.0))}


class FakeEncoder:
    """The workers' encoder as the test knows it: fixed vectors for the prompts above, a
    hashed direction for any other."""

    dim = DIM
    vectors_id = "fake-encoder-1"

    def __init__(self) -> None:
        self.embedded: list[str] = []

    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]:
        self.embedded.append(prompt)
        if prompt in VECTORS:
            return np.asarray(VECTORS[prompt], dtype=np.float32)
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
        vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
        return vector / np.linalg.norm(vector)


TAG = CacheKey("sdxl", "euler", SIZE, SIZE, STEPS).tag


class CachingWorkers:
    """A WorkerTransport of workers with the worker's own cache event log: a call answers
    with the events after its cursor, and an AC call with no neighbour of similarity 0.9 or
    more in the worker's cache (a miss, generated in full) caches its prompt.
    ``down_once``: workers whose first call fails UNAVAILABLE. ``extra``: events a worker's
    next reply carries on top of its log's (hand-made bad ones)."""

    def __init__(self, down_once: tuple[str, ...] = ()) -> None:
        self.logs: dict[str, CacheEventLog] = {}
        self.calls: list[tuple[str, GenerateCall]] = []
        self.down_once = set(down_once)
        self.extra: dict[str, tuple[object, ...]] = {}
        self.miss_reason: dict[str, str] = {}  # a worker's next reply's miss reason, once
        self.cached = 0
        self.held: dict[str, list[npt.NDArray[np.float32]]] = {}

    def log(self, worker: str) -> CacheEventLog:
        return self.logs.setdefault(worker, CacheEventLog(log_id=f"{worker}-1"))

    def generate(
        self,
        address: str,
        call: GenerateCall,
        *,
        timeout_s: float,
        cancel: CallCancel,
        progress: ProgressSink | None,
    ) -> GenerateResult:
        worker = address.removesuffix(":1")
        self.calls.append((worker, call))
        if worker in self.down_once:
            self.down_once.discard(worker)
            raise WorkerError(Refusal.UNAVAILABLE, "restarting")
        log = self.log(worker)
        vector = np.asarray(VECTORS[call.prompt], np.float32)
        held = self.held.setdefault(worker, [])
        if call.level.startswith("ac-") and all(float(v @ vector) < 0.9 for v in held):
            self.cached += 1
            held.append(vector)
            log.inserted(f"e{self.cached}", TAG, vector)
        events = None if call.cache_cursor is None else log.since(call.cache_cursor)
        extra = self.extra.pop(worker, ())
        if events is not None and extra:
            events = replace(events, events=events.events + extra)  # type: ignore[arg-type]
        return GenerateResult(
            request_id=call.request_id,
            png=PNG,
            level=call.level,
            worker_id=worker,
            cache_events=events,
            cache_miss_reason=self.miss_reason.pop(worker, ""),
        )

    def keep_only(self, addresses: set[str]) -> None:
        pass

    def close(self) -> None:
        pass


def plan_at(published: PublishedPlan, level: str) -> PublishedPlan:
    """``published`` with every worker at ``level`` and every prompt routed there."""
    plan = published.plan
    allocation = plan.allocation
    strategy = next(lv.strategy for lv in PROFILES.levels if lv.name == level)
    levels = tuple(lv.name for lv in PROFILES.levels_for(strategy))
    target = levels.index(level)
    count = len(allocation.assignment)
    n = len(levels)
    allocation = replace(
        allocation,
        strategy=strategy,
        levels=levels,
        assignment=dict.fromkeys(allocation.assignment, level),
        workers_per_level=tuple(count if i == target else 0 for i in range(n)),
        load_share_qpm=tuple(1.0 if i == target else 0.0 for i in range(n)),
    )
    rows = tuple(tuple(1.0 if j == target else 0.0 for j in range(n)) for _ in range(n))
    shift = replace(plan.shift_map, levels=levels, matrix=rows)
    plan = replace(plan, strategy=strategy, allocation=allocation, shift_map=shift)
    return replace(published, plan=replace(plan, histogram=(1.0 / n,) * n))


def make_core(
    workers: CachingWorkers,
    *,
    cache_aware: bool = True,
    metrics: RouterMetrics | None = None,
    encoder: FakeEncoder | None = None,
    level: str = LEVEL,
) -> tuple[RouterCore, FakeClock]:
    clock = FakeClock()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test"
    )
    for worker_id in ("w1", "w2"):
        control.heartbeat(WorkerReport(worker_id, f"{worker_id}:1", PROFILES.worker_classes[0]))
    published = plan_at(control.current, level)
    index = published.plan.allocation.levels.index(level)
    config = RouterServiceConfig(routing=RoutingConfig(cache_aware=cache_aware))
    core = RouterCore(
        PROFILES,
        StubClassifier(index),
        config,
        workers=workers,
        clock=clock,
        stats=PrometheusStats(metrics)
        if metrics is not None
        else PrometheusStats(RouterMetrics(PROFILES, CollectorRegistry())),
        embedder=encoder or FakeEncoder(),
    )
    assert core.install(published)
    return core, clock


def ask(core: RouterCore, prompt: str) -> Any:
    return core.generate(RouterRequest(prompt=prompt, width=SIZE, height=SIZE, steps=STEPS))


def warm_w2(core: RouterCore, workers: CachingWorkers, clock: FakeClock) -> None:
    """w1 fails once (marked down), so FOX misses on w2, which caches it; w1 is back after."""
    workers.down_once.add("w1")
    reply = ask(core, FOX)
    assert reply.worker_id == "w2" and reply.level == LEVEL  # an empty mirror knows nothing
    clock.now += 60.0  # w1's down mark expires
    assert core.cache is not None and core.cache.view.entries("w2") >= 1


# -- (a) the close neighbour's worker serves ------------------------------------------------


def test_a_prompt_goes_to_the_worker_holding_its_close_neighbour() -> None:
    workers = CachingWorkers()
    core, clock = make_core(workers)
    warm_w2(core, workers, clock)
    assert DEFAULT_RULE.allowed_step(0.99, 20, (5, 10, 15, 20)) == 20
    dusk = ask(core, FOX_AT_DUSK)  # Eq. 3 would pick w1 (equal queues, the lower id)
    assert dusk.worker_id == "w2" and dusk.level == LEVEL  # to resume at K = 20 on w2
    ask(core, BOAT)
    # every call carried the worker's cursor, advanced by the replies
    assert all(call.cache_cursor is not None for _, call in workers.calls)
    assert workers.calls[-1][1].cache_cursor.after == 1  # type: ignore[union-attr]


def test_the_call_carries_the_vector_the_router_embedded_so_the_worker_need_not() -> None:
    workers = CachingWorkers()
    core, clock = make_core(workers)
    warm_w2(core, workers, clock)
    ask(core, FOX_AT_DUSK)
    (_, fox), (_, dusk) = workers.calls[-2], workers.calls[-1]
    assert (fox.prompt_embedding, fox.prompt_encoder) == ((), "")  # an empty mirror: not embedded
    assert dusk.prompt_encoder == FakeEncoder.vectors_id
    assert dusk.prompt_embedding == pytest.approx(VECTORS[FOX_AT_DUSK], abs=1e-6)


def test_the_cache_choice_is_counted_in_the_metrics() -> None:
    workers = CachingWorkers()
    registry = CollectorRegistry()
    core, clock = make_core(workers, metrics=RouterMetrics(PROFILES, registry))
    warm_w2(core, workers, clock)
    ask(core, FOX_AT_DUSK)
    assert registry.get_sample_value("argus_router_cache_moved_total") == 1.0
    assert registry.get_sample_value("argus_router_cache_entries") == 1.0
    assert registry.get_sample_value("argus_router_cache_routed_step_sum") == 20.0
    assert registry.get_sample_value("argus_router_cache_routed_similarity_count") == 1.0
    # FOX came to an empty mirror: not embedded
    assert registry.get_sample_value("argus_router_cache_embed_seconds_count") == 1.0


def test_a_worker_whose_index_failed_is_not_routed_on_until_it_may_have_recovered() -> None:
    workers = CachingWorkers()
    core, clock = make_core(workers)
    warm_w2(core, workers, clock)
    workers.miss_reason["w2"] = "index-error"  # its search fails: served in full, said so
    assert ask(core, FOX_AT_DUSK).worker_id == "w2"
    # w2 still holds FOX, but its index cannot find it: priced as a miss, Eq. 3 picks w1
    assert ask(core, FOX_AT_DUSK).worker_id == "w1"
    assert core.cache is not None and core.cache.view.entries("w2") >= 1  # kept, not forgotten
    m = mirror()
    m.apply("w2", CacheEvents("log-1", 1, (insert("e1"),)))
    request = RouterRequest(prompt=FOX_AT_DUSK, width=SIZE, height=SIZE, steps=STEPS)
    found = m.look(request, STEPS)
    assert found is not None and found.neighbours("w2", "sdxl") is not None
    m.answered("w2", "below-floor")  # any other miss says nothing of the index
    m.answered("w2", "index-error")
    found = m.look(request, STEPS)
    assert found is not None and found.neighbours("w2", "sdxl") is None


def test_the_index_is_trusted_again_after_its_pause() -> None:
    now = [0.0]
    m = CacheMirror(
        PROFILES, FakeEncoder(), scheduler="euler", default_size=SIZE, clock=lambda: now[0]
    )
    m.apply("w2", CacheEvents("log-1", 1, (insert("e1"),)))
    request = RouterRequest(prompt=FOX, width=SIZE, height=SIZE, steps=STEPS)
    m.answered("w2", "index-error")
    assert m.look(request, STEPS).neighbours("w2", "sdxl") is None  # type: ignore[union-attr]
    now[0] += m.index_down_s + 0.1
    assert m.look(request, STEPS).neighbours("w2", "sdxl") == pytest.approx(1.0)  # type: ignore[union-attr]


# -- (b) restarts and gaps forget -----------------------------------------------------------


def mirror() -> CacheMirror:
    return CacheMirror(PROFILES, FakeEncoder(), scheduler="euler", default_size=SIZE)


def insert(entry: str, prompt: str = FOX) -> CacheInsert:
    return CacheInsert(entry, TAG, VECTORS[prompt])


def test_a_restarted_worker_is_forgotten_and_mirrored_anew() -> None:
    cache = mirror()
    cache.keep_only({"w1"})
    cache.apply("w1", CacheEvents("old", 2, (insert("a"), insert("b", BOAT))))
    assert cache.view.entries("w1") == 2 and cache.cursor("w1").after == 2
    cache.apply("w1", CacheEvents("new", 1, (insert("c"),)))  # a new process, a new log
    assert cache.view.entries("w1") == 1 and cache.cursor("w1").log_id == "new"
    cache.apply("w1", CacheEvents("old", 3, (insert("d"),)))  # a late reply of the old log
    assert cache.view.entries("w1") == 1 and cache.cursor("w1").log_id == "new"
    assert cache.stats().forgotten["restart"] == 1


def test_a_truncated_reply_forgets_unless_the_cursor_covers_the_gap() -> None:
    log = CacheEventLog(capacity=2, log_id="L")
    cache = mirror()
    log.inserted("a", TAG, np.asarray(VECTORS[FOX], np.float32))
    cache.apply("w1", log.since(cache.cursor("w1")))
    assert cache.view.entries("w1") == 1
    stale = cache.cursor("w1")
    for name in ("b", "c", "d"):  # "b" falls out of the log of 2
        log.inserted(name, TAG, np.asarray(VECTORS[BOAT], np.float32))
    late = log.since(stale)
    assert late.truncated
    cache.apply("w1", late)  # "a" may have been evicted in the gap: start over
    assert cache.view.entries("w1") == 2 and cache.stats().forgotten["truncated"] == 1
    log.evicted(["c"])
    cache.apply("w1", log.since(stale))  # truncated for that old cursor, not for ours
    assert cache.view.entries("w1") == 1 and cache.stats().forgotten["truncated"] == 1


def test_racing_replies_apply_each_event_once() -> None:
    log = CacheEventLog(log_id="L")
    cache = mirror()
    start = cache.cursor("w1")
    log.inserted("a", TAG, np.asarray(VECTORS[FOX], np.float32))
    first = log.since(start)
    log.evicted(["a"])
    second = log.since(start)  # sent with the same cursor, answered later
    cache.apply("w1", second)
    cache.apply("w1", first)  # overtaken: nothing new
    assert cache.view.entries("w1") == 0 and cache.stats().skipped["unknown_evict"] == 0


def test_a_worker_that_leaves_the_plan_is_forgotten() -> None:
    workers = CachingWorkers()
    core, clock = make_core(workers)
    warm_w2(core, workers, clock)
    assert core.cache is not None
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0, heartbeat_s=1.0), clock=clock, epoch="test2"
    )
    control.heartbeat(WorkerReport("w1", "w1:1", PROFILES.worker_classes[0]))
    assert core.install(control.current)
    assert core.cache.view.entries("w2") == 0 and core.cache.stats().forgotten["left"] == 1
    core.cache.apply("w2", CacheEvents("w2-1", 5, (insert("z"),)))  # a reply in flight
    assert core.cache.view.entries("w2") == 0


# -- (c) bad events ------------------------------------------------------------------------


def test_bad_events_are_skipped_and_counted_and_the_router_serves_on() -> None:
    workers = CachingWorkers()
    registry = CollectorRegistry()
    core, clock = make_core(workers, metrics=RouterMetrics(PROFILES, registry))
    nan = (math.nan,) * DIM
    workers.extra["w2"] = (
        CacheInsert("short", TAG, (1.0, 0.0)),
        CacheInsert("nan", TAG, nan),
        CacheInsert("zero", TAG, (0.0,) * DIM),
        CacheEvict("never-held"),
        insert("good", BOAT),
    )
    warm_w2(core, workers, clock)  # FOX cached by the log, plus "good"
    assert core.cache is not None and core.cache.view.entries("w2") == 2
    skipped = core.cache.stats().skipped
    assert (skipped["width"], skipped["not_finite"], skipped["unknown_evict"]) == (1, 2, 1)
    value = registry.get_sample_value
    assert value("argus_router_cache_events_skipped_total", {"reason": "not_finite"}) == 2.0
    assert ask(core, FOX_AT_DUSK).worker_id == "w2"  # and it routes on what it kept


# -- (d) off: Eq. 3 ------------------------------------------------------------------------


def test_with_cache_routing_off_the_router_routes_by_eq3_and_sends_no_cursor() -> None:
    workers = CachingWorkers(down_once=("w1",))
    encoder = FakeEncoder()
    core, clock = make_core(workers, cache_aware=False, encoder=encoder)
    assert core.cache is None and core.policy.cache is None
    assert ask(core, FOX).worker_id == "w2"
    clock.now += 60.0
    dusk = ask(core, FOX_AT_DUSK)
    assert dusk.worker_id == "w1" and dusk.level == LEVEL  # Eq. 3 on the routed K
    assert all(call.cache_cursor is None for _, call in workers.calls)
    assert encoder.embedded == []
    assert core.take_report().cache == CacheOutlook()


# -- (e) the probes reach the allocator's plan ---------------------------------------------


class Client:
    def __init__(self) -> None:
        self.reports: list[RouterReport] = []

    def report(self, report: RouterReport, profiles: Any) -> None:
        self.reports.append(report)


class Context:
    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


def test_probes_reach_the_report_and_the_allocators_cache_evidence() -> None:
    workers = CachingWorkers()
    core, clock = make_core(workers)
    warm_w2(core, workers, clock)
    ask(core, FOX_AT_DUSK)
    client = Client()
    StatsReporter(core, client, clock).report_once()  # type: ignore[arg-type]
    lookups = client.reports[0].cache_lookups
    bins = DEFAULT_RULE.bins()
    k_levels = [lv.name for lv in PROFILES.levels_for(Strategy.AC) if lv.skip_steps > 0]
    assert sorted(lookups.levels) == sorted(k_levels)  # one probe per level of K > 0
    row = lookups.levels[LEVEL]
    # FOX met an empty mirror (not probed); FOX_AT_DUSK found FOX on w2 at about 0.999
    assert row.counts[bins.index(0.998)] == 1.0 and row.total == 1.0

    message = router_report_to_pb(client.reports[0], PROFILES)
    assert router_report_from_pb(message, PROFILES).cache_lookups == lookups
    planner = CachePlanner()
    control = AllocatorControl(
        PROFILES, ControlConfig(period_s=60.0), clock=clock, epoch="a", cache=planner
    )
    cold = planner.profiles(PROFILES, control._allocator.cache_outlook)
    servicer = AllocatorServicer(control, LatestFeed(4), None)  # type: ignore[arg-type]
    servicer.ReportRouter(message, Context())
    outlook = control._allocator.cache_outlook
    assert outlook.levels[LEVEL].total == 1.0
    warm = planner.profiles(PROFILES, outlook)
    worker_class = PROFILES.worker_classes[0]
    assert (
        warm.profile(worker_class, LEVEL).latency_s != cold.profile(worker_class, LEVEL).latency_s
    )
    servicer.ReportRouter(message, Context())  # a retry: counted once
    assert control._allocator.cache_outlook.levels[LEVEL].total == 1.0


def test_a_probe_is_embedded_outside_ac_plans_at_most_once_per_interval() -> None:
    workers = CachingWorkers()
    encoder = FakeEncoder()
    core, clock = make_core(workers, encoder=encoder, level="sm-sd-xl")
    assert core.cache is not None
    core.cache.apply("w1", CacheEvents("w1-1", 1, (insert("a"),)))
    ask(core, FOX_AT_DUSK)
    ask(core, BOAT)  # within the interval: not embedded
    clock.now += 1.0
    ask(core, FOX)
    assert encoder.embedded == [FOX_AT_DUSK, FOX]
    assert core.take_report().cache.levels[LEVEL].total == 2.0


def test_a_prompt_asked_again_is_not_embedded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from argus.router import cache_mirror

    monkeypatch.setattr(cache_mirror, "PROMPT_MEMORY", 2)
    workers = CachingWorkers()
    encoder = FakeEncoder()
    core, clock = make_core(workers, encoder=encoder)
    warm_w2(core, workers, clock)
    encoder.embedded.clear()  # (an empty mirror embeds nothing; w2 holds FOX now)
    ask(core, FOX_AT_DUSK)
    again = ask(core, FOX_AT_DUSK)  # the same vector: the same close neighbour on w2
    assert again.worker_id == "w2"
    assert encoder.embedded == [FOX_AT_DUSK]
    ask(core, BOAT)
    ask(core, FOX)  # a third prompt in a memory of two: FOX_AT_DUSK, the oldest, goes
    ask(core, BOAT)
    ask(core, FOX_AT_DUSK)
    assert encoder.embedded == [FOX_AT_DUSK, BOAT, FOX, FOX_AT_DUSK]


def test_bad_cache_lookups_in_a_report_name_the_field() -> None:
    bad = allocator_pb2.RouterReport(
        router_id="r",
        cache_lookups=[
            allocator_pb2.CacheLookups(level="sm-sd-xl", counts=[1], similarity_sums=[0])
        ],
    )
    with pytest.raises(FieldError, match=r"cache_lookups\[0\]\.level"):
        router_report_from_pb(bad, PROFILES)
    bad = allocator_pb2.RouterReport(
        router_id="r",
        cache_lookups=[allocator_pb2.CacheLookups(level=LEVEL, counts=[-1], similarity_sums=[0])],
    )
    with pytest.raises(FieldError, match=r"cache_lookups\[0\]\.counts\[0\]"):
        router_report_from_pb(bad, PROFILES)
