"""Step-level continuous batching (InstGenIE §4.3): a running batch that waiting requests join
at step boundaries, up to a bound, and finished ones leave.

:class:`ContinuousBatch` is pure bookkeeping, with no clock, no model and no threads, so the
simulator (``argus/sim/edits.py``) and the worker's step batcher
(:mod:`argus.worker.editing.step_batch`) drive the same code:

1. :meth:`~ContinuousBatch.submit` queues a request (first in, first out);
2. at a step boundary :meth:`~ContinuousBatch.join` admits waiting requests while the batch has
   room and they are compatible with it (one ``group``: model weights, resolution, guidance
   mode), and fixes each admitted one's effective mask ratio (``ratio_of``: the worker knows at
   that moment whether it holds the template's record);
3. the caller runs one step of the running batch (:meth:`~ContinuousBatch.mask_sum` prices it);
4. :meth:`~ContinuousBatch.step` counts that step for every running request and returns the
   ones that ran their last step: they have left;
5. :meth:`~ContinuousBatch.leave` takes out a request at once (a cancel, an expired deadline),
   running or waiting; its slot is free at the next boundary.

``static=True`` is static batching, the baseline InstGenIE compares with (§6.4): waiting
requests join only when the running batch has drained, and the batch then runs until its
last request finishes. A bound of 1 serves one request at a time in arrival order.
Incompatible requests wait until the batch drains (none of a different group joins a running
batch), and a waiting request that does not fit yet keeps its place: admission is strictly
first come, first served within a group, and a request of another group at the head does not
block those behind it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

BATCHINGS = ("continuous", "static")  # the policies: step-level continuous, InstGenIE's baseline


@dataclass(frozen=True)
class BatchEntry:
    """A request as the batch sees it."""

    key: Hashable  # unique among the batch's requests (the request id)
    steps: int  # denoising steps it runs from the step it joins at
    mask_ratio: float  # its mask ratio (1: the whole image, a generation or a full run)
    group: Hashable = None  # what must match to share a batch (weights, resolution, guidance)


@dataclass(frozen=True)
class Running:
    """A running request: its entry, the steps still to run and its effective mask ratio."""

    entry: BatchEntry
    steps_left: int
    effective_ratio: float


class ContinuousBatch:
    """A running batch of at most ``bound`` requests with a first-come queue in front."""

    def __init__(self, bound: int, *, static: bool = False) -> None:
        if bound < 1:
            raise ValueError(f"batch bound must be >= 1, got {bound!r}")
        self.bound = bound
        self.static = static
        self._waiting: deque[BatchEntry] = deque()
        self._running: dict[Hashable, Running] = {}

    @property
    def waiting(self) -> tuple[BatchEntry, ...]:
        """The queue, first in first."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Running, ...]:
        """The running batch, in the order its requests joined."""
        return tuple(self._running.values())

    @property
    def group(self) -> Hashable:
        """The running batch's group (None when it is empty or its requests have none)."""
        for running in self._running.values():
            return running.entry.group
        return None

    def __len__(self) -> int:
        return len(self._running)

    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        return not self._running and not self._waiting

    def mask_sum(self) -> float:
        """Σ of the running requests' effective mask ratios (what a step's cost scales with)."""
        return sum(r.effective_ratio for r in self._running.values())

    def submit(self, entry: BatchEntry) -> None:
        """Queue ``entry``; it joins at a later boundary. A key already held is refused."""
        if entry.steps < 1:
            raise ValueError(f"request {entry.key!r}: steps must be >= 1, got {entry.steps!r}")
        if entry.key in self._running or any(w.key == entry.key for w in self._waiting):
            raise ValueError(f"request {entry.key!r} is already in the batch or its queue")
        self._waiting.append(entry)

    def join(self, ratio_of: Callable[[BatchEntry], float] | None = None) -> list[Running]:
        """At a step boundary: admit waiting requests, first come first, while the batch has
        room and they share its group; returns the admitted. ``ratio_of`` gives each admitted
        request's effective mask ratio (default: its own). Static batching admits none while
        the batch runs."""
        admitted: list[Running] = []
        if self.static and self._running:
            return admitted
        group = self.group if self._running else None
        kept: deque[BatchEntry] = deque()
        while self._waiting:
            entry = self._waiting.popleft()
            room = len(self._running) < self.bound
            if room and (not self._running or entry.group == group):
                ratio = entry.mask_ratio if ratio_of is None else float(ratio_of(entry))
                running = Running(entry, entry.steps, ratio)
                self._running[entry.key] = running
                admitted.append(running)
                group = entry.group
            else:
                kept.append(entry)
        self._waiting = kept
        return admitted

    def step(self) -> list[Running]:
        """After one step of the running batch: count it for every running request; those with
        no step left leave and are returned (in joining order)."""
        finished: list[Running] = []
        for key, running in list(self._running.items()):
            left = running.steps_left - 1
            if left <= 0:
                del self._running[key]
                finished.append(Running(running.entry, 0, running.effective_ratio))
            else:
                self._running[key] = Running(running.entry, left, running.effective_ratio)
        return finished

    def leave(self, key: Hashable) -> bool:
        """Take request ``key`` out now (running or waiting); False when it is in neither."""
        if self._running.pop(key, None) is not None:
            return True
        for entry in self._waiting:
            if entry.key == key:
                self._waiting.remove(entry)
                return True
        return False
