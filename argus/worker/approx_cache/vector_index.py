"""Prompt-embedding indexes for the approximate cache: one protocol, two real Qdrant engines.

:class:`VectorIndex` is what :class:`argus.worker.approx_cache.cache.ApproximateCache` needs:
top-1 cosine search restricted to one *key* (a keyword payload field, ``KEY_FIELD``, with a
keyword payload index), upserts, partial payload updates, deletes and a scroll over everything
(recovery after a restart). Point ids are UUID strings.

* :class:`EdgeVectorIndex` — the embedded default: Qdrant Edge (``qdrant-edge-py``), the real
  Qdrant engine in process, over a directory. Top-1 over 100k 384-d vectors answers in about a
  millisecond once the HNSW graph is built.
* :class:`QdrantServerIndex` — production: a Qdrant server through ``qdrant-client``. Its local
  in-process mode (``QdrantClient(location=":memory:")`` or ``path=``) runs the same calls and
  is what the tests use, since no Qdrant server runs here; local mode is a brute-force numpy
  scan (≈130 ms at 100k) and not a serving backend.

**Why Edge optimises in a child process.** ``EdgeShard.optimize()`` (the HNSW build) holds the
GIL for its whole run — measured: a Python thread ticking every millisecond got one tick during
a 6 s optimise — so a background *thread* would stop every gRPC thread of the worker, health
checks included, for seconds to minutes. Instead, after ``optimize_after`` updates the index
flushes, copies its live shard directory to the next *generation* (writers wait, searches go
on), and a child process (``python -m argus.worker.approx_cache.vector_index optimize DIR``)
builds the graph on the copy. Meanwhile updates go to the live shard and to a journal. When the
child is done the optimised shard is loaded, the journal replayed into it and it replaces the
live one; ``CURRENT`` names the live generation, so a restart at any point opens a complete
shard. What stays on the request path is ``EdgeShard.load`` of the new generation (it holds the
GIL too; see ``benchmarks/bench_retrieval.py`` for its cost) once per rebuild, and the extra
disk of one copy during a rebuild.

Every Edge call also holds the GIL, so calls never overlap; a lock makes that explicit and
guards the swap and ``close``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt
import qdrant_edge as qe

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
KEY_FIELD = "key"  # the keyword payload field requests are matched on
CURRENT = "CURRENT"  # file naming the live generation directory of an EdgeVectorIndex
GENERATION_PREFIX = "gen-"
LOCK_FILE = "LOCK"  # held (flock) by the process that has the index open


@dataclass(frozen=True)
class IndexMatch:
    """The nearest point of a search."""

    id: str  # point id (a UUID string)
    score: float  # cosine similarity, in [-1, 1]
    payload: dict[str, Any]


@dataclass(frozen=True)
class IndexRecord:
    """A point as a scroll returns it (no vector)."""

    id: str
    payload: dict[str, Any]


class VectorIndex(Protocol):
    """What the approximate cache needs from a vector database. Implementations are
    thread-safe; errors (a server down, a closed index) are raised, the cache counts them."""

    @property
    def dim(self) -> int: ...

    def search(self, vector: FloatArray, key: str) -> IndexMatch | None:
        """The nearest point whose ``KEY_FIELD`` equals ``key``, with its payload; ``None``
        when no point has that key."""
        ...

    def upsert(self, point_id: str, vector: FloatArray, payload: Mapping[str, Any]) -> None:
        """Insert or replace one point; visible to searches when this returns."""
        ...

    def set_payload(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge fields into the payloads of existing points (point id → fields)."""
        ...

    def delete(self, point_ids: Sequence[str]) -> None:
        """Delete points; unknown ids are ignored."""
        ...

    def scroll(self, batch: int = 1024) -> Iterator[IndexRecord]:
        """Every point with its payload, in pages of ``batch``."""
        ...

    def count(self) -> int: ...

    def close(self) -> None:
        """Flush and release; idempotent."""
        ...


class IndexOutageError(ConnectionError):
    """The vector database is unreachable (here: an injected outage)."""


class OutageSwitch:
    """An index that fails like an unreachable vector database while ``flag_file`` exists.

    Fault injection for tests and drills of the AC → SM switch (``argus worker
    --index-outage-file``): create the file and every call raises :class:`IndexOutageError`,
    as a Qdrant server behind a dead network would; delete it and calls reach ``index`` again.
    With an embedded index (Qdrant Edge) this is the only way to take "the database" away.
    """

    def __init__(self, index: VectorIndex, flag_file: str | Path) -> None:
        self.index = index
        self.flag_file = Path(flag_file)

    def _check(self) -> None:
        if self.flag_file.exists():
            raise IndexOutageError(f"vector index unreachable ({self.flag_file} exists)")

    @property
    def dim(self) -> int:
        return self.index.dim

    def search(self, vector: FloatArray, key: str) -> IndexMatch | None:
        self._check()
        return self.index.search(vector, key)

    def upsert(self, point_id: str, vector: FloatArray, payload: Mapping[str, Any]) -> None:
        self._check()
        self.index.upsert(point_id, vector, payload)

    def set_payload(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        self._check()
        self.index.set_payload(updates)

    def delete(self, point_ids: Sequence[str]) -> None:
        self._check()
        self.index.delete(point_ids)

    def scroll(self, batch: int = 1024) -> Iterator[IndexRecord]:
        self._check()
        return self.index.scroll(batch)

    def count(self) -> int:
        self._check()
        return self.index.count()

    def close(self) -> None:
        self.index.close()


def check_vector(vector: npt.ArrayLike, dim: int) -> FloatArray:
    """``vector`` as a finite, non-zero float32 array of shape ``(dim,)``; raises ValueError."""
    array = np.asarray(vector, dtype=np.float32)
    if array.shape != (dim,):
        raise ValueError(f"embedding of shape {array.shape}; expected ({dim},)")
    if not np.isfinite(array).all():
        raise ValueError("embedding is not finite")
    if not np.any(array):
        raise ValueError("embedding is the zero vector; cosine similarity is undefined")
    return array


# -- Qdrant Edge ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EdgeIndexConfig:
    """How an Edge shard is built and searched (fixed when the shard is created, except the
    search-time ``hnsw_ef`` and ``oversampling``)."""

    m: int = 16  # HNSW edges per node
    ef_construct: int = 100  # HNSW build candidates
    hnsw_ef: int | None = 256
    """Search candidates (None: Qdrant's default, ef_construct). 256 because at 100k cached
    prompts (``bench_retrieval.py --size 100k --hnsw-ef 100,256,512``, real MiniLM
    embeddings with SYNTHETIC near-duplicate neighbours; two builds, 2-core CPU machine)
    Qdrant's 100 returned a point within 0.01 cosine of the exact best for 87-90.5% of the
    queries, 256 for 95-95.5% and 512 for 98-99%, at 0.34-0.37 / 0.52 / 0.79-0.80 ms p50 and
    1.4-1.7 / 0.9-1.1 / 1.1-1.2 ms p99: a lookup that settles for a clearly worse neighbour
    resumes from a less similar latent or misses its threshold."""
    int8: bool = False  # scalar-quantise vectors to int8 (search on int8, rescore in fp32)
    oversampling: float = 2.0  # int8 only: candidates fetched per result before rescoring
    indexing_threshold_kb: int | None = None  # segments smaller than this stay brute-force
    search_threads: int | None = None  # Edge's search pool; None: one thread per CPU

    def edge_config(self, dim: int, *, create: bool = False) -> qe.EdgeConfig:
        """The shard's config; ``create``: for a new shard, which gets no write-ahead log
        (see :class:`EdgeVectorIndex`). Loading leaves the log setting as the shard has it:
        Edge refuses to load a shard with another one."""
        quantization = (
            qe.ScalarQuantizationConfig(qe.ScalarType.Int8, quantile=0.99, always_ram=True)
            if self.int8
            else None
        )
        optimizers = (
            qe.EdgeOptimizersConfig(indexing_threshold=self.indexing_threshold_kb)
            if self.indexing_threshold_kb is not None
            else None
        )
        return qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine),
            hnsw_config=qe.HnswIndexConfig(
                m=self.m, ef_construct=self.ef_construct, full_scan_threshold=10_000
            ),
            quantization_config=quantization,
            optimizers=optimizers,
            max_search_threads=self.search_threads,
            wal_enabled=False if create else None,
        )

    def search_params(self) -> qe.SearchParams | None:
        if self.hnsw_ef is None and not self.int8:
            return None
        quantization = (
            qe.QuantizationSearchParams(rescore=True, oversampling=self.oversampling)
            if self.int8
            else None
        )
        return qe.SearchParams(hnsw_ef=self.hnsw_ef, quantization=quantization)


_Op = tuple[str, Any]  # a journal entry: ("upsert", points) | ("set", updates) | ("delete", ids)


class EdgeVectorIndex:
    """A Qdrant Edge shard under ``path``, rebuilt off-process after ``optimize_after``
    updates, or sooner once the updates since the last rebuild reach ``vacuum_ratio`` times
    the points it holds (and at least ``vacuum_min``); ``optimize_after=None``: never in the
    background, call :meth:`optimize` yourself.

    Why the second rule: a deleted or replaced point stays in the shard's unoptimised
    segment, in memory and in its files, until a rebuild drops it. A full cache evicts one
    entry per insert, so a worker whose cache bound is small next to ``optimize_after``
    (1,000 entries under the soak) carried up to 10,000 dead points: measured, its memory
    grew by about 4 MB per 1,000 inserts until the first rebuild. Tying rebuilds to the live
    size, as Qdrant's vacuum optimiser does with the share of deleted points (there 20%; here
    half the live count in updates, about a quarter in dead points under eviction), keeps the
    dead points a bounded share of the live ones at any cache size. A rebuild of a
    1,000-point shard costs about 0.2 s to copy, 0.2 s of CPU in the child and 0.07 s to load
    (measured on the 2-core CPU machine at load 9), so rebuilding every few hundred updates
    is cheap.

    **No write-ahead log.** Edge's log is two 32 MB files, memory-mapped and written
    sequentially, about 2 KB per update; a rebuild copies the generation directory, log
    included, so the log's position ran on across generations and its mapped pages counted
    in the worker's resident memory, growing about 1.5 MB a minute under the soak (about 700
    updates a minute) until a file filled, 20 minutes on. Shards this index creates have no
    log (Edge's ``wal_enabled=False``): an update is durable once the shard is flushed, which
    happens when a rebuild starts (every ``max(vacuum_min, vacuum_ratio × points)`` updates at
    most) and on :meth:`close`. A worker killed in between reopens the state of the last
    flush; for a cache that is a few entries short (their latent files are swept at start) or
    a few evicted entries back (their files are gone: a counted miss, and the entry purged).
    A shard created with a log (by an earlier version) keeps it.

    One process opens a directory: ``LOCK`` in it is held (``flock``) from before anything is
    read or removed until :meth:`close`; a second opener fails at once, touching nothing."""

    def __init__(
        self,
        path: str | Path,
        dim: int,
        *,
        config: EdgeIndexConfig | None = None,
        optimize_after: int | None = 10_000,
        vacuum_ratio: float | None = 0.5,
        vacuum_min: int = 500,
        optimize_timeout_s: float = 6 * 3600,
    ) -> None:
        if dim <= 0:
            raise ValueError(f"dim {dim} must be positive")
        if optimize_after is not None and optimize_after <= 0:
            raise ValueError(f"optimize_after {optimize_after} must be positive or None")
        if vacuum_ratio is not None and vacuum_ratio <= 0:
            raise ValueError(f"vacuum_ratio {vacuum_ratio} must be positive or None")
        if vacuum_min <= 0:
            raise ValueError(f"vacuum_min {vacuum_min} must be positive")
        self.path = Path(path)
        self._dim = dim
        self.config = config or EdgeIndexConfig()
        self.optimize_after = optimize_after
        self.vacuum_ratio = vacuum_ratio
        self.vacuum_min = vacuum_min
        self.optimize_timeout_s = optimize_timeout_s
        self._search_params = self.config.search_params()
        self._shard_lock = threading.Lock()  # every call on the live shard; the swap
        self._write_lock = threading.Lock()  # updates, the journal, starting a rebuild
        self._changes = 0  # updates since the last rebuild started
        self._points = 0  # points the live shard holds (counted from updates between rebuilds)
        self._journal: list[_Op] | None = None  # updates since the copy of a running rebuild
        self._rebuild: threading.Thread | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._closed = False
        self.rebuilds = 0  # completed background rebuilds
        self._generation, self._shard = self._open()
        info = self._shard.info()
        self._changes = info.points_count - info.indexed_vectors_count
        self._points = info.points_count

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def generation_dir(self) -> Path:
        return self.path / self._generation

    # -- opening ---------------------------------------------------------------------------

    def _open(self) -> tuple[str, qe.EdgeShard]:
        """Take the directory's lock, open the live generation (creating the first one), then
        remove leftovers of a rebuild that did not finish. A second opener of the same
        directory fails on the lock, before it could delete anything."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_directory(self.path)
        try:
            return self._open_locked()
        except BaseException:
            self._lock_file.close()
            raise

    def _open_locked(self) -> tuple[str, qe.EdgeShard]:
        current = self.path / CURRENT
        name = current.read_text().strip() if current.exists() else ""
        if name and (self.path / name).is_dir():
            # with a config, load checks it against the stored segments (dim, distance)
            shard = qe.EdgeShard.load(str(self.path / name), self.config.edge_config(self._dim))
        else:
            name = f"{GENERATION_PREFIX}{0:06d}"
            shutil.rmtree(self.path / name, ignore_errors=True)
            shard = qe.EdgeShard.create(
                str(self.path / name), self.config.edge_config(self._dim, create=True)
            )
            shard.update(
                qe.UpdateOperation.create_field_index(KEY_FIELD, qe.PayloadSchemaType.Keyword)
            )
            shard.flush()
            _write_atomically(current, name)
        for stale in self.path.glob(GENERATION_PREFIX + "*"):
            if stale.name != name:
                shutil.rmtree(stale, ignore_errors=True)
        return name, shard

    # -- reading ---------------------------------------------------------------------------

    def search(self, vector: FloatArray, key: str) -> IndexMatch | None:
        request = qe.SearchRequest(
            query=qe.Query.Nearest(_as_list(vector)),
            limit=1,
            filter=_key_filter(key),
            params=self._search_params,
            with_payload=True,
        )
        with self._shard_lock:
            found = self._live().search(request)
        if not found:
            return None
        point = found[0]
        return IndexMatch(str(point.id), float(point.score), dict(point.payload or {}))

    def scroll(self, batch: int = 1024) -> Iterator[IndexRecord]:
        offset: qe.PointId | None = None
        while True:
            request = qe.ScrollRequest(
                offset=offset, limit=batch, with_payload=True, with_vector=False
            )
            with self._shard_lock:
                records, offset = self._live().scroll(request)
            for record in records:
                yield IndexRecord(str(record.id), dict(record.payload or {}))
            if offset is None or not records:
                return

    def count(self) -> int:
        with self._shard_lock:
            return self._live().count(qe.CountRequest(exact=True))

    def info(self) -> qe.ShardInfo:
        with self._shard_lock:
            return self._live().info()

    def _live(self) -> qe.EdgeShard:
        if self._closed:
            raise RuntimeError(f"index {self.path} is closed")
        return self._shard

    # -- writing ---------------------------------------------------------------------------

    def upsert(self, point_id: str, vector: FloatArray, payload: Mapping[str, Any]) -> None:
        self.upsert_many([(point_id, vector, payload)])

    def upsert_many(self, points: Sequence[tuple[str, FloatArray, Mapping[str, Any]]]) -> None:
        """Insert or replace many points in one update (bulk loads, the benchmark)."""
        edge_points = [qe.Point(pid, _as_list(vec), dict(pl)) for pid, vec, pl in points]
        self._apply(("upsert", edge_points), len(edge_points), len(edge_points))

    def set_payload(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        if updates:
            self._apply(("set", {pid: dict(fields) for pid, fields in updates.items()}), 0)

    def delete(self, point_ids: Sequence[str]) -> None:
        if point_ids:
            self._apply(("delete", list(point_ids)), len(point_ids), -len(point_ids))

    def _apply(self, op: _Op, changes: int, points: int = 0) -> None:
        with self._write_lock:
            with self._shard_lock:
                _apply_op(self._live(), op)
            if self._journal is not None:
                self._journal.append(op)
            self._changes += changes
            # an upsert may replace a point, a delete miss one: an estimate, recounted on swap
            self._points = max(0, self._points + points)
            self._maybe_start_rebuild()

    def flush(self) -> None:
        with self._shard_lock:
            self._live().flush()

    # -- optimisation ----------------------------------------------------------------------

    def optimize(self) -> bool:
        """Build the HNSW graph now, in this thread, holding the GIL throughout: for offline
        builds and benchmarks, never on a serving worker. Returns whether anything changed."""
        with self._write_lock, self._shard_lock:
            changed = self._live().optimize()
            self._changes = 0
            return changed

    def wait_for_rebuild(self, timeout_s: float | None = None) -> bool:
        """Wait for a background rebuild to finish; returns False on timeout.

        Rebuilds run on their own thread while searches go on against the old graph, so this
        is the synchronisation point that tests and callers use before reading what a
        rebuild changed (the graph, its size); True at once when none is running."""
        thread = self._rebuild
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _maybe_start_rebuild(self) -> None:
        """Start a background rebuild (write lock held) once enough updates accumulated."""
        if self.optimize_after is None:
            return
        due = self._changes >= self.optimize_after
        if self.vacuum_ratio is not None:
            dead = max(self.vacuum_min, self.vacuum_ratio * self._points)
            due = due or self._changes >= dead
        if due and self._rebuild is None and not self._closed:
            self._start_rebuild()

    def _start_rebuild(self) -> None:
        number = int(self._generation[len(GENERATION_PREFIX) :]) + 1
        target = self.path / f"{GENERATION_PREFIX}{number:06d}"
        with self._shard_lock:
            self._shard.flush()
        # writers wait for the copy (the write lock is held); searches go on, reading only
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.generation_dir, target)
        self._journal = []
        self._changes = 0
        self._rebuild = threading.Thread(
            target=self._run_rebuild, args=(target,), name="edge-rebuild", daemon=True
        )
        self._rebuild.start()

    def _run_rebuild(self, target: Path) -> None:
        fresh: qe.EdgeShard | None = None
        try:
            self._optimize_in_child(target)
            fresh = qe.EdgeShard.load(str(target))  # holds the GIL: the one stall per rebuild
            self._swap(target, fresh)
        except Exception:
            if not self._closed:
                log.exception("rebuilding the Edge index in %s failed; serving the old one", target)
            if fresh is not None and self._shard is not fresh:
                fresh.close()
            shutil.rmtree(target, ignore_errors=True)
        finally:
            with self._write_lock:
                self._journal = None
                self._rebuild = None
                self._child = None

    def _optimize_in_child(self, target: Path) -> None:
        command = [
            sys.executable,
            "-m",
            "argus.worker.approx_cache.vector_index",
            "optimize",
            str(target),
        ]
        with self._write_lock:
            if self._closed:
                raise RuntimeError("closed")
            self._child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        child = self._child
        try:
            code = child.wait(timeout=self.optimize_timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise RuntimeError(f"optimiser ran over {self.optimize_timeout_s} s") from None
        if code != 0:
            raise RuntimeError(f"optimiser exited with {code}")

    def _swap(self, target: Path, fresh: qe.EdgeShard) -> None:
        """Replay the journal into the optimised shard and make it the live one."""
        with self._write_lock:
            if self._closed:
                raise RuntimeError("closed")
            for op in self._journal or ():
                _apply_op(fresh, op)
            fresh.flush()
            self._points = fresh.info().points_count
            with self._shard_lock:
                old, self._shard = self._shard, fresh
                old_dir = self.generation_dir
                self._generation = target.name
            _write_atomically(self.path / CURRENT, target.name)
            self.rebuilds += 1
        old.close()
        shutil.rmtree(old_dir, ignore_errors=True)

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
        if self._rebuild is not None:
            self._rebuild.join()
        with self._shard_lock:
            self._shard.flush()
            self._shard.close()
        self._lock_file.close()


def _lock_directory(path: Path) -> IO[bytes]:
    """An open ``path/LOCK`` holding an exclusive ``flock`` (released when it is closed, or
    when the process dies); ``BlockingIOError`` naming the directory when another holds it."""
    lock = open(path / LOCK_FILE, "a+b")  # noqa: SIM115 - held open until close()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise BlockingIOError(
            f"{path}: the Edge index is locked by another opener (another worker on the same "
            "--cache-dir?)"
        ) from None
    return lock


def _apply_op(shard: qe.EdgeShard, op: _Op) -> None:
    kind, arg = op
    if kind == "upsert":
        shard.update(qe.UpdateOperation.upsert_points(arg))
    elif kind == "set":
        for point_id, fields in arg.items():
            shard.update(qe.UpdateOperation.set_payload([point_id], fields))
    elif kind == "delete":
        shard.update(qe.UpdateOperation.delete_points(arg))
    else:  # pragma: no cover - internal
        raise AssertionError(kind)


def _key_filter(key: str) -> qe.Filter:
    return qe.Filter(must=[qe.FieldCondition(key=KEY_FIELD, match=qe.MatchValue(key))])


def _as_list(vector: FloatArray) -> list[float]:
    values: list[float] = np.asarray(vector, dtype=np.float32).tolist()
    return values


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- Qdrant server (qdrant-client) -----------------------------------------------------------


class QdrantServerIndex:
    """A collection on a Qdrant server through ``qdrant-client`` (production).

    ``client`` is a URL (``http://qdrant:6333``), ``":memory:"``, or a ``QdrantClient``
    (which this index then does not close). The collection is created with cosine distance
    and a keyword payload index on ``KEY_FIELD`` when missing, and checked for ``dim`` when
    present. A remote client is thread-safe and used concurrently; a local-mode client
    (``":memory:"`` or ``path=``) is not, so its calls are serialised here (a ``path=``
    client must be built with ``force_disable_check_same_thread=True`` to be used from the
    cache's writer thread).
    """

    def __init__(
        self,
        client: Any,
        collection: str,
        dim: int,
        *,
        timeout_s: int = 5,
        hnsw_ef: int | None = None,
    ) -> None:
        from qdrant_client import QdrantClient, models

        if dim <= 0:
            raise ValueError(f"dim {dim} must be positive")
        self._models = models
        self._owns_client = isinstance(client, str)
        self.client: Any = (
            QdrantClient(location=client, timeout=timeout_s) if isinstance(client, str) else client
        )
        options = self.client.init_options
        local = options.get("location") == ":memory:" or options.get("path") is not None
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if local else contextlib.nullcontext()
        )
        self.collection = collection
        self._dim = dim
        self._search_params = models.SearchParams(hnsw_ef=hnsw_ef) if hnsw_ef else None
        self._closed = False
        with self._lock:
            self._ensure_collection()

    @property
    def dim(self) -> int:
        return self._dim

    def _ensure_collection(self) -> None:
        models = self._models
        if self.client.collection_exists(self.collection):
            size = self.client.get_collection(self.collection).config.params.vectors.size
            if size != self._dim:
                raise ValueError(
                    f"collection {self.collection!r} holds {size}-d vectors; expected {self._dim}"
                )
            return
        self.client.create_collection(
            self.collection,
            vectors_config=models.VectorParams(size=self._dim, distance=models.Distance.COSINE),
        )
        with warnings.catch_warnings():  # local mode warns that payload indexes are no-ops
            warnings.simplefilter("ignore", UserWarning)
            self.client.create_payload_index(
                self.collection, KEY_FIELD, models.PayloadSchemaType.KEYWORD
            )

    def search(self, vector: FloatArray, key: str) -> IndexMatch | None:
        models = self._models
        key_filter = models.Filter(
            must=[models.FieldCondition(key=KEY_FIELD, match=models.MatchValue(value=key))]
        )
        with self._lock:
            self._check_open()
            points = self.client.query_points(
                self.collection,
                query=_as_list(vector),
                query_filter=key_filter,
                limit=1,
                with_payload=True,
                search_params=self._search_params,
            ).points
        if not points:
            return None
        return IndexMatch(str(points[0].id), float(points[0].score), dict(points[0].payload or {}))

    def upsert(self, point_id: str, vector: FloatArray, payload: Mapping[str, Any]) -> None:
        point = self._models.PointStruct(
            id=point_id, vector=_as_list(vector), payload=dict(payload)
        )
        with self._lock:
            self._check_open()
            self.client.upsert(self.collection, points=[point], wait=True)

    def set_payload(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        if not updates:
            return
        models = self._models
        operations = [
            models.SetPayloadOperation(
                set_payload=models.SetPayload(payload=dict(fields), points=[point_id])
            )
            for point_id, fields in updates.items()
        ]
        with self._lock:
            self._check_open()
            self.client.batch_update_points(self.collection, operations, wait=True)

    def delete(self, point_ids: Sequence[str]) -> None:
        if not point_ids:
            return
        selector = self._models.PointIdsList(points=list(point_ids))
        with self._lock:
            self._check_open()
            self.client.delete(self.collection, points_selector=selector, wait=True)

    def scroll(self, batch: int = 1024) -> Iterator[IndexRecord]:
        offset: Any = None
        while True:
            with self._lock:
                self._check_open()
                records, offset = self.client.scroll(
                    self.collection, limit=batch, offset=offset, with_payload=True
                )
            for record in records:
                yield IndexRecord(str(record.id), dict(record.payload or {}))
            if offset is None or not records:
                return

    def count(self) -> int:
        with self._lock:
            self._check_open()
            return int(self.client.count(self.collection, exact=True).count)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owns_client:
                self.client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"index {self.collection!r} is closed")


# -- the optimiser child process ------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m argus.worker.approx_cache.vector_index optimize DIR``: load the Edge shard in
    ``DIR``, build its HNSW graph, flush and exit (run by :class:`EdgeVectorIndex` in a
    child)."""
    parser = argparse.ArgumentParser(
        prog="python -m argus.worker.approx_cache.vector_index", allow_abbrev=False
    )
    parser.add_argument("command", choices=["optimize"])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    shard = qe.EdgeShard.load(str(args.directory))
    try:
        shard.optimize()
        shard.flush()
    finally:
        shard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
