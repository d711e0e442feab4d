"""The router's view of what each worker's approximate cache holds.

A request at an AC level resumes from the latent of the nearest prompt its worker has cached
under the same cache key (the *tag*: model, size, scheduler, steps, adapters), and the closer
that neighbour, the more of its planned steps it may skip. :class:`CacheView` mirrors every
worker's cached prompt embeddings from the inserts and evictions the workers report, so that
before it picks a worker the router can ask how similar each candidate's best neighbour is
(:meth:`CacheView.best`), as LLM routers ask which replica holds a prompt's prefix.

Why this index: the question comes with every request and covers every worker's cache (8 x
100k prompts in the target); a float32 scan of that reads over a gigabyte per query, and an
HNSW graph (Qdrant Edge, as the workers use) answers top-k rather than best-per-worker and
holds the GIL for minutes while it builds. Here one inverted-file index per tag holds the
entries of all workers, so one search answers for all of them:

* **Lists, grouped in cells.** Entries sit in lists of ``list_size`` to twice that, each with
  a centroid (the direction of its members' sum); lists sit in cells of ``cell_size`` to twice
  that lists, each with its own centroid. A query scores the cells, then the lists of its
  ``cell_probes`` nearest cells, scans its ``probes`` nearest lists in full and keeps each
  worker's best. What it can miss is a neighbour filed in a list it did not probe: that
  understates one worker, never overstates one.
* **Split, never train.** A tag starts as one list in one cell; a full list splits in halves
  along the line between two 2-means centres (halves, so no list is left tiny), a full cell
  likewise, an emptied one is dropped. The index follows the prompts the workers cache, in
  whatever order they come, with no training pass and no rebuild.
* **int8 vectors.** An entry keeps its unit vector as int8 codes with one scale (388 bytes,
  not 1,536): a query reads a quarter of the bytes, and its similarities are within about
  0.002 of the float ones at 384 dimensions.
* **Similarities, not decisions.** Which resume step a similarity allows is the caller's rule.

Costs (``benchmarks/bench_cache_routing.py``): with the defaults a query scans about 700
entries in 16 lists, about half a millisecond over 8 x 100k entries on one core of the 2-core
machine here; an insert or an eviction takes tens to hundreds of microseconds; an entry about
530 bytes. More probes find more: on real prompt embeddings the lists separate neighbours
less cleanly than on synthetic ones, and recall rises with ``probes`` (the benchmark's table).

Thread safety: one lock, held by a query while it searches and by an event while it applies.
:meth:`CacheView.forget` takes a worker out of every answer at once, then removes its entries
a list at a time, letting queries in between. Control plane: numpy only.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
Codes = npt.NDArray[np.int8]
Rows = npt.NDArray[np.intp]

__all__ = ["CacheView", "CacheViewConfig", "CacheViewStats"]

_MIN_CAPACITY = 16  # rows a list allocates at least; it grows by half when full
_SPLIT_ROUNDS = 4  # 2-means iterations of a split
_ASSIGN_CHUNK = 1024  # rows of a bulk insert scored against the centroids at once
_INSERT_CELLS = 2  # cells an insert looks for its nearest list in


@dataclass(frozen=True)
class CacheViewConfig:
    """How the view indexes each tag's entries."""

    dim: int = 384
    """Width of the prompt embeddings (all-MiniLM-L6-v2: 384)."""

    list_size: int = 32
    """A list splits in two when it reaches twice this many entries, so lists hold between
    this many and twice as many (fewer once evictions thin them)."""

    probes: int = 16
    """Lists searched per query, the nearest centroids among the probed cells' lists."""

    cell_size: int = 32
    """A cell (a group of lists) splits in two when it reaches twice this many lists."""

    cell_probes: int = 8
    """Cells whose lists' centroids a query scores, nearest cell centroid first. With at most
    this many cells and ``probes`` lists in them, a search is exhaustive: exact up to the
    int8 rounding."""

    seed: int = 0
    """Seeds the 2-means starts of splits, so a view fed the same events is the same view."""

    def __post_init__(self) -> None:
        for name in ("dim", "probes", "cell_probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("list_size", "cell_size"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: must be >= 2, got {getattr(self, name)}")


@dataclass(frozen=True)
class CacheViewStats:
    """A snapshot of the view, for metrics and logs."""

    entries: int  # entries held, all workers and tags
    rows: int  # rows in the lists: ``entries`` plus forgotten ones not yet removed
    per_worker: dict[str, int]  # entries held per worker
    tags: int  # cache keys with at least one entry
    cells: int  # cells, all tags
    lists: int  # inverted lists, all tags
    array_bytes: int  # bytes of the numpy arrays (codes, scales, owners, centroids)
    unknown_evictions: int  # evictions of entries the view did not hold (missed inserts)


class _Member(Protocol):
    position: int  # row in the parent's centroid matrix; -1 once dropped
    total: npt.NDArray[np.float64]  # sum of the member's vectors: its centroid's direction


M = TypeVar("M", bound=_Member)


class _Centroids(Generic[M]):
    """Members (lists of a cell, or cells of a tag) with one centroid row each."""

    __slots__ = ("matrix", "members")

    def __init__(self, dim: int) -> None:
        self.matrix = np.zeros((8, dim), dtype=np.float32)
        self.members: list[M] = []

    def __len__(self) -> int:
        return len(self.members)

    def add(self, member: M) -> None:
        count = len(self.members)
        if count == len(self.matrix):
            bigger = np.zeros((2 * count, self.matrix.shape[1]), dtype=np.float32)
            bigger[:count] = self.matrix
            self.matrix = bigger
        member.position = count
        self.members.append(member)
        self.update(member)

    def drop(self, member: M) -> None:
        last = self.members.pop()
        if last is not member:
            last.position = member.position
            self.members[member.position] = last
            self.matrix[member.position] = self.matrix[len(self.members)]
        member.position = -1

    def update(self, member: M) -> None:
        """Point the member's centroid along its total (left as it was when that is 0)."""
        norm = math.sqrt(float(member.total @ member.total))
        if norm > 0.0:
            self.matrix[member.position] = member.total / norm

    def scores(self, vectors: FloatArray) -> FloatArray:
        """Cosine of each of ``vectors`` (rows, or one vector) to every centroid."""
        scores: FloatArray = vectors @ self.matrix[: len(self.members)].T
        return scores

    def nearest(self, vector: FloatArray, count: int) -> list[M]:
        """The ``count`` members whose centroids are nearest ``vector`` (in no order)."""
        if count >= len(self.members):
            return list(self.members)
        top = np.argpartition(-self.scores(vector), count - 1)[:count]
        return [self.members[i] for i in top.tolist()]


class _List:
    """One inverted list: its members' int8 codes, scales, owner slots and entry ids."""

    __slots__ = ("cell", "codes", "ids", "owners", "position", "scales", "size", "total")

    def __init__(self, cell: _Cell, dim: int, capacity: int) -> None:
        self.cell = cell
        self.position = -1
        self.codes = np.zeros((capacity, dim), dtype=np.int8)
        self.scales = np.zeros(capacity, dtype=np.float32)
        self.owners = np.zeros(capacity, dtype=np.int32)
        self.ids: list[str] = []
        self.size = 0
        self.total = np.zeros(dim, dtype=np.float64)

    def append(
        self, owner: int, entry_ids: list[str], codes: Codes, scales: FloatArray
    ) -> npt.NDArray[np.float64]:
        """Add rows of one owner; returns the change of ``total``."""
        count = len(entry_ids)
        if self.size + count > len(self.scales):
            self._resize(max(self.size + count, len(self.scales) * 3 // 2))
        rows = slice(self.size, self.size + count)
        self.codes[rows] = codes
        self.scales[rows] = scales
        self.owners[rows] = owner
        self.ids.extend(entry_ids)
        self.size += count
        delta: npt.NDArray[np.float64] = scales.astype(np.float64) @ codes
        self.total += delta
        return delta

    def find(self, owner: int, entry_id: str) -> int:
        """The row of ``owner``'s entry ``entry_id``; ValueError when absent."""
        start = 0
        while True:
            row = self.ids.index(entry_id, start)
            if self.owners[row] == owner:
                return row
            start = row + 1

    def remove(self, row: int) -> npt.NDArray[np.float64]:
        """Remove a row, moving the last one into it; returns the change of ``total``."""
        delta: npt.NDArray[np.float64] = self.codes[row] * -np.float64(self.scales[row])
        self.total += delta
        last = self.size - 1
        if row != last:
            self.codes[row] = self.codes[last]
            self.scales[row] = self.scales[last]
            self.owners[row] = self.owners[last]
            self.ids[row] = self.ids[last]
        self.ids.pop()
        self.size = last
        return delta

    def keep(self, mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
        """Keep the rows where ``mask`` (over the first ``size``) is true, in arrays sized
        to them (a split list would otherwise keep its full capacity); returns the change of
        ``total``."""
        kept = int(mask.sum())
        for name in ("codes", "scales", "owners"):
            old = getattr(self, name)
            new = np.zeros((_capacity(kept), *old.shape[1:]), dtype=old.dtype)
            new[:kept] = old[: self.size][mask]
            setattr(self, name, new)
        self.ids = list(compress(self.ids, mask.tolist()))
        self.size = kept
        before = self.total
        self.total = self.vectors().sum(axis=0, dtype=np.float64)
        delta: npt.NDArray[np.float64] = self.total - before
        return delta

    def vectors(self) -> FloatArray:
        """The members' decoded vectors."""
        decoded: FloatArray = self.codes[: self.size].astype(np.float32)
        decoded *= self.scales[: self.size, None]
        return decoded

    def _resize(self, capacity: int) -> None:
        for name in ("codes", "scales", "owners"):
            old = getattr(self, name)
            new = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)


def _capacity(rows: int) -> int:
    """Rows to allocate for ``rows`` entries: a quarter more, for the inserts to come."""
    return max(_MIN_CAPACITY, rows + rows // 4)


class _Cell:
    """A group of lists, with the sum of all their members' vectors."""

    __slots__ = ("index", "lists", "position", "total")

    def __init__(self, index: _TagIndex, dim: int) -> None:
        self.index = index
        self.position = -1
        self.lists: _Centroids[_List] = _Centroids(dim)
        self.total = np.zeros(dim, dtype=np.float64)


class _TagIndex:
    """The cells of one tag."""

    __slots__ = ("cells", "tag")

    def __init__(self, tag: str, dim: int) -> None:
        self.tag = tag
        self.cells: _Centroids[_Cell] = _Centroids(dim)

    def probe(self, vector: FloatArray, cell_probes: int, probes: int) -> list[_List]:
        """The ``probes`` lists nearest ``vector`` among those of its ``cell_probes``
        nearest cells."""
        cells = self.cells.nearest(vector, cell_probes)
        if len(cells) == 1:
            return cells[0].lists.nearest(vector, probes)
        lists = [lst for cell in cells for lst in cell.lists.members]
        if probes >= len(lists):
            return lists
        scores = np.concatenate([cell.lists.scores(vector) for cell in cells])
        return [lists[i] for i in np.argpartition(-scores, probes - 1)[:probes].tolist()]


@dataclass
class _Worker:
    slot: int  # owner number in the lists' ``owners`` arrays; new on every (re)join
    entries: dict[str, _List]  # entry id → the list holding it


class CacheView:
    """Per worker, a mirror of the prompt embeddings its approximate cache holds, by tag.

    Fed by the workers' cache events (:meth:`insert`, :meth:`insert_many`, :meth:`evict`;
    :meth:`forget` when a worker leaves or restarts with an empty cache) and asked by the
    router before it picks a worker (:meth:`best`). See the module docstring for the index
    and what its answers guarantee.
    """

    def __init__(self, config: CacheViewConfig | None = None) -> None:
        self.config = config or CacheViewConfig()
        self._lock = threading.Lock()
        self._tags: dict[str, _TagIndex] = {}
        self._workers: dict[str, _Worker] = {}
        self._names: dict[int, str] = {}  # live slot → worker name
        self._next_slot = 0
        self._unknown_evictions = 0
        self._rng = np.random.default_rng(self.config.seed)

    # -- events ------------------------------------------------------------------------------

    def insert(self, worker: str, entry_id: str, embedding: npt.ArrayLike, tag: str) -> None:
        """Record that ``worker`` cached ``entry_id``, a prompt with this ``embedding``, under
        ``tag``; an id the worker already has is replaced. ValueError for an embedding that is
        not a finite, non-zero vector of ``config.dim`` numbers."""
        self.insert_many(worker, [entry_id], np.asarray(embedding, dtype=np.float32)[None], tag)

    def insert_many(
        self, worker: str, entry_ids: Sequence[str], embeddings: npt.ArrayLike, tag: str
    ) -> None:
        """:meth:`insert` for rows of ``embeddings`` (``(len(entry_ids), dim)``) at once, all
        under ``tag``: what a worker's snapshot of its cache feeds, in chunks (the view stays
        locked while a chunk goes in)."""
        ids = list(entry_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("entry_ids: an id appears twice")
        vectors = self._units(embeddings, len(ids))
        if not ids:
            return
        scales = (np.abs(vectors).max(axis=1) / np.float32(127.0)).astype(np.float32)
        codes = np.rint(vectors / scales[:, None]).astype(np.int8)
        with self._lock:
            state = self._join(worker)
            for entry_id in ids:
                if entry_id in state.entries:
                    self._remove(state, entry_id)
            index = self._tags.get(tag)
            if index is None:
                index = self._tags[tag] = _TagIndex(tag, self.config.dim)
            for lst, rows in self._assign(index, vectors):
                chosen = [ids[row] for row in rows.tolist()]
                self._changed(lst, lst.append(state.slot, chosen, codes[rows], scales[rows]))
                state.entries.update(dict.fromkeys(chosen, lst))
                if lst.size >= 2 * self.config.list_size:
                    self._split_list(lst)

    def evict(self, worker: str, entry_id: str) -> bool:
        """Record that ``worker`` no longer holds ``entry_id``; False (and counted) when the
        view did not hold it, e.g. because its insert was lost."""
        with self._lock:
            state = self._workers.get(worker)
            if state is None or entry_id not in state.entries:
                self._unknown_evictions += 1
                return False
            self._remove(state, entry_id)
            return True

    def forget(self, worker: str) -> int:
        """Drop everything ``worker`` held (it left, or restarted without its cache); returns
        how many entries that was. The worker is out of every answer when this starts; its
        entries are then removed one list at a time, queries and events running in between.
        A later insert from the same name starts a new, empty mirror."""
        with self._lock:
            state = self._workers.pop(worker, None)
            if state is None:
                return 0
            del self._names[state.slot]
            lists = {id(lst): lst for lst in state.entries.values()}
        for lst in lists.values():
            with self._lock:
                if lst.position >= 0:  # not dropped since, emptied by other evictions
                    self._changed(lst, lst.keep(lst.owners[: lst.size] != state.slot))
        return len(state.entries)

    # -- the question ----------------------------------------------------------------------

    def best(
        self,
        embedding: npt.ArrayLike,
        tag: str,
        workers: Iterable[str],
        *,
        floor: float = -1.0,
    ) -> dict[str, float]:
        """For each of ``workers``, the cosine similarity of its most similar entry under
        ``tag`` to ``embedding``, when that is at least ``floor`` and the search found it.

        A worker absent from the answer holds nothing found at ``floor`` or above for this
        tag (nothing at all, when the search was exhaustive). Similarities carry the int8
        rounding (about 0.002); the search can miss a neighbour filed in a list it did not
        probe, which understates that worker."""
        vector = self._units(embedding, None)
        with self._lock:
            index = self._tags.get(tag)
            if index is None:
                return {}
            slots = {self._workers[w].slot: w for w in workers if w in self._workers}
            if not slots:
                return {}
            scores, owners = self._search(index, vector)
            by_slot = np.full(self._next_slot, -np.inf, dtype=np.float32)
        keep = scores >= floor
        np.maximum.at(by_slot, owners[keep], scores[keep])
        found: dict[str, float] = {}
        for slot, name in slots.items():
            score = float(by_slot[slot])
            if score > -np.inf:
                found[name] = score
        return found

    def _search(
        self, index: _TagIndex, vector: FloatArray
    ) -> tuple[FloatArray, npt.NDArray[np.int32]]:
        """Similarities and owners of every entry in the probed lists (lock held: the arrays
        change under evictions; the answer is a copy)."""
        lists = index.probe(vector, self.config.cell_probes, self.config.probes)
        # one copy of the probed rows and one product beat a product per list: per-call
        # overhead, not arithmetic, is what many small lists cost
        codes = np.concatenate([lst.codes[: lst.size] for lst in lists])
        scales = np.concatenate([lst.scales[: lst.size] for lst in lists])
        owners = np.concatenate([lst.owners[: lst.size] for lst in lists])
        scores: FloatArray = np.matmul(codes, vector, dtype=np.float32)
        scores *= scales
        np.clip(scores, -1.0, 1.0, out=scores)  # int8 rounding can step past a unit cosine
        return scores, owners

    # -- reading -----------------------------------------------------------------------------

    def workers(self) -> list[str]:
        """Workers the view has heard from since it started or last forgot them."""
        with self._lock:
            return list(self._workers)

    def entries(self, worker: str) -> int:
        """Entries the view holds for ``worker``, all tags."""
        with self._lock:
            state = self._workers.get(worker)
            return 0 if state is None else len(state.entries)

    def stats(self) -> CacheViewStats:
        with self._lock:
            per_worker = {name: len(state.entries) for name, state in self._workers.items()}
            cells = [cell for index in self._tags.values() for cell in index.cells.members]
            lists = [lst for cell in cells for lst in cell.lists.members]
            array_bytes = (
                sum(lst.codes.nbytes + lst.scales.nbytes + lst.owners.nbytes for lst in lists)
                + sum(cell.lists.matrix.nbytes for cell in cells)
                + sum(index.cells.matrix.nbytes for index in self._tags.values())
            )
            return CacheViewStats(
                entries=sum(per_worker.values()),
                rows=sum(lst.size for lst in lists),
                per_worker=per_worker,
                tags=len(self._tags),
                cells=len(cells),
                lists=len(lists),
                array_bytes=array_bytes,
                unknown_evictions=self._unknown_evictions,
            )

    # -- upkeep (lock held) ------------------------------------------------------------------

    def _units(self, embeddings: npt.ArrayLike, count: int | None) -> FloatArray:
        """``embeddings`` as unit rows; ``count`` rows of ``dim``, or one vector when None."""
        dim = self.config.dim
        array = np.asarray(embeddings, dtype=np.float32)
        expected = (dim,) if count is None else (count, dim)
        if array.shape != expected:
            raise ValueError(f"embedding of shape {array.shape}; expected {expected}")
        squares = np.einsum("...i,...i->...", array, array, dtype=np.float64)
        if not np.isfinite(squares).all():
            raise ValueError("embedding is not finite")
        if not squares.all():
            raise ValueError("embedding is the zero vector; cosine similarity is undefined")
        units: FloatArray = (array / np.sqrt(squares)[..., None]).astype(np.float32)
        return units

    def _join(self, worker: str) -> _Worker:
        """The state of ``worker``, new (with a fresh slot) when it has none."""
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _Worker(self._next_slot, {})
            self._names[self._next_slot] = worker
            self._next_slot += 1
        return state

    def _assign(self, index: _TagIndex, vectors: FloatArray) -> list[tuple[_List, Rows]]:
        """Rows of ``vectors`` grouped by the list each joins: the nearest list among those
        of the ``_INSERT_CELLS`` nearest cells (looking in one cell only would file entries
        near its border away from lists a query from across the border finds), or a new list
        in a new cell when the tag has none. All resolved before any row goes in, since
        splits renumber lists and cells."""
        dim = self.config.dim
        if not index.cells:
            cell = _Cell(index, dim)
            index.cells.add(cell)
            lst = _List(cell, dim, _capacity(len(vectors)))
            cell.lists.add(lst)
            return [(lst, np.arange(len(vectors)))]
        if len(vectors) == 1:  # the common case, an insert per reply: fewer numpy calls
            return [(self._nearest_list(index, vectors[0]), np.zeros(1, dtype=np.intp))]
        cells = index.cells.members
        near = _nearest(index.cells.scores, vectors, min(_INSERT_CELLS, len(cells)))
        best = np.full(len(vectors), -np.inf, dtype=np.float32)
        chosen: dict[int, _List] = {}  # row → its list
        for column in near.T:
            for cell, rows in _grouped(cells, column):
                scores = cell.lists.scores(vectors[rows])
                top = np.argmax(scores, axis=1)
                top_scores = scores[np.arange(len(rows)), top]
                better = top_scores > best[rows]
                best[rows[better]] = top_scores[better]
                for row, position in zip(rows[better].tolist(), top[better].tolist(), strict=True):
                    chosen[row] = cell.lists.members[position]
        groups: dict[int, tuple[_List, list[int]]] = {}
        for row in range(len(vectors)):
            lst = chosen[row]
            groups.setdefault(id(lst), (lst, []))[1].append(row)
        return [(lst, np.array(rows, dtype=np.intp)) for lst, rows in groups.values()]

    def _nearest_list(self, index: _TagIndex, vector: FloatArray) -> _List:
        """:meth:`_assign` for one vector."""
        candidates = []
        for cell in index.cells.nearest(vector, _INSERT_CELLS):
            scores = cell.lists.scores(vector)
            row = int(np.argmax(scores))
            candidates.append((float(scores[row]), cell.lists.members[row]))
        return max(candidates, key=lambda candidate: candidate[0])[1]

    def _changed(self, lst: _List, delta: npt.NDArray[np.float64]) -> None:
        """After ``lst``'s total moved by ``delta``: recentre it and its cell, or drop it
        (and an emptied cell, and an emptied tag) when it holds nothing."""
        cell = lst.cell
        cell.total += delta
        index = cell.index
        if lst.size:
            cell.lists.update(lst)
            index.cells.update(cell)
            return
        cell.lists.drop(lst)
        if cell.lists:
            index.cells.update(cell)
            return
        index.cells.drop(cell)
        if not index.cells:
            del self._tags[index.tag]

    def _remove(self, state: _Worker, entry_id: str) -> None:
        lst = state.entries.pop(entry_id)
        self._changed(lst, lst.remove(lst.find(state.slot, entry_id)))

    def _split_list(self, full: _List) -> None:
        """Split ``full`` by 2-means on its members, and the halves again while they are
        still full (a bulk insert can overfill a list many times); entries moved to a new
        list are re-pointed; a cell that has grown to twice ``cell_size`` lists splits too.
        Entries of forgotten workers that :meth:`forget` has not reached yet are dropped
        first, since it will not look in the new lists."""
        bound = 2 * self.config.list_size
        live = np.isin(full.owners[: full.size], np.fromiter(self._names, dtype=np.int32))
        if not live.all():
            self._changed(full, full.keep(live))
        cell = full.cell
        pending = [full]
        while pending:
            lst = pending.pop()
            if lst.size < bound:
                continue
            second = self._two_means(lst.vectors())
            moved = _List(cell, self.config.dim, _capacity(int(second.sum())))
            owners = lst.owners[: lst.size]
            for owner in np.unique(owners[second]).tolist():
                rows = np.flatnonzero(second & (owners == owner))
                chosen = [lst.ids[row] for row in rows.tolist()]
                moved.append(owner, chosen, lst.codes[rows], lst.scales[rows])
                self._workers[self._names[owner]].entries.update(dict.fromkeys(chosen, moved))
            lst.keep(~second)
            cell.lists.update(lst)
            cell.lists.add(moved)
            pending += [lst, moved]
        if len(cell.lists) >= 2 * self.config.cell_size:
            self._split_cell(cell)

    def _split_cell(self, full: _Cell) -> None:
        """Split a cell's lists in two by 2-means on their centroids, the second group
        moving to a new cell."""
        index = full.index
        members = list(full.lists.members)
        second = self._two_means(full.lists.matrix[: len(members)].copy())
        moved = _Cell(index, self.config.dim)
        for lst, goes in zip(members, second.tolist(), strict=True):
            if goes:
                full.lists.drop(lst)
                full.total -= lst.total
                lst.cell = moved
                moved.total += lst.total
                moved.lists.add(lst)
        index.cells.update(full)
        index.cells.add(moved)

    def _two_means(self, vectors: FloatArray) -> npt.NDArray[np.bool_]:
        """Which rows go to the second half: the half farther along the line between two
        2-means centres. Halves, not the 2-means clusters themselves, whose sizes can be as
        uneven as an outlier and the rest: lists of a few entries would each cost a query
        a centroid and a call for nothing."""
        size = len(vectors)
        first = vectors[int(self._rng.integers(size))]
        a = vectors[int(np.argmin(vectors @ first))]  # far from a random member
        b = vectors[int(np.argmin(vectors @ a))]  # far from that one
        for _ in range(_SPLIT_ROUNDS):
            second = vectors @ (b - a) > 0.5 * float(b @ b - a @ a)
            if second.all() or not second.any():
                break
            a = vectors[~second].mean(axis=0)
            b = vectors[second].mean(axis=0)
        halves = np.zeros(size, dtype=bool)
        halves[np.argsort(vectors @ (b - a), kind="stable")[size // 2 :]] = True
        return halves


def _nearest(
    scores_of: Callable[[FloatArray], FloatArray], vectors: FloatArray, count: int
) -> Rows:
    """For each row of ``vectors``, the indexes of its ``count`` highest scores (in no
    order), as ``(rows, count)``, scored in chunks of rows."""
    parts = []
    for start in range(0, len(vectors), _ASSIGN_CHUNK):
        scores = scores_of(vectors[start : start + _ASSIGN_CHUNK])
        if count >= scores.shape[1]:
            parts.append(np.broadcast_to(np.arange(scores.shape[1]), scores.shape))
        else:
            parts.append(np.argpartition(-scores, count - 1, axis=1)[:, :count])
    return np.concatenate(parts)


def _grouped(members: list[M], chosen: Rows) -> list[tuple[M, Rows]]:
    """Rows grouped by the member each chose (``chosen[row]`` indexes ``members``)."""
    order = np.argsort(chosen, kind="stable")
    cuts = np.flatnonzero(np.diff(chosen[order])) + 1
    return [(members[int(chosen[rows[0]])], rows) for rows in np.split(order, cuts)]
