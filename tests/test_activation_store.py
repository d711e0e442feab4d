"""The activation cache's two-tier store (host LRU by bytes, then safetensors files) and
Algorithm 1 (which blocks load cached activations)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from argus.worker.editing import activation_store as store_module
from argus.worker.editing.activation_store import (
    SUFFIX,
    ActivationStore,
    CachePlan,
    StoreListener,
    Tier,
    file_digest,
    pipeline_latency,
    plan_cache_use,
)

pytestmark = pytest.mark.unit

ELEMS = 8  # fp16 elements per tensor
RECORD_BYTES = 2 * ELEMS * 2  # two fp16 tensors of ELEMS elements: 32 bytes


def make_record(value: float, elems: int = ELEMS) -> dict[str, torch.Tensor]:
    """A record as the compute side writes one: flat names, fp16 CPU tensors."""
    return {
        "s0.b0.y": torch.full((elems,), value, dtype=torch.float16),
        "s0.b1.y": torch.full((elems // 2, 2), value + 0.5, dtype=torch.float16),
    }


def value_of(record: Any) -> float:
    assert record is not None
    return float(record["s0.b0.y"][0])


def files_in(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(SUFFIX))


@pytest.fixture
def make_store(tmp_path: Path) -> Any:
    stores: list[ActivationStore] = []

    def make(
        host_records: float, disk_records: float | None = None, **kwargs: Any
    ) -> ActivationStore:
        disk_dir = tmp_path / "acts" if disk_records is not None else None
        # a file is the record plus a small JSON header; 400 bytes of slack per file
        disk_bytes = int(disk_records * (RECORD_BYTES + 400)) if disk_records is not None else 0
        store = ActivationStore(int(host_records * RECORD_BYTES), disk_dir, disk_bytes, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not store._closed:
            store.close()


# -- host tier ---------------------------------------------------------------------------


def test_host_lru_evicts_least_recently_used_by_bytes(make_store: Any) -> None:
    store = make_store(host_records=3)
    for i, key in enumerate("abc"):
        store.put(key, make_record(i))
    assert store.host_bytes_used == 3 * RECORD_BYTES
    assert value_of(store.get("a")) == 0  # a is now the most recent; b the least
    store.put("d", make_record(3))
    assert store.tier("b") is None and store.get("b") is None
    assert [store.tier(k) for k in "acd"] == ["host"] * 3
    # bytes, not records: one record twice as large pushes out the two least recent
    store.put("big", make_record(9, elems=2 * ELEMS))
    assert store.tier("a") is None and store.tier("c") is None
    assert store.tier("d") == "host" and store.nbytes("big") == 2 * RECORD_BYTES
    assert store.host_bytes_used == 3 * RECORD_BYTES
    stats = store.stats()
    assert (stats.host_evictions, stats.misses, stats.host_hits) == (3, 1, 1)


def test_put_replaces_a_record(make_store: Any) -> None:
    store = make_store(host_records=2, disk_records=4)
    store.put("a", make_record(1))
    store.put("b", make_record(2))
    store.put("c", make_record(3))  # a demoted to disk
    store.put("a", make_record(7))  # a's old file goes; the new a in host pushes b to disk
    assert store.tier("a") == "host" and value_of(store.get("a")) == 7
    assert [_key_of(p) for p in files_in(store.disk_dir)] == ["b"]


# -- disk tier ---------------------------------------------------------------------------


def test_demotion_to_disk_and_promotion_back(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=4)
    store.put("a", make_record(1))
    store.put("b", make_record(2))  # evicts a from host: written to disk
    assert store.tier("a") == "disk" and store.nbytes("a") == RECORD_BYTES
    [file] = files_in(store.disk_dir)
    assert store.disk_bytes_used == file.stat().st_size
    record = store.get("a")  # disk hit, promoted; b demoted in turn
    assert record is not None
    assert torch.equal(record["s0.b1.y"], make_record(1)["s0.b1.y"])
    assert store.tier("a") == "host" and store.tier("b") == "disk"
    assert store.stats().disk_writes == 2
    store.get("b")  # a leaves host again: its file is still there, not rewritten
    assert store.tier("a") == "disk" and store.stats().disk_writes == 2
    stats = store.stats()
    assert (stats.disk_hits, stats.disk_loads, stats.host_hits) == (2, 2, 0)
    assert stats.disk_load_seconds > 0


def test_disk_lru_deletes_files(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=2)
    for i, key in enumerate("abcd"):
        store.put(key, make_record(i))  # a, b, c go to disk in that order; d stays in host
    assert [store.tier(k) for k in "abcd"] == [None, "disk", "disk", "host"]
    assert len(files_in(store.disk_dir)) == 2
    assert store.disk_bytes_used == sum(p.stat().st_size for p in files_in(store.disk_dir))
    assert store.stats().disk_evictions == 1
    assert store.get("b") is not None  # b most recent on disk; d demoted pushes c out
    assert sorted(_key_of(p) for p in files_in(store.disk_dir)) == ["b", "d"]
    store.put("e", make_record(5))
    store.put("f", make_record(6))
    assert store.tier("c") is None and store.tier("b") == "disk"


@pytest.mark.parametrize("during_write", ["discard", "replace"])
def test_record_changed_while_its_file_is_written(
    make_store: Any, monkeypatch: pytest.MonkeyPatch, during_write: str
) -> None:
    store = make_store(host_records=2, disk_records=4)
    real_save = store_module.save_file
    calls: list[str] = []

    def save_then_interfere(tensors: Any, path: str, metadata: dict[str, str]) -> None:
        real_save(tensors, path, metadata=metadata)
        calls.append(metadata["key"])
        if len(calls) == 1:  # a's demotion is on its way to disk: change a now
            if during_write == "discard":
                store.discard("a")
            else:
                store.put("a", make_record(7))

    monkeypatch.setattr(store_module, "save_file", save_then_interfere)
    store.put("a", make_record(1))
    store.put("b", make_record(2))
    store.put("c", make_record(3))  # evicts a: written, and changed during the write
    assert calls[0] == "a"
    if during_write == "discard":
        assert store.tier("a") is None and store.get("a") is None
    else:
        assert value_of(store.get("a")) == 7
    assert "a" not in [_key_of(p) for p in files_in(store.disk_dir)]  # the old file is gone
    assert store.disk_bytes_used == sum(p.stat().st_size for p in files_in(store.disk_dir))


def test_disk_round_trip_keeps_dtypes_shapes_and_views(make_store: Any) -> None:
    store = make_store(host_records=0, disk_records=64)
    buffer = torch.arange(48, dtype=torch.float16)
    record = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(7),
        "i64": torch.tensor([1, -2, 3]),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "view.a": buffer[:16].view(4, 4),  # disjoint views of one buffer
        "view.b": buffer[16:],
        "view.t": buffer[:16].view(4, 4).t(),  # overlaps view.a: cloned for the file
    }
    store.put("mixed", record)
    loaded = store.get("mixed")
    assert loaded is not None and set(loaded) == set(record)
    for name, tensor in record.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_disk_hit_is_read_into_memory_not_mapped(make_store: Any) -> None:
    store = make_store(host_records=0, disk_records=4)
    store.put("a", make_record(1))
    [path] = files_in(store.disk_dir)
    loaded = store.get("a")
    with open(path, "r+b") as handle:  # the same inode, zeroed after the read
        handle.seek(path.stat().st_size - RECORD_BYTES)
        handle.write(bytes(RECORD_BYTES))
    assert value_of(loaded) == 1  # a memory map would now read 0


def test_record_bigger_than_host_bound(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=4)
    store.put("huge", make_record(4, elems=2 * ELEMS))
    assert store.tier("huge") == "disk" and store.host_bytes_used == 0
    assert value_of(store.get("huge")) == 4  # read from disk each time, never promoted
    assert store.tier("huge") == "disk" and store.host_bytes_used == 0

    host_only = make_store(host_records=1)
    host_only.put("huge", make_record(4, elems=2 * ELEMS))
    assert host_only.get("huge") is None and host_only.stats().dropped == 1


def test_record_bigger_than_both_bounds_is_dropped(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=1)
    store.put("huge", make_record(4, elems=64 * ELEMS))
    assert store.tier("huge") is None and files_in(store.disk_dir) == []
    assert store.stats().dropped == 1


def test_discard_deletes_every_copy(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=2)
    store.put("a", make_record(1))
    store.put("b", make_record(2))
    store.get("a")  # a in host and on disk
    assert store.discard("a") and not store.discard("a")
    assert store.tier("a") is None and store.get("a") is None
    assert [store.tier("b")] == ["disk"] and len(files_in(store.disk_dir)) == 1


def test_prefetch_then_get_loads_once(make_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(host_records=1, disk_records=4)
    store.put("a", make_record(1))
    store.put("b", make_record(2))  # a on disk
    opened: list[str] = []
    release = threading.Event()
    real_read = store_module.read_record

    def slow_read(path: Path) -> Any:
        opened.append(path.name)
        release.wait(5)
        return real_read(path)

    monkeypatch.setattr(store_module, "read_record", slow_read)
    assert store.prefetch("a") is True
    assert store.prefetch("a") is True  # already loading: nothing new started
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(store.get("a")))
    reader.start()
    time.sleep(0.05)  # let the get find the running load and wait on it
    release.set()
    reader.join(5)
    assert value_of(got[0]) == 1 and len(opened) == 1
    assert store.tier("a") == "host" and store.prefetch("a") is False
    assert store.prefetch("nothing") is False
    assert store.stats().disk_loads == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_file_is_a_counted_miss(make_store: Any, damage: str) -> None:
    store = make_store(host_records=1, disk_records=4)
    store.put("a", make_record(1))
    store.put("b", make_record(2))
    [path] = files_in(store.disk_dir)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 0x40  # in the tensor data: only the CRC notices
    elif damage == "truncate":
        data = data[: len(data) - 5]
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    assert store.get("a") is None
    stats = store.stats()
    assert (stats.misses, stats.corrupt_files, stats.disk_hits) == (1, 1, 0)
    assert not path.exists() and store.tier("a") is None and store.disk_bytes_used == 0


@pytest.mark.parametrize("key", ["../escape", "../../etc/passwd", "/abs/path", "a/b", "..", "."])
def test_keys_never_become_paths(make_store: Any, tmp_path: Path, key: str) -> None:
    store = make_store(host_records=0, disk_records=2)  # everything goes to disk
    store.put(key, make_record(3))
    assert store.tier(key) == "disk"
    [path] = files_in(store.disk_dir)
    assert path.parent == store.disk_dir
    assert len(path.stem) == 64 and all(c in "0123456789abcdef" for c in path.stem)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts"]
    assert value_of(store.get(key)) == 3


def test_failed_write_drops_the_record(make_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(host_records=1, disk_records=4)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "save_file", disk_full)
    store.put("a", make_record(1))
    store.put("b", make_record(2))  # a's demotion fails: gone, counted, no exception
    assert store.tier("a") is None and store.stats().dropped == 1
    assert [p.name for p in store.disk_dir.iterdir()] == []  # no temporary file left


def test_restart_indexes_files_by_their_header(make_store: Any) -> None:
    store = make_store(host_records=1, disk_records=8)
    for i, key in enumerate("abc"):
        store.put(key, make_record(i))
    store.close()  # a, b on disk; c was only in memory
    root = store.disk_dir
    forged = root / (file_digest("x", "t") + SUFFIX)  # our name pattern, someone else's file
    forged.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    [a_file] = [p for p in files_in(root) if p != forged and _key_of(p) == "a"]
    renamed = root / (file_digest("b", "other") + SUFFIX)  # b's bytes under a name not its own
    renamed.write_bytes(a_file.read_bytes())
    (root / ".tmp-halfwritten.safetensors").write_bytes(b"\x00")
    (root / "README").write_text("not ours")

    again = make_store(host_records=1, disk_records=8)
    assert again.tier("a") == "disk" and again.tier("b") == "disk" and again.tier("c") is None
    assert value_of(again.get("b")) == 1
    assert not forged.exists() and not renamed.exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(SUFFIX)) == ["README"]
    assert again.disk_bytes_used == sum(p.stat().st_size for p in files_in(root))


def _key_of(path: Path) -> str:
    with safe_open(str(path), framework="pt") as handle:
        return str((handle.metadata() or {})["key"])


def test_listener_sees_hits_misses_evictions_loads_and_bytes(make_store: Any) -> None:
    events: list[tuple[Any, ...]] = []

    class Recorder(StoreListener):
        def on_hit(self, tier: Tier, nbytes: int) -> None:
            events.append(("hit", tier, nbytes))

        def on_miss(self) -> None:
            events.append(("miss",))

        def on_evict(self, tier: Tier, nbytes: int) -> None:
            events.append(("evict", tier, nbytes))

        def on_load(self, tier: Tier, seconds: float, nbytes: int) -> None:
            events.append(("load", tier, nbytes))

        def on_bytes(self, tier: Tier, nbytes: int) -> None:
            events.append(("bytes", tier, nbytes))

    store = make_store(host_records=1, disk_records=1.2, listener=Recorder())  # one file
    store.put("a", make_record(1))
    store.put("b", make_record(2))
    store.get("a")
    store.get("zzz")
    store.put("c", make_record(3))
    assert ("evict", "host", RECORD_BYTES) in events and ("evict", "disk", RECORD_BYTES) in events
    assert ("load", "disk", RECORD_BYTES) in events and ("hit", "disk", RECORD_BYTES) in events
    assert ("miss",) in events
    host_bytes = [e[2] for e in events if e[:2] == ("bytes", "host")]
    assert host_bytes[-1] == store.host_bytes_used == RECORD_BYTES
    disk_bytes = [e[2] for e in events if e[:2] == ("bytes", "disk")]
    assert disk_bytes[-1] == store.disk_bytes_used


def test_concurrent_puts_gets_and_prefetches(make_store: Any) -> None:
    store = make_store(host_records=3, disk_records=4, prefetch_threads=2)
    keys = [f"t{i}" for i in range(8)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                key = rng.choice(keys)
                action = rng.random()
                if action < 0.35:
                    store.put(key, make_record(int(key[1:]) * 10 + rng.randrange(5)))
                elif action < 0.85:
                    record = store.get(key)
                    if record is not None:  # never a mix of two records, never another key's
                        value = value_of(record)
                        assert int(value) // 10 == int(key[1:])
                        assert float(record["s0.b1.y"][0, 0]) == value + 0.5
                elif action < 0.95:
                    store.prefetch(key)
                else:
                    store.discard(key)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    store.close()  # waits for prefetches
    stats = store.stats()
    assert stats.host_hits + stats.disk_hits > 0 and stats.disk_writes > 0
    assert stats.disk_bytes <= store.disk_bytes
    assert stats.disk_bytes == sum(p.stat().st_size for p in files_in(store.disk_dir))
    assert stats.disk_records == len(files_in(store.disk_dir))
    assert [p for p in store.disk_dir.iterdir() if p.name.startswith(".tmp-")] == []


def test_closed_store_refuses_and_inputs_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_bytes"):
        ActivationStore(100, tmp_path, 0)
    with pytest.raises(ValueError, match="needs a disk_dir"):
        ActivationStore(100, None, 10)
    with pytest.raises(ValueError, match="host_bytes"):
        ActivationStore(-1)
    store = ActivationStore(100)
    with pytest.raises(ValueError, match="non-empty"):
        store.put("", make_record(1))
    with pytest.raises(TypeError):
        store.put("a", {"x": [1, 2]})  # type: ignore[dict-item]
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get("a")


# -- Algorithm 1 ---------------------------------------------------------------------------


def simulate_two_streams(
    use: tuple[bool, ...], without: list[float], with_: list[float], load: list[float]
) -> float:
    """The pipeline of Fig. 9, event by event: the load stream copies the chosen blocks'
    activations back to back from t = 0; the compute stream runs blocks in order, a cached
    block not before its copy ends. Returns when the last block ends."""
    load_intervals: dict[int, tuple[float, float]] = {}
    clock = 0.0
    for i, used in enumerate(use):
        if used:
            load_intervals[i] = (clock, clock + load[i])
            clock += load[i]
    compute_intervals: list[tuple[float, float]] = []
    for i, used in enumerate(use):
        ready = compute_intervals[-1][1] if compute_intervals else 0.0
        if used:
            ready = max(ready, load_intervals[i][1])
        compute_intervals.append((ready, ready + (with_[i] if used else without[i])))
    return compute_intervals[-1][1] if compute_intervals else 0.0


def test_zero_load_uses_every_block() -> None:
    plan = plan_cache_use([3.0, 2.0, 4.0], [1.0, 0.5, 2.0], [0.0, 0.0, 0.0])
    assert plan == CachePlan((True, True, True), 3.5)


def test_huge_load_uses_no_block() -> None:
    plan = plan_cache_use([3.0, 2.0, 4.0], [1.0, 0.5, 2.0], [1e6, 1e6, 1e6])
    assert plan == CachePlan((False, False, False), 9.0)


def test_hand_worked_mixed_case() -> None:
    # block 1: max(0 + 2, 0) + 1 = 3 <= 0 + 4       -> cache; load = 2, comp = 3
    # block 2: max(2 + 6, 3) + 1 = 9 >  3 + 4 = 7   -> compute; load = 2, comp = 7
    # block 3: max(2 + 1, 7) + 1 = 8 <= 7 + 4 = 11  -> cache; load = 3, comp = 8
    plan = plan_cache_use([4.0, 4.0, 4.0], [1.0, 1.0, 1.0], [2.0, 6.0, 1.0])
    assert plan == CachePlan((True, False, True), 8.0)


def test_ties_use_the_cache_and_empty_input() -> None:
    # max(0 + 1, 0) + 1 = 2 <= 0 + 2: the paper's <= picks the cache on a tie
    assert plan_cache_use([2.0], [1.0], [1.0]).use == (True,)
    assert plan_cache_use([], [], []) == CachePlan((), 0.0)


def test_latency_equals_a_simulation_of_the_pipeline() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 12)
        without = [rng.uniform(0.5, 1.5) for _ in range(n)]
        with_ = [c * rng.uniform(0.05, 1.0) for c in without]
        load = [rng.uniform(0.0, 2.0) for _ in range(n)]
        plan = plan_cache_use(without, with_, load)
        assert plan.latency_s == pytest.approx(simulate_two_streams(plan.use, without, with_, load))
        assert plan.latency_s <= sum(without) + 1e-12  # never worse than computing everything
        for use in itertools.islice(itertools.product((False, True), repeat=n), 16):
            assert pipeline_latency(use, without, with_, load) == pytest.approx(
                simulate_two_streams(use, without, with_, load)
            )


def test_algorithm_1_is_greedy_not_optimal() -> None:
    # Caching block 1 saves it 1 s but holds the load stream until t = 10, so block 2 (which
    # saves 100 s) starts at 10; computing block 1 and caching only block 2 ends at 11.
    without, with_, load = [11.0, 100.0], [0.0, 0.0], [10.0, 10.0]
    plan = plan_cache_use(without, with_, load)
    assert plan == CachePlan((True, True), 20.0)
    best = min(
        itertools.product((False, True), repeat=2),
        key=lambda use: pipeline_latency(use, without, with_, load),
    )
    assert best == (False, True) and pipeline_latency(best, without, with_, load) == 11.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0, 2.0], [1.0], [1.0, 1.0]), "one entry per block"),
        (([1.0], [-1.0], [1.0]), r"compute_with\[0\]"),
        (([1.0], [1.0], [float("nan")]), r"load\[0\]"),
    ],
)
def test_plan_rejects_bad_costs(args: tuple[list[float], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_cache_use(*args)
