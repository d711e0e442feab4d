"""The router's mirror of its workers' approximate caches: :class:`CacheMirror`.

Each worker publishes its cache's inserts and evictions in a numbered log
(:mod:`argus.worker.approx_cache.events`); the router sends each worker its cursor on every
Generate call and applies the events the reply carries to one
:class:`~argus.router.cache_view.CacheView` (:meth:`CacheMirror.cursor`,
:meth:`CacheMirror.apply`). A reply of a new log (the worker restarted) or one that says
``truncated`` where the router's cursor leaves a gap makes the router forget the worker's
entries first; replies that race each other apply only the events past the cursor, and a
reply of a log the router already left is ignored. A worker that leaves the plan is
forgotten (:meth:`CacheMirror.keep_only`). A bad event (wrong width, a non-finite or zero
vector, an eviction of an entry the mirror never held) is skipped and counted: the mirror
then predicts a miss where the worker may hit, never the reverse of a wrong vector.

Before a request is routed (never under the core's lock) :meth:`CacheMirror.look` embeds its
prompt with the workers' own encoder and asks the view, once per AC model, for each worker's
nearest neighbour under the request's cache key: the :class:`Lookup` answers the policy's
``neighbours`` question (:mod:`argus.router.cache_routing`) and is also a *probe*: the best
similarity over the live workers, counted once per AC level of K > 0 of that model in its
similarity bin (:meth:`CacheRouting.probes`), which the router reports to the allocator as a
:class:`~argus.contracts.cache_outlook.CacheOutlook`. It embeds only where it can matter:
while the plan is AC (the answer picks the worker), and otherwise at most once per
``cache_probe_interval_s`` (the probe alone), because the encoder costs milliseconds per
prompt (``docs/router-internals.md`` has the figures); never for an edit, which does not
resume from the cache, nor for a request whose size or steps the router cannot tell. The
vectors of the last :data:`PROMPT_MEMORY` prompts are kept, so a prompt asked again is not
embedded again. The vector also travels with the call to the chosen worker
(:meth:`CacheMirror.vector_for`), whose lookup and insert then skip the encoder: the prompt
is embedded once per request, at the router, not once at each end.

Thread safety: one lock orders each worker's cursor and the events applied with it (the
view has its own lock, which queries take); the probes and the kept vectors have their own.
Control plane: numpy, no grpc, no torch (the encoder is passed in).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from argus.contracts.cache_outlook import CacheOutlook
from argus.contracts.generate import (
    MISS_INDEX_ERROR,
    CacheCursor,
    CacheEvents,
    CacheInsert,
    CacheKey,
    adapters_digest,
)
from argus.contracts.router_api import RouterRequest
from argus.profiles.cache_evidence import KRule
from argus.router.cache_routing import CacheRouting
from argus.router.cache_view import CacheView, CacheViewConfig
from argus.types import ProfileSet, Strategy

log = logging.getLogger(__name__)

SKIP_REASONS = ("width", "not_finite", "unknown_evict", "error")
"""Why an event was skipped: an embedding of the wrong width, one not finite or zero, an
eviction of an entry the mirror did not hold, an event the view refused otherwise."""
FORGET_REASONS = ("restart", "truncated", "left", "error")
"""Why a worker's mirrored entries were dropped: a new log, a gap in the events, the worker
left the plan, applying its events failed unexpectedly."""
_RETIRED_LOGS = 8  # log ids kept per worker to ignore late replies of an earlier process
PROMPT_MEMORY = 4096
"""Prompts whose vectors the mirror keeps, the least recently looked up dropped first: a
prompt asked again (a client's retry, a popular prompt) skips the encoder's milliseconds.
About 1.6 KB each at 384 dimensions."""


class Embedder(Protocol):
    """The workers' prompt encoder as the mirror uses it (``PromptEmbedder``): ``vectors_id``
    names the vectors it makes, which the worker checks before it takes one for its own."""

    dim: int
    vectors_id: str

    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]: ...


@dataclass(frozen=True)
class MirrorStats:
    """Counts since the mirror started, for metrics and logs."""

    skipped: Mapping[str, int]  # events skipped, by reason of :data:`SKIP_REASONS`
    forgotten: Mapping[str, int]  # workers forgotten, by reason of :data:`FORGET_REASONS`


@dataclass(frozen=True)
class Lookup:
    """One request's nearest cached neighbour on each worker, per AC model."""

    found: Mapping[str, Mapping[str, float]]  # model → worker → similarity
    embed_s: float = 0.0  # the encoder's time on the prompt, seconds
    # the prompt's vector, which the call to the worker carries (it need not embed again)
    vector: npt.NDArray[np.float32] | None = field(default=None, compare=False, repr=False)

    def neighbours(self, worker: str, model: str) -> float | None:
        """The policy's ``Neighbours``: None when ``worker`` holds nothing under the key."""
        return self.found.get(model, {}).get(worker)


@dataclass
class _Cursor:
    log_id: str
    after: int
    retired: list[str] = field(default_factory=list)  # earlier logs of the same worker


class CacheMirror:
    """The router's copy of the workers' caches (see the module docstring)."""

    def __init__(
        self,
        profiles: ProfileSet,
        embedder: Embedder,
        rules: Mapping[str, KRule] | None = None,
        *,
        scheduler: str,
        default_size: int | None = None,
        probe_interval_s: float = 0.1,
        index_down_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        view: CacheView | None = None,
        on_skipped: Callable[[str], None] = lambda reason: None,
        on_forgotten: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """``on_skipped`` and ``on_forgotten`` hear each skipped event and each forgotten
        worker by reason (:data:`SKIP_REASONS`, :data:`FORGET_REASONS`), as counted.
        ``index_down_s``: how long a worker whose reply says its index failed is left out of
        the lookups (:meth:`answered`)."""
        self.embedder = embedder
        self.view = view or CacheView(CacheViewConfig(dim=embedder.dim))
        if self.view.config.dim != embedder.dim:
            raise ValueError(
                f"view width {self.view.config.dim} differs from the encoder's {embedder.dim}"
            )
        self.dim = embedder.dim
        self.scheduler = scheduler
        self.default_size = default_size
        self.probe_interval_s = probe_interval_s
        self.index_down_s = index_down_s
        self._clock = clock
        self._index_down: dict[str, float] = {}  # worker → until when its index is not trusted
        self._on_skipped, self._on_forgotten = on_skipped, on_forgotten
        # the AC levels that look up, their rules and bins: which models to look at, and
        # where a probe counts (CacheRouting.probes, as the simulator counts them)
        self.routing = CacheRouting(profiles, rules or {})
        self._lock = threading.Lock()  # cursors, members, the order events apply in
        self._cursors: dict[str, _Cursor] = {}
        self._members: set[str] | None = None  # None: no plan yet, every worker is taken
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        self._forgotten = dict.fromkeys(FORGET_REASONS, 0)
        self._probe_lock = threading.Lock()
        self._probes: list[tuple[str, int, float]] = []
        self._next_probe = -math.inf
        self._vectors: OrderedDict[bytes, npt.NDArray[np.float32]] = OrderedDict()
        self._vectors_lock = threading.Lock()

    # -- the workers' events ---------------------------------------------------------------

    def cursor(self, worker: str) -> CacheCursor:
        """Where the mirror stands in ``worker``'s log: what a call to it sends."""
        with self._lock:
            at = self._cursors.get(worker)
            return CacheCursor() if at is None else CacheCursor(at.log_id, at.after)

    def apply(self, worker: str, events: CacheEvents | None) -> None:
        """Apply the events of ``worker``'s reply (None: it sent none). Never raises: a bad
        event is skipped and counted, an unexpected failure forgets the worker."""
        if events is None:
            return
        with self._lock:
            if self._members is not None and worker not in self._members:
                return  # it left the plan while serving: its entries are forgotten
            try:
                self._apply(worker, events)
            except Exception:
                log.exception("cache events of worker %s: forgetting its entries", worker)
                self._cursors.pop(worker, None)
                self._forget(worker, "error")

    def answered(self, worker: str, miss_reason: str) -> None:
        """``worker`` answered a request with ``miss_reason`` ("" unless a miss). A miss
        because its vector index failed (down or too slow) means its entries cannot be found
        for now: it is left out of the lookups for ``index_down_s`` (renewed by each such
        miss), so the router prices it as a miss, which it serves in full, and stops sending
        it requests for neighbours it cannot reach. Its entries stay mirrored."""
        if miss_reason != MISS_INDEX_ERROR:
            return
        with self._lock:
            if worker not in self._index_down:
                log.warning(
                    "worker %s: its cache index failed; not routing on its cache for %.0f s",
                    worker,
                    self.index_down_s,
                )
            self._index_down[worker] = self._clock() + self.index_down_s

    def _reachable(self, workers: Iterable[str]) -> list[str]:
        """``workers`` less those whose index failed lately (:meth:`answered`)."""
        with self._lock:
            if not self._index_down:
                return list(workers)
            now = self._clock()
            for worker, until in list(self._index_down.items()):
                if until <= now:
                    del self._index_down[worker]
            return [w for w in workers if w not in self._index_down]

    def keep_only(self, workers: Iterable[str]) -> None:
        """The plan names only ``workers``: forget the others' entries."""
        keep = set(workers)
        with self._lock:
            self._members = keep
            gone = [w for w in {*self._cursors, *self.view.workers()} if w not in keep]
            for worker in gone:
                self._cursors.pop(worker, None)
                self._forget(worker, "left")

    def _apply(self, worker: str, events: CacheEvents) -> None:
        at = self._cursors.get(worker)
        first = events.last - len(events.events) + 1  # the number of events.events[0]
        skip = 0
        if at is None or at.log_id != events.log_id:
            if at is not None and events.log_id in at.retired:
                return  # a late reply of a log the worker has since replaced
            if at is not None or self.view.entries(worker):
                self._forget(worker, "restart")
            retired = [] if at is None else [*at.retired, at.log_id][-_RETIRED_LOGS:]
            at = self._cursors[worker] = _Cursor(events.log_id, 0, retired)
        elif events.last <= at.after:
            return  # a reply that a later one overtook: nothing new
        elif events.truncated and at.after < first - 1:
            self._forget(worker, "truncated")  # events between the cursor and these are lost
        else:
            skip = max(0, at.after - first + 1)  # applied from a reply that overtook this one
        for event in events.events[skip:]:
            self._apply_one(worker, event)
        at.after = events.last

    def _apply_one(self, worker: str, event: object) -> None:
        if isinstance(event, CacheInsert):
            vector = np.asarray(event.embedding, dtype=np.float32)
            if vector.shape != (self.dim,):
                self._skip("width")
            elif not (np.isfinite(vector).all() and vector.any()):
                self._skip("not_finite")
            else:
                try:
                    self.view.insert(worker, event.entry_id, vector, event.tag)
                except ValueError:
                    self._skip("error")
        elif not self.view.evict(worker, getattr(event, "entry_id", "")):
            self._skip("unknown_evict")

    def _skip(self, reason: str) -> None:
        self._skipped[reason] += 1
        self._on_skipped(reason)

    def _forget(self, worker: str, reason: str) -> None:
        if self.view.forget(worker) or reason != "left":
            self._forgotten[reason] += 1
            self._on_forgotten(reason)

    # -- the question before routing -------------------------------------------------------

    def wanted(self, request: RouterRequest, strategy: Strategy | None) -> bool:
        """Whether :meth:`look` is worth its encoder time for ``request`` under a plan of
        ``strategy`` (None: no plan): the view holds entries, the request is a generation,
        and the plan is AC or a probe is due (which this claims)."""
        if strategy is None or request.image or not self.routing.models:
            return False
        if not self.view.workers():
            return False
        if strategy is Strategy.AC:
            return True
        with self._probe_lock:
            now = self._clock()
            if now < self._next_probe:
                return False
            self._next_probe = now + self.probe_interval_s
            return True

    def look(self, request: RouterRequest, steps: int | None) -> Lookup | None:
        """``request``'s neighbours on every worker, per AC model (``steps``: the steps it
        runs, None when the router cannot tell); None when its cache key is not known."""
        width = request.width or self.default_size
        height = request.height or self.default_size
        if width is None or height is None or steps is None:
            return None
        adapters = adapters_digest(request.adapters)
        vector, embed_s = self._embed(request.prompt)
        workers = self._reachable(self.view.workers())
        found = {}
        for model in self.routing.models:
            tag = CacheKey(model, self.scheduler, height, width, steps, adapters).tag
            found[model] = self.view.best(vector, tag, workers)
        return Lookup(found, embed_s, vector)

    def vector_for(self, lookup: Lookup | None) -> tuple[tuple[float, ...], str]:
        """What the call to the worker carries of ``lookup``: the prompt's vector and the
        encoder's ``vectors_id`` (``GenerateCall.prompt_embedding``, ``prompt_encoder``);
        empty when the prompt was not embedded."""
        if lookup is None or lookup.vector is None:
            return (), ""
        return tuple(lookup.vector.tolist()), self.embedder.vectors_id

    def _embed(self, prompt: str) -> tuple[npt.NDArray[np.float32], float]:
        """``prompt``'s vector and the encoder's seconds on it: 0 for a prompt among the last
        :data:`PROMPT_MEMORY` embedded, whose vector is kept (by a digest of the prompt)."""
        key = hashlib.blake2b(prompt.encode(), digest_size=16).digest()
        with self._vectors_lock:
            kept = self._vectors.get(key)
            if kept is not None:
                self._vectors.move_to_end(key)
                return kept, 0.0
        started = time.perf_counter()
        vector = np.asarray(self.embedder.embed_one(prompt), dtype=np.float32)
        embed_s = time.perf_counter() - started
        vector.flags.writeable = False  # shared by every later lookup of the prompt
        with self._vectors_lock:
            self._vectors[key] = vector
            if len(self._vectors) > PROMPT_MEMORY:
                self._vectors.popitem(last=False)
        return vector, embed_s

    # -- the allocator's evidence ----------------------------------------------------------

    def record(self, lookup: Lookup, live: Iterable[str]) -> None:
        """Count ``lookup``'s probes (:meth:`CacheRouting.probes`) over the ``live`` workers."""
        probes = self.routing.probes(lookup.neighbours, live)
        with self._probe_lock:
            self._probes.extend(probes)

    def take_outlook(self) -> CacheOutlook:
        """The probes since the last call, as lookups per AC level and similarity bin."""
        with self._probe_lock:
            probes, self._probes = self._probes, []
        return CacheOutlook.of_lookups(probes, self.routing.bin_counts)

    def stats(self) -> MirrorStats:
        with self._lock:
            return MirrorStats(dict(self._skipped), dict(self._forgotten))
