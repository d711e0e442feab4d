"""The mask-aware activation cache's storage: device memory, host memory, then disk; their
sizes; and Algorithm 1.

InstGenIE (§4.2) keeps each image template's recorded block activations in host memory under
an LRU policy, demotes cold ones to secondary storage, and loads them back while an edit waits
in the queue. :class:`ActivationStore` is that store. It holds a template's record opaquely, as
a flat ``Mapping[str, torch.Tensor]`` of CPU tensors (names such as ``s3.b7.y``; what they mean
is :mod:`argus.worker.editing.masked_blocks`'s business), keyed by a string (the template key).
:func:`plan_cache_use` is the paper's Algorithm 1: which blocks load their cached activations
and which recompute, given measured costs.

* **Tiers**: host memory, an LRU bounded in bytes; then, optionally, one safetensors file per
  record under ``disk_dir``, an LRU bounded in bytes. A record evicted from host is written to
  disk once; a disk hit promotes it back (:meth:`ActivationStore.tier` names the faster one). A
  record larger than the host bound goes straight to disk, or is dropped (counted).
* **Reads** fill one owned buffer with one ``readinto`` and hand out views of it
  (:func:`read_record`), not a memory map, which would leave a "loaded" record on disk.
* **Files** are named ``sha256(key, NUL, token)`` with a random per-record ``token``: a key
  never becomes a path, and a slow write of an old version never lands on a newer one. They
  are written under a ``.tmp-`` name and renamed into place: a reader sees a whole file or none.
* **Restart**: files are indexed by their header (format tag, key, token, bytes, CRC-32 of the
  data), not trusted by name; files of our pattern that fail this, and stray ``.tmp-`` files,
  are deleted, files with other names left alone. The CRC is checked on every load.
* **Failures are misses**: an unreadable, truncated or corrupt file makes :meth:`get` return
  ``None`` (counted; the file is deleted). A failed write (disk full) drops the record
  (counted); :meth:`put` never raises for it.
* **Threads**: one lock guards the indexes and counters; no file is read, written or deleted
  under it. Demotion writes run on the thread whose insertion evicted the record, which a
  ``get`` still finds in memory meanwhile; :meth:`prefetch` loads on a small pool, and a
  ``get`` for a key being loaded waits for that load.
* **Metrics**: a :class:`StoreListener` hears hits, misses, evictions and loads, under the
  store's lock (so it must be quick and must not call back); :meth:`stats` returns the same
  counters as a frozen :class:`StoreStats`.
* **The device tier** (:class:`DeviceTier`), in front of the store: records on the model's
  device, an LRU bounded in bytes under the same keys, filled by the cache
  (:mod:`argus.worker.editing.activation_cache`); it reports to the listener as ``"device"``.
* **Sizes**: ``auto_*_bytes`` are what ``"auto"`` means for each tier (:mod:`argus.defaults`).

The store hands back the tensors it was given: callers must treat records as read-only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from argus import defaults

log = logging.getLogger(__name__)

Tier = Literal["device", "host", "disk"]
Record = Mapping[str, torch.Tensor]

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
FORMAT = "argus.activation-store/1"
_FILE_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")


# -- metrics ------------------------------------------------------------------------------------


class StoreListener:
    """Receives the store's events; subclass and override what you map onto metrics.

    Called under the store's lock: keep each method quick and never call the store from it.
    """

    def on_hit(self, tier: Tier, nbytes: int) -> None:
        """A ``get`` found the record in ``tier`` (``"disk"``: it had to be read from a file,
        by this ``get`` or by a prefetch it waited for)."""

    def on_miss(self) -> None:
        """A ``get`` found nothing usable (absent, or its file was corrupt)."""

    def on_corrupt(self) -> None:
        """A file failed to load (unreadable, truncated, CRC mismatch) and was deleted."""

    def on_evict(self, tier: Tier, nbytes: int) -> None:
        """A record left ``tier`` to make room (host: demoted to disk or dropped; disk: deleted;
        device: freed, the store still holds it)."""

    def on_load(self, tier: Tier, seconds: float, nbytes: int) -> None:
        """A record was read from ``tier`` (only ``"disk"``) in ``seconds``."""

    def on_bytes(self, tier: Tier, nbytes: int) -> None:
        """``tier`` now holds ``nbytes`` bytes."""

    def on_drop(self, nbytes: int) -> None:
        """A record could be kept in no tier (too large for both, or its disk write failed)."""


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters since it was created (bytes: now)."""

    host_hits: int  # gets answered from memory
    disk_hits: int  # gets answered by reading a file (or waiting for a prefetch's read)
    misses: int  # gets that returned None
    corrupt_files: int  # files that failed to load and were deleted
    host_evictions: int  # records pushed out of host memory by the byte bound
    disk_evictions: int  # files deleted by the disk byte bound
    disk_writes: int  # files written (demotions and records too large for host)
    disk_loads: int  # files read successfully (by get or prefetch)
    disk_load_seconds: float  # total seconds spent in those reads
    dropped: int  # records kept in no tier (too large, or a failed write)
    host_bytes: int  # tensor bytes held in host memory now
    disk_bytes: int  # file bytes held on disk now
    host_records: int  # records in host memory now
    disk_records: int  # files on disk now


# -- the store -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Held:
    """A record in memory. ``token`` tells versions of one key apart."""

    key: str
    token: str
    tensors: Record
    nbytes: int


@dataclass(frozen=True)
class _File:
    """A record on disk."""

    key: str
    token: str
    path: Path
    file_bytes: int  # size of the file: what the disk bound counts
    nbytes: int  # tensor bytes of the record: what it costs in host memory


class ActivationStore:
    """Template records in host memory (LRU by bytes), demoted to disk files (LRU by bytes).

    ``host_bytes``: bound on the tensor bytes held in memory (0 keeps nothing in memory).
    ``disk_dir``: directory for files, created if missing; ``None``: host only.
    ``disk_bytes``: bound on the bytes of the files in ``disk_dir`` (> 0 when it is given).
    ``prefetch_threads``: size of the pool that runs :meth:`prefetch` loads.
    ``verify``: check each loaded file's CRC-32 (about 3 GB/s on one core).
    ``fsync``: fsync each file before renaming it into place (durability across power loss;
    corruption is detected either way).
    """

    def __init__(
        self,
        host_bytes: int,
        disk_dir: Path | str | None = None,
        disk_bytes: int = 0,
        *,
        listener: StoreListener | None = None,
        prefetch_threads: int = 2,
        verify: bool = True,
        fsync: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        new_token: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        _check_bounds(host_bytes, disk_dir, disk_bytes, prefetch_threads)
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes if disk_dir is not None else 0
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self._listener = listener or StoreListener()
        self._verify = verify
        self._fsync = fsync
        self._clock = clock
        self._new_token = new_token
        self._lock = threading.Lock()
        self._host: OrderedDict[str, _Held] = OrderedDict()
        self._disk: OrderedDict[str, _File] = OrderedDict()
        self._writing: dict[str, _Held] = {}  # evicted from host, file not yet in place
        self._loading: dict[str, Future[Record | None]] = {}
        self._host_used = 0
        self._disk_used = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._load_seconds = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="activation-load")
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._index_existing_files(self.disk_dir)

    # -- public API ------------------------------------------------------------------------

    def put(self, key: str, tensors: Record) -> None:
        """Store ``tensors`` as the record of ``key``, replacing any earlier one.

        Called once a template's full run has recorded its activations. Returns once the record
        is in host memory, or (too large for host) written to disk; any record this pushes out
        of memory is written to disk on this thread first.
        """
        self._check_open()
        record = _Held(_check_key(key), self._new_token(), dict(tensors), record_nbytes(tensors))
        with self._lock:
            stale = self._forget_locked(key)
            if record.nbytes <= self.host_bytes:
                writes = self._admit_host_locked(record)
            elif self._fits_disk(record.nbytes):
                self._writing[key] = record
                writes = [record]
            else:
                writes = []
                self._count_drop_locked(record.nbytes)
        _delete_files(stale)
        self._write_files(writes)

    def get(self, key: str) -> Record | None:
        """The record of ``key``, or ``None`` on a miss.

        Called when an edit of the template is about to run. A host hit returns at once; a disk
        hit reads the file (or waits for a prefetch already reading it) and promotes the record
        to host memory when it fits. A corrupt or vanished file is a miss, never an exception.
        """
        self._check_open()
        with self._lock:
            held = self._host.get(key) or self._writing.get(key)
            if held is not None:
                self._count_hit_locked("host", held.nbytes)
                writes = self._touch_held_locked(held)
                future, file = None, None
            else:
                writes = []
                future, file = self._start_load_locked(key)
                if future is None:
                    self._count_miss_locked()
                    return None
        if held is not None:
            self._write_files(writes)
            return held.tensors
        assert future is not None
        if file is not None:  # this get owns the load
            self._load(file, future)
        tensors = future.result()
        with self._lock:
            if tensors is None:
                self._count_miss_locked()
            else:
                self._count_hit_locked("disk", record_nbytes(tensors))
        return tensors

    def prefetch(self, key: str) -> bool:
        """Start reading ``key``'s file into host memory in the background.

        Called when an edit of the template enters the queue. Returns whether there is a load
        to wait for (one started now or one already running); ``False`` when the record is
        already in memory or nowhere.
        """
        self._check_open()
        with self._lock:
            if key in self._host or key in self._writing:
                return False
            future, file = self._start_load_locked(key)
        if future is None:
            return False
        if file is not None:
            self._pool.submit(self._load, file, future)
        return True

    def tier(self, key: str) -> Tier | None:
        """Where a ``get`` would find ``key`` now: ``"host"`` (memory, including a record whose
        demotion is being written), ``"disk"``, or ``None``."""
        with self._lock:
            if key in self._host or key in self._writing:
                return "host"
            return "disk" if key in self._disk else None

    def nbytes(self, key: str) -> int | None:
        """Tensor bytes of ``key``'s record (what it costs in host memory), or ``None``."""
        with self._lock:
            held = self._host.get(key) or self._writing.get(key)
            if held is not None:
                return held.nbytes
            file = self._disk.get(key)
            return file.nbytes if file is not None else None

    def discard(self, key: str) -> bool:
        """Forget ``key`` in every tier (its file is deleted); returns whether it was held.
        A load already running finishes for its waiters but promotes nothing."""
        with self._lock:
            held = key in self._host or key in self._writing or key in self._disk
            stale = self._forget_locked(key)
        _delete_files(stale)
        return held

    @property
    def host_bytes_used(self) -> int:
        """Tensor bytes held in host memory now."""
        with self._lock:
            return self._host_used

    @property
    def disk_bytes_used(self) -> int:
        """File bytes held in ``disk_dir`` now."""
        with self._lock:
            return self._disk_used

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return StoreStats(
                **self._counts,
                disk_load_seconds=self._load_seconds,
                host_bytes=self._host_used,
                disk_bytes=self._disk_used,
                host_records=len(self._host),
                disk_records=len(self._disk),
            )

    def close(self) -> None:
        """Wait for running prefetches, then drop host memory. Files stay on disk, and a new
        store on the same ``disk_dir`` indexes them. Later calls raise ``RuntimeError``."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            self._host.clear()
            self._host_used = 0

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- host tier (call with the lock held) --------------------------------------------------

    def _admit_host_locked(self, record: _Held) -> list[_Held]:
        """Insert ``record`` (it fits the bound) as most recent; evict least recent records
        until the bound holds. Returns the evicted records that must be written to disk."""
        self._host[record.key] = record
        self._host_used += record.nbytes
        writes: list[_Held] = []
        while self._host_used > self.host_bytes:
            _, victim = self._host.popitem(last=False)
            self._host_used -= victim.nbytes
            self._counts["host_evictions"] += 1
            self._listener.on_evict("host", victim.nbytes)
            writes.extend(self._demote_locked(victim))
        self._listener.on_bytes("host", self._host_used)
        return writes

    def _demote_locked(self, victim: _Held) -> list[_Held]:
        """What evicting ``victim`` from host needs: nothing when its file exists or is being
        written (write once), a write when the disk can take it, else it is gone."""
        on_disk = self._disk.get(victim.key)
        if on_disk is not None and on_disk.token == victim.token:
            self._disk.move_to_end(victim.key)
            return []
        if self._writing.get(victim.key) is victim or self.disk_dir is None:
            return []
        if not self._fits_disk(victim.nbytes):
            self._count_drop_locked(victim.nbytes)
            return []
        self._writing[victim.key] = victim
        return [victim]

    def _touch_held_locked(self, held: _Held) -> list[_Held]:
        """A hit on a record in memory: most recent in host, or back into host when the hit
        caught it while its demotion was being written."""
        if held.key in self._host:
            self._host.move_to_end(held.key)
            return []
        if held.nbytes <= self.host_bytes:
            return self._admit_host_locked(held)
        return []

    def _forget_locked(self, key: str) -> list[Path]:
        """Remove ``key`` from every index; returns the files to delete (outside the lock)."""
        held = self._host.pop(key, None)
        if held is not None:
            self._host_used -= held.nbytes
            self._listener.on_bytes("host", self._host_used)
        self._writing.pop(key, None)  # its writer sees this and deletes what it wrote
        file = self._disk.pop(key, None)
        if file is None:
            return []
        self._disk_used -= file.file_bytes
        self._listener.on_bytes("disk", self._disk_used)
        return [file.path]

    # -- disk tier -------------------------------------------------------------------------

    def _fits_disk(self, nbytes: int) -> bool:
        return self.disk_dir is not None and nbytes <= self.disk_bytes

    def _path(self, key: str, token: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (file_digest(key, token) + SUFFIX)

    def _write_files(self, records: Iterable[_Held]) -> None:
        """Write each record's file (no lock held), then index it if it is still wanted."""
        for record in records:
            path = self._path(record.key, record.token)
            try:
                file_bytes = self._write_file(path, record)
            except Exception:
                log.warning("activation record %r could not be written", record.key, exc_info=True)
                with self._lock:
                    if self._writing.get(record.key) is record:
                        del self._writing[record.key]
                        if record.key not in self._host:
                            self._count_drop_locked(record.nbytes)
                continue
            file = _File(record.key, record.token, path, file_bytes, record.nbytes)
            with self._lock:
                stale = self._index_written_locked(record, file)
            _delete_files(stale)

    def _index_written_locked(self, record: _Held, file: _File) -> list[Path]:
        """Index a freshly written file; returns files to delete: the new one when the record
        was discarded or replaced meanwhile, else those the disk bound evicts."""
        if self._writing.get(record.key) is not record:
            return [file.path]
        del self._writing[record.key]
        self._counts["disk_writes"] += 1
        self._disk[record.key] = file
        self._disk_used += file.file_bytes
        return self._evict_disk_locked()

    def _evict_disk_locked(self) -> list[Path]:
        stale: list[Path] = []
        while self._disk_used > self.disk_bytes:
            _, victim = self._disk.popitem(last=False)
            self._disk_used -= victim.file_bytes
            self._counts["disk_evictions"] += 1
            self._listener.on_evict("disk", victim.nbytes)
            stale.append(victim.path)
        self._listener.on_bytes("disk", self._disk_used)
        return stale

    def _write_file(self, path: Path, record: _Held) -> int:
        """Write ``record`` to ``path`` atomically; returns the file's size."""
        tensors = _unshared(record.tensors)
        metadata = {
            "format": FORMAT,
            "key": record.key,
            "token": record.token,
            "nbytes": str(record.nbytes),
            "crc32": str(record_crc32(tensors)),
        }
        assert self.disk_dir is not None
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=SUFFIX, dir=self.disk_dir)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            if self._fsync:
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
            size = os.path.getsize(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def _start_load_locked(self, key: str) -> tuple[Future[Record | None] | None, _File | None]:
        """The load to wait for: ``(None, None)`` when ``key`` has no file; ``(future, None)``
        when a load is already running; ``(future, file)`` when the caller must run it."""
        future = self._loading.get(key)
        if future is not None:
            return future, None
        file = self._disk.get(key)
        if file is None:
            return None, None
        future = Future()
        self._loading[key] = future
        return future, file

    def _load(self, file: _File, future: Future[Record | None]) -> None:
        """Read ``file``, promote it, and resolve ``future`` with the tensors or ``None``."""
        tensors: Record | None = None
        writes: list[_Held] = []
        stale: list[Path] = []
        try:
            start = self._clock()
            tensors = self._read_file(file)
            seconds = self._clock() - start
            with self._lock:
                writes, stale = self._finish_load_locked(file, tensors, seconds)
        finally:
            with self._lock:
                if self._loading.get(file.key) is future:
                    del self._loading[file.key]
            future.set_result(tensors)
        _delete_files(stale)
        self._write_files(writes)

    def _finish_load_locked(
        self, file: _File, tensors: Record | None, seconds: float
    ) -> tuple[list[_Held], list[Path]]:
        current = self._disk.get(file.key) is file
        if tensors is None:
            if not current:  # evicted or discarded while being read: not the file's fault
                return [], []
            self._counts["corrupt_files"] += 1
            self._listener.on_corrupt()
            return [], self._forget_locked(file.key)
        self._counts["disk_loads"] += 1
        self._load_seconds += seconds
        self._listener.on_load("disk", seconds, file.nbytes)
        if not current:
            return [], []
        self._disk.move_to_end(file.key)
        if file.key in self._host or file.nbytes > self.host_bytes:
            return [], []
        return self._admit_host_locked(_Held(file.key, file.token, tensors, file.nbytes)), []

    def _read_file(self, file: _File) -> Record | None:
        """The tensors of ``file``, or ``None`` when it is missing, unreadable or not the
        record it should be."""
        try:
            metadata, tensors = read_record(file.path)
        except Exception:
            log.warning("activation file %s unreadable", file.path.name, exc_info=True)
            return None
        if metadata.get("key") != file.key or metadata.get("token") != file.token:
            return None
        if self._verify and metadata.get("crc32") != str(record_crc32(tensors)):
            log.warning("activation file %s fails its CRC", file.path.name)
            return None
        return tensors

    def _index_existing_files(self, root: Path) -> None:
        """Index the files a previous store left, by their headers; delete what fails."""
        found: list[tuple[float, _File]] = []
        for path in root.iterdir():
            if path.name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
            elif _FILE_NAME.fullmatch(path.name) and path.is_file():
                file = _file_from_header(path)
                if file is None:
                    path.unlink(missing_ok=True)
                else:
                    found.append((path.stat().st_mtime, file))
        for _, file in sorted(found, key=lambda item: item[0]):
            older = self._disk.pop(file.key, None)
            if older is not None:  # two versions of a key: the newer wins
                self._disk_used -= older.file_bytes
                older.path.unlink(missing_ok=True)
            self._disk[file.key] = file
            self._disk_used += file.file_bytes
        _delete_files(self._evict_disk_locked())

    # -- counters --------------------------------------------------------------------------

    def _count_hit_locked(self, tier: Tier, nbytes: int) -> None:
        self._counts[f"{tier}_hits"] += 1
        self._listener.on_hit(tier, nbytes)

    def _count_miss_locked(self) -> None:
        self._counts["misses"] += 1
        self._listener.on_miss()

    def _count_drop_locked(self, nbytes: int) -> None:
        self._counts["dropped"] += 1
        self._listener.on_drop(nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the activation store is closed")


_COUNTERS = (
    "host_hits",
    "disk_hits",
    "misses",
    "corrupt_files",
    "host_evictions",
    "disk_evictions",
    "disk_writes",
    "disk_loads",
    "dropped",
)


# -- the device tier -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceTierStats:
    """A snapshot of the device tier's counters since it was created (bytes: now)."""

    hits: int  # gets answered from device memory
    puts: int  # records admitted
    evictions: int  # records freed by the byte bound
    skipped: int  # records larger than the bound, not admitted
    bytes: int  # tensor bytes held now
    records: int  # records held now
    max_bytes: int | None  # the bound (None: "auto", not sized yet)


class DeviceTier:
    """Template records whose row tensors live on the model's device: an LRU bounded in bytes,
    keyed as :class:`ActivationStore` keys records, in front of it.

    ``max_bytes``: the bound on the tensor bytes held; 0 keeps nothing; None is "auto",
    sized by :func:`auto_device_bytes` the first time :meth:`bound` sees the model's device
    (after the model loaded, so the share is of what the model left free). A record larger
    than the bound is not admitted (counted ``skipped``; the store still holds it).

    Records are flat mappings as the store's, but their tensors may be on any device; the
    tier does not copy them, and callers treat them as read-only. Thread-safe: gets run on the
    device thread, puts on the worker's writer thread. The ``listener`` hears hits, evictions
    and bytes as tier ``"device"`` (misses are the store's to count)."""

    def __init__(
        self,
        max_bytes: int | None = 0,
        *,
        listener: StoreListener | None = None,
        auto: Callable[[Any], int] | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None (auto), got {max_bytes}")
        self._max_bytes = max_bytes
        self._auto = auto or auto_device_bytes
        self._listener = listener or StoreListener()
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[Record, int]] = OrderedDict()
        self._used = 0
        self._counts = {"hits": 0, "puts": 0, "evictions": 0, "skipped": 0}

    def bound(self, device: Any) -> int:
        """The bound in bytes; "auto" is sized now, for ``device``, the first time."""
        with self._lock:
            if self._max_bytes is not None:
                return self._max_bytes
        sized = int(self._auto(device))
        with self._lock:
            if self._max_bytes is None:
                self._max_bytes = max(sized, 0)
                log.info("edit cache device tier: %d bytes on %s", self._max_bytes, device)
            return self._max_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether a record of ``nbytes`` can be admitted (0 < nbytes <= the bound)."""
        with self._lock:
            return self._max_bytes is not None and 0 < nbytes <= self._max_bytes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def get(self, key: str) -> Record | None:
        """The record of ``key`` (now the most recent), or None; a hit is counted."""
        with self._lock:
            found = self._held.get(key)
            if found is None:
                return None
            self._held.move_to_end(key)
            self._counts["hits"] += 1
            self._listener.on_hit("device", found[1])
            return found[0]

    def make_room(self, nbytes: int) -> bool:
        """Evict least recently used records until a record of ``nbytes`` fits beside the
        rest; returns whether it can be admitted at all. Called before a record is gathered
        on the device, so the gathering never holds more than the bound beside the tier."""
        with self._lock:
            if self._max_bytes is None or not 0 < nbytes <= self._max_bytes:
                return False
            self._evict_locked(self._max_bytes - nbytes)
            return True

    def put(self, key: str, tensors: Record) -> bool:
        """Hold ``tensors`` as the record of ``key`` (most recent), replacing any earlier one
        and evicting least recently used records to stay within the bound. Returns False,
        counted ``skipped``, when the record is larger than the bound."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._used -= old[1]
            if self._max_bytes is None or not 0 < nbytes <= self._max_bytes:
                self._counts["skipped"] += 1
                self._listener.on_bytes("device", self._used)
                return False
            self._evict_locked(self._max_bytes - nbytes)
            self._held[key] = (dict(tensors), nbytes)
            self._used += nbytes
            self._counts["puts"] += 1
            self._listener.on_bytes("device", self._used)
            return True

    def discard(self, key: str) -> bool:
        """Forget ``key``; returns whether it was held."""
        with self._lock:
            old = self._held.pop(key, None)
            if old is None:
                return False
            self._used -= old[1]
            self._listener.on_bytes("device", self._used)
            return True

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._held)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._used

    @property
    def reserved_bytes(self) -> int:
        """The device memory the tier may fill: its bound once sized (0 before), or what it
        holds if that is more. The worker's memory guard counts this beside the models."""
        with self._lock:
            return max(self._max_bytes or 0, self._used)

    def cede(self, nbytes: int) -> int:
        """Lower the bound by up to ``nbytes`` (not below 0) and evict down to it, so that a
        model load can have that memory; returns how far the bound dropped. The records
        evicted are still in the store, and the bound stays lowered."""
        with self._lock:
            if self._max_bytes is None or nbytes <= 0:
                return 0
            dropped = min(nbytes, self._max_bytes)
            self._max_bytes -= dropped
            self._evict_locked(self._max_bytes)
        if dropped:
            log.info("edit cache device tier: bound lowered by %d bytes for a model load", dropped)
        return dropped

    def stats(self) -> DeviceTierStats:
        with self._lock:
            return DeviceTierStats(
                **self._counts,
                bytes=self._used,
                records=len(self._held),
                max_bytes=self._max_bytes,
            )

    def _evict_locked(self, limit: int) -> None:
        while self._held and self._used > limit:
            _, (_, nbytes) = self._held.popitem(last=False)
            self._used -= nbytes
            self._counts["evictions"] += 1
            self._listener.on_evict("device", nbytes)
        self._listener.on_bytes("device", self._used)


# -- sizing the tiers ------------------------------------------------------------------------------

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def physical_memory_bytes(cgroup_files: Sequence[Path] = _CGROUP_LIMITS) -> int:
    """The machine's memory (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``), or the process's cgroup
    memory limit when that is lower: a container sees the node's memory in ``sysconf``, and
    going past its own limit gets it killed."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in cgroup_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1) means no limit
            total = min(total, int(text))
    return int(total)


def auto_host_bytes(
    physical: int | None = None,
    *,
    share: float = defaults.EDIT_CACHE_HOST_SHARE,
    floor: int = defaults.EDIT_CACHE_HOST_FLOOR,
) -> int:
    """The host tier's "auto" bound: ``share`` of :func:`physical_memory_bytes` (or of
    ``physical``), at least ``floor``."""
    memory = physical_memory_bytes() if physical is None else physical
    return max(int(memory * share), floor)


def auto_disk_bytes(
    directory: Path | str,
    *,
    share: float = defaults.EDIT_CACHE_DISK_SHARE,
    usage: Callable[[Path], Any] = shutil.disk_usage,
) -> int:
    """The disk tier's "auto" bound: ``share`` of what the filesystem of ``directory``
    (created if missing) has free, plus the record files already in it (an earlier run's,
    which the store indexes and would otherwise evict to fit a bound they shrank); at least
    1 MiB, so a full disk still gives a valid tier (its failed writes count as dropped)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    held = sum(
        path.stat().st_size
        for path in root.iterdir()
        if _FILE_NAME.fullmatch(path.name) and path.is_file()
    )
    return max(int((usage(root).free + held) * share), 2**20)


def auto_device_bytes(
    device: Any,
    *,
    share: float = defaults.EDIT_CACHE_DEVICE_SHARE,
    free: Callable[[torch.device], int] | None = None,
) -> int:
    """The device tier's "auto" bound: on CUDA, ``share`` of the memory free on ``device``
    now (the driver's free memory plus what torch's allocator holds unused); elsewhere 0, as
    a CPU worker's device is the host memory the host tier already holds."""
    where = torch.device(device)
    if where.type != "cuda":
        return 0
    available = (free or _cuda_free_bytes)(where)
    return max(int(available * share), 0)


def _cuda_free_bytes(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(unused, 0))


def resolve_bytes(value: int | str, auto: Callable[[], int]) -> int:
    """A tier's bound as configured: the given bytes, or ``auto()`` for ``"auto"``."""
    if value == "auto":
        return auto()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"a byte bound is a count >= 0 or 'auto', got {value!r}")


# -- helpers ---------------------------------------------------------------------------------------


def file_digest(key: str, token: str) -> str:
    """The file name stem of a record: sha256 over the key and its version token."""
    return hashlib.sha256(key.encode() + b"\0" + token.encode()).hexdigest()


def record_nbytes(tensors: Record) -> int:
    """Tensor bytes of a record; checks it is a flat mapping of names to CPU tensors."""
    total = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a record maps names to tensors, got {type(name)} -> {type(tensor)}")
        if tensor.device.type != "cpu":
            raise ValueError(f"record tensor {name!r} is on {tensor.device}, not the CPU")
        total += tensor.numel() * tensor.element_size()
    return total


def record_crc32(tensors: Record) -> int:
    """CRC-32 of a record's tensor bytes in name order (shape and dtype are in the header)."""
    crc = 0
    for name in sorted(tensors):
        data = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(data.numpy().data, crc)
    return crc


def _unshared(tensors: Record) -> dict[str, torch.Tensor]:
    """Contiguous tensors, cloned where two overlap in memory (safetensors refuses those;
    disjoint views of one buffer, as :func:`read_record` returns them, are fine)."""
    out = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in out.items()
        if t.numel() > 0
    )
    reach = 0
    for start, end, name in spans:
        if start < reach:
            out[name] = out[name].clone()
        reach = max(reach, end)
    return out


def read_record(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read a safetensors file *into memory*: its metadata, and its tensors as views of one
    buffer filled by one ``readinto``. Raises ``ValueError`` or ``OSError`` on a bad file.

    Why not ``safetensors.torch.load_file``: it memory-maps the file and returns tensors whose
    pages are read from disk on first touch (measured: the "load" of 128 MiB takes 1-4 ms, the
    first sum over it 300-850 ms), so a prefetch would hide nothing and host bytes would be
    page cache the kernel may drop. Writing still uses ``save_file``.
    """
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        header, data_start = _read_header(handle, size)
        buffer = torch.empty(size - data_start, dtype=torch.uint8)
        view = buffer.numpy().data.cast("B")
        filled = 0
        while filled < len(view):
            got = handle.readinto(view[filled:])
            if not got:
                raise ValueError(f"file ends {len(view) - filled} bytes early")
            filled += got
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: _tensor_view(buffer, name, entry) for name, entry in header.items()}
    return metadata, tensors


_MAX_HEADER = 64 * 2**20
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def _read_header(handle: Any, size: int) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data starts."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise ValueError("no safetensors header")
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, _MAX_HEADER):
        raise ValueError(f"header length {length} does not fit a file of {size} bytes")
    header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not an object")
    return header, 8 + length


def _tensor_view(buffer: torch.Tensor, name: str, entry: Any) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = [int(n) for n in entry["shape"]]
    start, end = (int(n) for n in entry["data_offsets"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= start <= end <= buffer.numel() or end - start != math.prod(shape) * itemsize:
        raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not match its shape")
    raw = buffer[start:end]
    if start % itemsize:  # safetensors aligns data; copy where a writer did not
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def _file_from_header(path: Path) -> _File | None:
    """Index entry of a file left by an earlier store, or ``None`` when its header does not
    vouch for it (foreign format, or a name that is not the hash of its key and token)."""
    try:
        with open(path, "rb") as handle:
            header = _read_header(handle, os.fstat(handle.fileno()).st_size)[0]
        metadata = header.get("__metadata__") or {}
        key, token = metadata["key"], metadata["token"]
        nbytes = int(metadata["nbytes"])
    except Exception:
        return None
    if metadata.get("format") != FORMAT or path.name != file_digest(key, token) + SUFFIX:
        return None
    return _File(key, token, path, path.stat().st_size, nbytes)


def _delete_files(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            log.warning("could not delete activation file %s", path.name, exc_info=True)


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a template key is a non-empty string, got {key!r}")
    try:
        key.encode()
    except UnicodeEncodeError:
        raise ValueError(f"a template key must be valid UTF-8, got {key!r}") from None
    return key


def _check_bounds(
    host_bytes: int, disk_dir: Path | str | None, disk_bytes: int, prefetch_threads: int
) -> None:
    if host_bytes < 0:
        raise ValueError(f"host_bytes must be >= 0, got {host_bytes}")
    if disk_dir is not None and disk_bytes <= 0:
        raise ValueError(f"disk_bytes must be > 0 with a disk_dir, got {disk_bytes}")
    if disk_dir is None and disk_bytes:
        raise ValueError(f"disk_bytes={disk_bytes} needs a disk_dir")
    if prefetch_threads < 1:
        raise ValueError(f"prefetch_threads must be >= 1, got {prefetch_threads}")


# -- Algorithm 1 ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachePlan:
    """Which transformer blocks of one denoising step read cached activations."""

    use: tuple[bool, ...]  # per block, in execution order: load the cache (True) or recompute
    latency_s: float  # the step's latency with this plan, in the two-stream pipeline model


def plan_cache_use(
    compute_without: Sequence[float], compute_with: Sequence[float], load: Sequence[float]
) -> CachePlan:
    """Algorithm 1 of InstGenIE (§4.2): per block, cache or recompute, greedily in block order.

    Called with measured per-block costs in seconds: ``compute_without[i]``, block i computing
    every token; ``compute_with[i]``, computing the masked tokens given the cache;
    ``load[i]``, bringing block i's cached activations to the device. The model is two
    streams: the load stream reads the chosen blocks' activations back to back from time 0;
    block i computes after block i-1 and, when cached, after its load. Block i uses the cache
    when ``max(load_{i-1} + L_i, comp_{i-1}) + C_with_i <= comp_{i-1} + C_without_i``, where
    ``load_{i-1}`` and ``comp_{i-1}`` are when the two streams finish block i-1's work.

    It is not optimal. ``benchmarks/bench_cache_plan.py`` compares it with brute force over all
    2^N plans: 2,000 random cases per setting, N = 2, 4, 6, 8, 10, ``compute_without`` uniform
    in [0.5, 1.5], ``compute_with`` a uniform 5-100% of it, each load uniform in [0, s]
    (2 vCPU x86_64, load average 1.4-2.2 from other agents; the figures do not depend on it):

    * s = 0 (every load free): never loses (it then caches exactly the blocks with
      ``C_with <= C_without``, which is optimal);
    * s = 0.25: loses in at most 0.1% of cases, by at most 2%;
    * s = 0.5: loses in 3-6% of cases, by 2-9% on average, at worst 1.30x the optimum;
    * s = 1: loses in 9% (N = 2) to 41% (N = 10) of cases, by 6-13% on average, at worst 1.63x;
    * s = 2: loses in 6% (N = 2) to 80% (N = 10) of cases, by 8-14% on average, at worst 1.57x;
    * s = 100 (loading almost never pays): loses in at most 1.3% of cases, at worst 1.24x.

    It loses when loads are comparable to the savings: a greedy choice that ends block i a
    little sooner occupies the load stream that a later block with a larger saving needed
    (``test_algorithm_1_is_greedy_not_optimal``: 20 s against an optimum of 11 s). The exact
    optimum has to carry the Pareto set of (load end, compute end) pairs from block to block,
    which is not O(N); no exact O(N) rule is known here, so the paper's algorithm is kept as
    it is and nothing else is offered.
    """
    n = len(compute_without)
    _check_costs(compute_without, compute_with, load, n)
    comp = load_end = 0.0
    use: list[bool] = []
    for c_without, c_with, c_load in zip(compute_without, compute_with, load, strict=True):
        with_cache = max(load_end + c_load, comp) + c_with
        if with_cache <= comp + c_without:
            load_end += c_load
            comp = with_cache
            use.append(True)
        else:
            comp += c_without
            use.append(False)
    return CachePlan(tuple(use), comp)


def pipeline_latency(
    use: Sequence[bool],
    compute_without: Sequence[float],
    compute_with: Sequence[float],
    load: Sequence[float],
) -> float:
    """Latency of a given plan in :func:`plan_cache_use`'s two-stream model (for comparing
    plans, e.g. against brute force)."""
    _check_costs(compute_without, compute_with, load, len(use))
    comp = load_end = 0.0
    costs = zip(use, compute_without, compute_with, load, strict=True)
    for used, c_without, c_with, c_load in costs:
        if used:
            load_end += c_load
            comp = max(comp, load_end) + c_with
        else:
            comp += c_without
    return comp


def _check_costs(
    compute_without: Sequence[float], compute_with: Sequence[float], load: Sequence[float], n: int
) -> None:
    lengths = (len(compute_without), len(compute_with), len(load))
    if lengths != (n, n, n):
        raise ValueError(f"costs must have one entry per block, got lengths {lengths} for {n}")
    for name, costs in (
        ("compute_without", compute_without),
        ("compute_with", compute_with),
        ("load", load),
    ):
        for i, cost in enumerate(costs):
            if not math.isfinite(cost) or cost < 0:
                raise ValueError(f"{name}[{i}] must be a finite cost >= 0, got {cost!r}")
