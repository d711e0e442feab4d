"""The router's view of the workers' caches (argus/router/cache_view.py): it answers as an exact
brute-force reference over the same events would, names the worker that holds a close
neighbour, never matches across tags, and stays consistent under concurrent events."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from argus.router.cache_view import CacheView, CacheViewConfig

pytestmark = pytest.mark.unit

DIM = 64
INT8_SLACK = 0.01  # the view's int8 codes against float32 dot products at 64 dimensions
# every list of every cell probed: the view must then be exact up to int8 rounding
EXHAUSTIVE = CacheViewConfig(dim=DIM, list_size=4, cell_size=2, probes=10**6, cell_probes=10**6)


def unit(rng: np.random.Generator, dim: int = DIM) -> np.ndarray:
    vector = rng.standard_normal(dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


def near(rng: np.random.Generator, vector: np.ndarray, noise: float) -> np.ndarray:
    """A unit vector about ``1 / sqrt(1 + noise**2)`` cosine from ``vector``."""
    jitter = rng.standard_normal(len(vector)).astype(np.float32) * noise / np.sqrt(len(vector))
    moved = vector + jitter
    return (moved / np.linalg.norm(moved)).astype(np.float32)


class Reference:
    """What the view should answer: every event applied to plain dicts, searched exactly."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], tuple[np.ndarray, str]] = {}

    def insert(self, worker: str, entry_id: str, vector: np.ndarray, tag: str) -> None:
        self.held[(worker, entry_id)] = (vector / np.linalg.norm(vector), tag)

    def evict(self, worker: str, entry_id: str) -> None:
        self.held.pop((worker, entry_id), None)

    def forget(self, worker: str) -> None:
        for key in [key for key in self.held if key[0] == worker]:
            del self.held[key]

    def best(self, query: np.ndarray, tag: str, floor: float = -1.0) -> dict[str, float]:
        query = query / np.linalg.norm(query)
        found: dict[str, float] = {}
        for (worker, _), (vector, held_tag) in self.held.items():
            score = float(vector @ query)
            if held_tag == tag and score >= floor and score > found.get(worker, -2.0):
                found[worker] = score
        return found


def assert_same(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected), (got, expected)
    for worker, score in expected.items():
        assert got[worker] == pytest.approx(score, abs=INT8_SLACK), (worker, got, expected)


def test_random_events_keep_the_view_equal_to_an_exact_reference() -> None:
    """Inserts (new and replacing), evictions, unknown evictions and forgets, with lists
    and cells splitting and emptying on the way; every few events each tag is asked."""
    rng = np.random.default_rng(7)
    view, reference = CacheView(EXHAUSTIVE), Reference()
    workers = [f"w{i}" for i in range(4)]
    for step in range(3000):
        worker = workers[int(rng.integers(len(workers)))]
        entry_id = f"e{int(rng.integers(150))}"
        roll = rng.random()
        if roll < 0.65:
            vector, tag = unit(rng), f"tag-{int(rng.integers(2))}"
            view.insert(worker, entry_id, vector, tag)
            reference.insert(worker, entry_id, vector, tag)
        elif roll < 0.995:
            held = (worker, entry_id) in reference.held
            assert view.evict(worker, entry_id) == held
            reference.evict(worker, entry_id)
        else:
            view.forget(worker)
            reference.forget(worker)
        if step % 50 == 0:
            query = unit(rng)
            for tag in ("tag-0", "tag-1"):
                assert_same(view.best(query, tag, workers), reference.best(query, tag))
    stats = view.stats()
    assert stats.entries == stats.rows == len(reference.held) > 100
    assert stats.lists > 10 and stats.cells > 2  # the splits ran
    for worker in workers:
        held = sum(1 for key in reference.held if key[0] == worker)
        assert view.entries(worker) == held


def test_the_worker_holding_the_close_neighbour_is_named_at_scale() -> None:
    """Default settings (an approximate search over many lists and cells): for each query,
    the one worker given a near copy of it answers with that copy's similarity, far above
    every other worker's best. Half the copies come by single inserts, half inside a bulk
    insert among other entries: both paths must file an entry where a query for it looks."""
    rng = np.random.default_rng(3)
    dim = 384
    view = CacheView(CacheViewConfig(dim=dim))
    workers = [f"w{i}" for i in range(8)]
    for worker in workers:
        rows = rng.standard_normal((3000, dim)).astype(np.float32)
        view.insert_many(worker, [f"{worker}-{i}" for i in range(len(rows))], rows, "sdxl")
    assert view.stats().lists > 8 * view.config.probes  # well past what the probes cover
    queries = [unit(rng, dim) for _ in range(20)]
    copies = [near(rng, query, 0.3) for query in queries]
    holders = [workers[trial % len(workers)] for trial in range(len(queries))]
    for trial in range(0, len(queries), 2):
        view.insert(holders[trial], f"copy-{trial}", copies[trial], "sdxl")
    for worker in workers:  # the odd copies, each in a bulk insert with 500 other entries
        mine = [trial for trial in range(1, len(queries), 2) if holders[trial] == worker]
        fillers = rng.standard_normal((500, dim)).astype(np.float32)
        rows = np.concatenate([fillers, np.stack([copies[t] for t in mine])]) if mine else fillers
        ids = [f"{worker}-more-{i}" for i in range(500)] + [f"copy-{t}" for t in mine]
        view.insert_many(worker, ids, rows, "sdxl")
    for query, copy, holder in zip(queries, copies, holders, strict=True):
        got = view.best(query, "sdxl", workers, floor=0.5)
        assert set(got) == {holder}
        assert got[holder] == pytest.approx(float(copy @ query), abs=0.005)


def test_a_neighbour_under_another_tag_never_matches() -> None:
    rng = np.random.default_rng(1)
    view = CacheView(CacheViewConfig(dim=DIM))
    query = unit(rng)
    view.insert("a", "1", query, "sdxl/1024/euler/30")
    view.insert("b", "1", query, "sdxl/1024/euler/30+lora:ink")
    one = pytest.approx(1.0, abs=INT8_SLACK)
    assert view.best(query, "sdxl/1024/euler/30", ["a", "b"]) == {"a": one}
    assert view.best(query, "sdxl/1024/euler/30+lora:ink", ["a", "b"]) == {"b": one}
    assert view.best(query, "sd-1.5/512/ddim/50", ["a", "b"]) == {}


def test_answers_cover_only_the_candidates_asked_and_entries_at_the_floor() -> None:
    rng = np.random.default_rng(2)
    view = CacheView(CacheViewConfig(dim=DIM))
    query = unit(rng)
    view.insert("close", "1", near(rng, query, 0.2), "t")
    view.insert("far", "1", unit(rng), "t")
    assert set(view.best(query, "t", ["close", "far"])) == {"close", "far"}
    assert set(view.best(query, "t", ["far", "unknown"])) == {"far"}
    assert set(view.best(query, "t", ["close", "far"], floor=0.9)) == {"close"}


def test_an_eviction_or_a_replacement_takes_the_old_vector_out() -> None:
    rng = np.random.default_rng(4)
    view = CacheView(CacheViewConfig(dim=DIM))
    query = unit(rng)
    view.insert("w", "1", query, "t")
    view.insert("w", "1", -query, "t")  # the same id again: replaced, not added
    assert view.entries("w") == 1
    assert view.best(query, "t", ["w"]) == {"w": pytest.approx(-1.0, abs=INT8_SLACK)}
    assert view.evict("w", "1")
    assert view.best(query, "t", ["w"]) == {}
    assert not view.evict("w", "1")  # already gone: counted, not an error
    assert not view.evict("nobody", "1")
    assert view.stats().unknown_evictions == 2
    assert view.stats().tags == 0  # an emptied tag is dropped


def test_forget_drops_a_worker_and_a_new_insert_starts_it_afresh() -> None:
    rng = np.random.default_rng(5)
    view = CacheView(CacheViewConfig(dim=DIM, list_size=4, cell_size=2))
    query = unit(rng)
    for i in range(40):
        view.insert("gone", f"e{i}", near(rng, query, 0.5), "t")
        view.insert("stays", f"e{i}", near(rng, query, 1.0), "t")
    assert view.forget("gone") == 40
    assert view.forget("gone") == 0
    assert set(view.best(query, "t", ["gone", "stays"])) == {"stays"}
    assert view.entries("gone") == 0 and view.entries("stays") == 40
    view.insert("gone", "e0", query, "t")  # it came back, with an empty cache and one entry
    assert view.best(query, "t", ["gone"]) == {"gone": pytest.approx(1.0, abs=INT8_SLACK)}
    assert view.stats().entries == 41
    # more inserts split lists that held the forgotten entries: none comes back
    for i in range(40, 80):
        view.insert("stays", f"e{i}", near(rng, query, 1.0), "t")
    assert view.entries("gone") == 1 and view.stats().entries == 81
    assert view.stats().rows == 81  # the forgotten entries are out of the lists too


def test_a_bulk_insert_answers_as_single_inserts_do() -> None:
    rng = np.random.default_rng(6)
    rows = rng.standard_normal((300, DIM)).astype(np.float32)
    ids = [f"e{i}" for i in range(len(rows))]
    bulk, single = CacheView(EXHAUSTIVE), CacheView(EXHAUSTIVE)
    bulk.insert_many("w", ids, rows, "t")
    for entry_id, row in zip(ids, rows, strict=True):
        single.insert("w", entry_id, row, "t")
    assert bulk.stats().lists > 30  # the bulk insert split its lists down to size
    for _ in range(10):
        query = unit(rng)
        assert bulk.best(query, "t", ["w"]) == pytest.approx(single.best(query, "t", ["w"]))


def test_lists_stay_within_their_bounds() -> None:
    """Splits halve: no list reaches twice ``list_size`` and none is left tiny by a split,
    so a query's cost stays what the settings say."""
    rng = np.random.default_rng(8)
    config = CacheViewConfig(dim=DIM, list_size=16, cell_size=4)
    view = CacheView(config)
    centres = rng.standard_normal((5, DIM)).astype(np.float32)  # clumpy data
    rows = centres[rng.integers(0, 5, 4000)] + 0.2 * rng.standard_normal((4000, DIM))
    view.insert_many("w", [f"e{i}" for i in range(len(rows))], rows.astype(np.float32), "t")
    sizes = [
        lst.size
        for index in view._tags.values()
        for cell in index.cells.members
        for lst in cell.lists.members
    ]
    assert max(sizes) < 2 * config.list_size
    assert min(sizes) >= config.list_size // 2
    assert sum(sizes) == 4000


def test_bad_embeddings_and_settings_are_refused() -> None:
    view = CacheView(CacheViewConfig(dim=DIM))
    with pytest.raises(ValueError, match="shape"):
        view.insert("w", "1", np.ones(DIM + 1, dtype=np.float32), "t")
    with pytest.raises(ValueError, match="finite"):
        view.insert("w", "1", np.full(DIM, np.nan, dtype=np.float32), "t")
    with pytest.raises(ValueError, match="zero"):
        view.best(np.zeros(DIM, dtype=np.float32), "t", ["w"])
    with pytest.raises(ValueError, match="twice"):
        view.insert_many("w", ["1", "1"], np.ones((2, DIM), dtype=np.float32), "t")
    with pytest.raises(ValueError, match="probes"):
        CacheViewConfig(probes=0)
    with pytest.raises(ValueError, match="list_size"):
        CacheViewConfig(list_size=1)
    assert view.stats().entries == 0


def test_events_from_threads_while_others_ask() -> None:
    """Four writer threads (one worker each) insert and evict while two threads query; no
    call fails, and the view then answers as the reference of the same events does."""
    config = CacheViewConfig(dim=DIM, list_size=8, cell_size=4, probes=10**6, cell_probes=10**6)
    view, reference = CacheView(config), Reference()
    done = threading.Event()
    errors: list[BaseException] = []
    guard = threading.Lock()

    def write(worker: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for i in range(600):
                entry_id = f"e{int(rng.integers(200))}"
                if rng.random() < 0.7:
                    vector = unit(rng)
                    view.insert(worker, entry_id, vector, "t")
                    with guard:
                        reference.insert(worker, entry_id, vector, "t")
                else:
                    view.evict(worker, entry_id)
                    with guard:
                        reference.evict(worker, entry_id)
                if i == 300 and worker == "w0":
                    view.forget(worker)
                    with guard:
                        reference.forget(worker)
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    def ask(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not done.is_set():
                answer = view.best(unit(rng), "t", [f"w{i}" for i in range(4)])
                assert all(-1.01 <= score <= 1.0 for score in answer.values())
        except BaseException as error:
            errors.append(error)

    writers = [threading.Thread(target=write, args=(f"w{i}", i)) for i in range(4)]
    askers = [threading.Thread(target=ask, args=(100 + i,)) for i in range(2)]
    for thread in askers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    for thread in askers:
        thread.join()
    assert not errors, errors
    rng = np.random.default_rng(9)
    for _ in range(20):
        query = unit(rng)
        assert_same(view.best(query, "t", [f"w{i}" for i in range(4)]), reference.best(query, "t"))
    assert view.stats().entries == len(reference.held)
