"""Asynchronous LoRA loading in separate processes, into shared memory.

Katz loads LoRAs "in separate processes and utilizes shared memory to transfer LoRA weights
from the loading processes to the base model serving process" (§8). :class:`LoraLoader` is
that, for one worker:

* a **bounded pool of loader processes** (``concurrent.futures.ProcessPoolExecutor``) started
  with ``spawn`` (or ``forkserver``), never ``fork``: the worker process runs gRPC and torch
  threads, and a forked child would inherit their locks mid-flight;
* each load runs :func:`~argus.worker.adapters.lora.fileformat.read_file` in a loader process:
parse and
  check the safetensors header, then read the data section with one ``readinto`` into a buffer
  made shared with torch's ``share_memory_()``. The buffer goes back to the worker as a file
  descriptor (torch's ``file_descriptor`` sharing strategy): the worker maps the same pages,
  nothing is copied, and because the segment is unlinked as soon as it exists, no
  ``/dev/shm`` entry can outlive the processes that map it;
* a **bounded number of loads in flight** (``max_pending`` distinct files, queued or running):
  beyond it a request is refused with :class:`LoraBusyError` instead of queueing without end;
  concurrent requests for the same file share one load;
* a **small LRU cache** of recently loaded LoRAs (by count and bytes), keyed by path,
  modification time and size, so a file replaced on disk is loaded again. Katz found caching
  of little use for long-tailed LoRA popularity (§3.2); a small cache still serves bursts of
  one style for free;
* a loader process that dies fails its loads with :class:`LoraLoadError` and the pool is
  rebuilt for the next load; :meth:`close` stops the processes and drops the cache.

Errors are raised to the caller at once when they need no I/O (unknown name: NOT_FOUND,
too many loads: RESOURCE_EXHAUSTED); errors of the file itself arrive through the load's
future, as :class:`LoraFormatError` or :class:`LoraLoadError`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.multiprocessing

from argus.worker.adapters.lora.errors import (
    LoraBusyError,
    LoraError,
    LoraFormatError,
    LoraInvalidError,
    LoraLoadError,
)
from argus.worker.adapters.lora.fileformat import ReadFailure, SharedRead, read_file
from argus.worker.adapters.lora.library import LoraLibrary
from argus.worker.adapters.lora.patch import LoadedLora, loaded_from
from argus.worker.adapters.lora.session import LoraRequest, LoraSession, PendingLora

log = logging.getLogger(__name__)

START_METHODS = ("spawn", "forkserver")


@dataclass(frozen=True)
class LoraConfig:
    """How a worker loads LoRAs. Each field maps to one ``argus worker`` flag."""

    processes: int = 2
    """Loader processes. Loads are I/O bound; two keep one slow file from stalling the rest."""
    max_pending: int = 16
    """Distinct LoRA files loading or queued at once; more are refused (RESOURCE_EXHAUSTED)."""
    cache_items: int = 8
    """Loaded LoRAs kept after their requests (0: no cache)."""
    cache_bytes: int = 2 * 1024**3
    """Bytes of LoRA tensors the cache may hold (shared memory, host side)."""
    bound: int = 10
    """Default asynchrony bound K: steps that may run before the LoRAs must be merged.
    Katz profiles SDXL at 50 steps and sets K = 10; ``argus profile-lora`` measures it."""
    wait_timeout_s: float = 120.0
    """Longest wait at the bound before the request fails with UNAVAILABLE."""
    start_method: str = "spawn"
    """"spawn" or "forkserver": how loader processes start ("fork" is unsafe with threads)."""
    niceness: int = 10
    """Added to the loader processes' nice value (0..19): loads yield the CPU to serving."""

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ValueError(f"LoraConfig.processes {self.processes}: must be ≥ 1")
        if self.max_pending < 1:
            raise ValueError(f"LoraConfig.max_pending {self.max_pending}: must be ≥ 1")
        if self.cache_items < 0 or self.cache_bytes < 0:
            raise ValueError(
                f"LoraConfig cache_items {self.cache_items} / cache_bytes {self.cache_bytes}: "
                "must be ≥ 0"
            )
        if self.bound < 0:
            raise ValueError(f"LoraConfig.bound {self.bound}: must be ≥ 0")
        if not (self.wait_timeout_s > 0 and math.isfinite(self.wait_timeout_s)):
            raise ValueError(f"LoraConfig.wait_timeout_s {self.wait_timeout_s}: must be > 0")
        if not 0 <= self.niceness <= 19:
            raise ValueError(f"LoraConfig.niceness {self.niceness}: must be in 0..19")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"LoraConfig.start_method {self.start_method!r}: expected one of "
                f"{', '.join(START_METHODS)}"
            )


@dataclass(frozen=True)
class LoaderStats:
    """Counters of one loader since it started."""

    loads: int  # loads submitted to the processes
    cache_hits: int  # requests served from the cache
    shared_loads: int  # requests that joined a load already in flight
    failures: int  # loads that ended in an error
    busy_rejections: int  # requests refused because max_pending loads were in flight
    in_flight: int  # loads queued or running now
    cached: int  # LoRAs in the cache now
    cached_bytes: int  # their tensor bytes
    pool_restarts: int  # pools rebuilt after a loader process died


_Key = tuple[str, int, int]  # resolved path, mtime_ns, size


def _init_loader_process(niceness: int) -> None:
    """Runs once in each loader process: one thread (the work is I/O), a lower CPU priority
    (loading is background work and must not slow the denoising thread where CPUs are
    scarce), quiet on SIGINT (the worker decides when loaders stop)."""
    import signal

    torch.set_num_threads(1)
    if niceness:
        os.nice(niceness)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _load_in_process(path: str) -> SharedRead | ReadFailure:
    return read_file(path, share=True)


def process_pool(config: LoraConfig) -> Executor:
    """The loader processes: ``config.processes`` of them, started by spawn or forkserver."""
    context = torch.multiprocessing.get_context(config.start_method)
    return ProcessPoolExecutor(
        max_workers=config.processes,
        mp_context=context,
        initializer=_init_loader_process,
        initargs=(config.niceness,),
    )


class _Cache:
    """LRU of loaded LoRAs, bounded by count and by bytes."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: OrderedDict[_Key, LoadedLora] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: _Key) -> LoadedLora | None:
        lora = self._items.get(key)
        if lora is not None:
            self._items.move_to_end(key)
        return lora

    def put(self, key: _Key, lora: LoadedLora) -> None:
        if self.max_items == 0 or lora.nbytes > self.max_bytes or key in self._items:
            return
        self._items[key] = lora
        self.nbytes += lora.nbytes
        while len(self._items) > self.max_items or self.nbytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0


class LoraLoader:
    """The worker's LoRA loader: process pool, in-flight bound, cache, and request sessions.

    Build one at worker start (:meth:`warm` starts the processes before the first request),
    call :meth:`open_session` per request, :meth:`close` at shutdown.
    """

    def __init__(
        self,
        library: LoraLibrary,
        config: LoraConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        executor: Callable[[LoraConfig], Executor] | None = None,
    ) -> None:
        """``executor`` builds the pool that runs the reads (default: :func:`process_pool`);
        tests pass one they drive by hand to make a load slow without sleeping."""
        self.library = library
        self.config = config or LoraConfig()
        self._clock = clock
        self._make_pool = executor or process_pool
        self._lock = threading.Lock()
        self._cache = _Cache(self.config.cache_items, self.config.cache_bytes)
        self._in_flight: dict[_Key, Future[LoadedLora]] = {}
        self._pool: Executor | None = None
        self._closed = False
        self._counts = {
            "loads": 0,
            "cache_hits": 0,
            "shared_loads": 0,
            "failures": 0,
            "busy_rejections": 0,
            "pool_restarts": 0,
        }

    # -- lifecycle -----------------------------------------------------------------------------

    def warm(self) -> None:
        """Start every loader process now (each imports torch: seconds), and wait for them.

        Raises RuntimeError if they cannot start, e.g. because the program's main module is
        not import-safe (spawned processes import it; it needs ``if __name__ == "__main__"``).
        """
        with self._lock:
            pool = self._pool_locked()
        futures = [pool.submit(os.getpid) for _ in range(self.config.processes)]
        try:
            for future in futures:
                future.result()
        except BrokenProcessPool as err:
            with self._lock:
                self._drop_pool_locked(pool)
            raise RuntimeError(f"LoRA loader processes failed to start: {err}") from err

    def close(self) -> None:
        """Stop the loader processes (queued loads fail with LoraLoadError), drop the cache."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            self._cache.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LoraLoader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # -- loading -------------------------------------------------------------------------------

    def load(self, name: str, *, field: str = "adapters") -> Future[LoadedLora]:
        """A future of LoRA ``name``: done at once on a cache hit, shared with a load in flight,
        or a new load. Raises :class:`LoraNotFoundError` / :class:`LoraBusyError` at once."""
        return self._admit([LoraRequest(name, field=field)])[0][0]

    def open_session(
        self,
        unet: torch.nn.Module,
        requests: Sequence[LoraRequest],
        *,
        steps: int,
        bound: int | None = None,
        lock: AbstractContextManager[object] | None = None,
    ) -> LoraSession:
        """Start loading ``requests`` and return the request's BAL session (see session.py).

        Raises at once, before anything is loaded, for an invalid request (bad scale, a name
        listed twice: INVALID_ARGUMENT), an unknown name (NOT_FOUND) or too many loads in
        flight (RESOURCE_EXHAUSTED). ``bound`` defaults to the config's K; ``lock`` is the
        model's lock, taken by :meth:`LoraSession.close` when it has to restore.
        """
        seen: set[str] = set()
        for request in requests:
            request.check()
            if request.name in seen:
                raise LoraInvalidError(request.name, "requested twice", field=request.field)
            seen.add(request.name)
        submitted_at = self._clock()
        loads = self._admit(list(requests))
        pending = [
            PendingLora(request, future, submitted_at, cached)
            for request, (future, cached) in zip(requests, loads, strict=True)
        ]
        return LoraSession(
            unet,
            pending,
            steps=steps,
            bound=self.config.bound if bound is None else bound,
            lock=lock,
            wait_timeout_s=self.config.wait_timeout_s,
            clock=self._clock,
        )

    def stats(self) -> LoaderStats:
        with self._lock:
            return LoaderStats(
                in_flight=len(self._in_flight),
                cached=len(self._cache),
                cached_bytes=self._cache.nbytes,
                **self._counts,
            )

    # -- internals -----------------------------------------------------------------------------

    def _key(self, request: LoraRequest) -> tuple[_Key, str]:
        path = self.library.path(request.name, field=request.field)
        try:
            info = path.stat()
        except OSError as err:
            log.warning("LoRA %s: cannot stat %s: %s", request.name, path, err)
            message = f"cannot stat its file: {err.strerror or type(err).__name__}"
            raise LoraLoadError(request.name, message) from None
        return (str(path), info.st_mtime_ns, info.st_size), str(path)

    def _admit(self, requests: list[LoraRequest]) -> list[tuple[Future[LoadedLora], bool]]:
        """Futures for ``requests`` (all admitted or none), and whether each was a cache hit."""
        keys = [self._key(r) for r in requests]  # NOT_FOUND before anything starts
        with self._lock:
            if self._closed:
                raise LoraLoadError(requests[0].name if requests else "", "the loader is closed")
            new = {
                key
                for key, _ in keys
                if key not in self._in_flight and self._cache.get(key) is None
            }
            if len(self._in_flight) + len(new) > self.config.max_pending:
                self._counts["busy_rejections"] += 1
                first = next(r for r, (k, _) in zip(requests, keys, strict=True) if k in new)
                raise LoraBusyError(
                    first.name,
                    f"{len(self._in_flight)} LoRA loads in flight (max {self.config.max_pending});"
                    " retry later",
                    field=first.field,
                )
            started: list[Callable[[], None]] = []
            futures = [
                self._future_locked(r, key, path, started)
                for r, (key, path) in zip(requests, keys, strict=True)
            ]
        for start in started:  # outside the lock: a callback may run at once
            start()
        return futures

    def _future_locked(
        self, request: LoraRequest, key: _Key, path: str, started: list[Callable[[], None]]
    ) -> tuple[Future[LoadedLora], bool]:
        cached = self._cache.get(key)
        if cached is not None:
            self._counts["cache_hits"] += 1
            done: Future[LoadedLora] = Future()
            done.set_result(cached)
            return done, True
        running = self._in_flight.get(key)
        if running is not None:
            self._counts["shared_loads"] += 1
            return running, False
        public: Future[LoadedLora] = Future()
        public.set_running_or_notify_cancel()
        self._in_flight[key] = public
        self._counts["loads"] += 1
        pool = self._pool_locked()
        try:
            try:
                raw = pool.submit(_load_in_process, path)
            except (BrokenProcessPool, RuntimeError):  # broke between loads: rebuild it once
                self._drop_pool_locked(pool)
                pool = self._pool_locked()
                raw = pool.submit(_load_in_process, path)
        except Exception as err:  # no pool can take it: fail this load, not the loader
            self._in_flight.pop(key, None)
            self._counts["failures"] += 1
            log.warning("LoRA %s: cannot start the load of %s", request.name, path, exc_info=err)
            message = f"cannot start the load: {type(err).__name__}"
            public.set_exception(LoraLoadError(request.name, message))
            return public, False

        def finish(done: Future[SharedRead | ReadFailure]) -> None:
            self._finish(key, request.name, path, public, done, pool)

        started.append(lambda: raw.add_done_callback(finish))
        return public, False

    def _drop_pool_locked(self, pool: Executor) -> None:
        """Forget ``pool`` (if still current) after one of its processes died."""
        if self._pool is pool:
            self._pool = None
            self._counts["pool_restarts"] += 1
            # no cancel_futures: cancelling runs callbacks, which take the lock we hold; a
            # broken pool fails its own futures and reaps its processes
            pool.shutdown(wait=False)

    def _pool_locked(self) -> Executor:
        if self._pool is None:
            self._pool = self._make_pool(self.config)
        return self._pool

    def _finish(
        self,
        key: _Key,
        name: str,
        path: str,
        public: Future[LoadedLora],
        raw: Future[SharedRead | ReadFailure],
        pool: Executor,
    ) -> None:
        """Runs when a loader process is done: wrap the result, cache it, settle the future."""
        lora: LoadedLora | None = None
        error: LoraError | None = None
        broken = False
        try:
            outcome = raw.result()
        except CancelledError:
            error = LoraLoadError(name, "the loader was closed before this LoRA loaded")
        except BrokenProcessPool:
            broken = True
            error = LoraLoadError(name, "a LoRA loader process died; the pool restarts")
        except Exception as err:  # anything else the loader raised: the file is not to blame
            log.warning("LoRA %s: the loader failed on %s", name, path, exc_info=err)
            error = LoraLoadError(name, f"loader failed: {type(err).__name__}")
        else:
            if isinstance(outcome, ReadFailure):
                kind = LoraFormatError if outcome.kind == "format" else LoraLoadError
                log.warning("LoRA %s (%s): %s", name, path, outcome.message)
                error = kind(name, outcome.message)
            else:
                try:
                    lora = loaded_from(name, path, outcome)
                except Exception as err:  # e.g. an alpha tensor that holds no number
                    error = LoraFormatError(name, f"{type(err).__name__}: {err}")
        with self._lock:
            self._in_flight.pop(key, None)
            if broken:
                self._drop_pool_locked(pool)
            if lora is not None:
                self._cache.put(key, lora)
            else:
                self._counts["failures"] += 1
        if lora is not None:
            public.set_result(lora)
        else:
            assert error is not None
            public.set_exception(error)


def load_now(library: LoraLibrary, name: str) -> LoadedLora:
    """Load LoRA ``name`` in this process, synchronously (CLI tools, tests, benchmarks)."""
    path = str(library.path(name))
    outcome = read_file(path, share=False)
    if isinstance(outcome, ReadFailure):
        kind = LoraFormatError if outcome.kind == "format" else LoraLoadError
        raise kind(name, outcome.message)
    return loaded_from(name, path, outcome)
