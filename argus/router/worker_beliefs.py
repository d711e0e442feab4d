"""What the router believes of each worker: :class:`WorkerBeliefs`, one :class:`WorkerBelief`
per worker id.

The router cannot see inside a worker. Per worker it keeps what the installed plan says (its
address, its level, its GPU class) and what the router has seen of it since: the requests it
sent there and has not had answered, when the worker's current request began, until when it
is believed down (it answered UNAVAILABLE) or still busy with a request whose caller gave up,
and the level of its last reply. :class:`~argus.router.core.RouterCore` reads these for every
decision (the policy's :class:`~argus.router.policy.Snapshot`) and updates them as requests
are sent and answered. A new plan keeps what is believed of the workers it still names and
forgets the others.

One record per worker keeps these facts together: a worker's queue, its down mark and its
address cannot drift apart, and a worker leaving the plan leaves in one step. The learned
service times (:mod:`argus.router.service_times`) and the edit account
(:mod:`argus.router.edit_loads`) are per worker too but have their own rules and stay apart.

Not thread-safe: the core calls it under its lock. Times are the core's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class WorkerBelief:
    """What the router believes of one worker."""

    address: str | None
    """Where it listens, as the installed plan says; None for a worker the plan no longer
    names that was marked down since (:meth:`WorkerBeliefs.mark_down`)."""
    level: int | None = None  # its level index in the installed plan; None: not assigned one
    gpu_class: str | None = None  # its worker class, for a worker assigned a level
    queue: int = 0  # requests this router sent it and has not had answered
    head_started: float | None = None  # when its current request began; None: none sent yet
    down_until: float | None = None  # believed down until then (it answered UNAVAILABLE)
    # still finishing a request whose caller gave up (deadline, cancel) until then
    abandoned_until: float | None = None
    answered_level: str | None = None  # the level of its last reply


class WorkerBeliefs:
    """The router's :class:`WorkerBelief` of every worker, by worker id."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBelief] = {}
        self._levels: dict[str, int] = {}

    def __getitem__(self, worker: str) -> WorkerBelief:
        return self._workers[worker]

    def install(
        self, addresses: Mapping[str, str], levels: Mapping[str, int], classes: Mapping[str, str]
    ) -> None:
        """Follow a new plan: its workers' ``addresses``, the ``levels`` it assigns and the
        GPU ``classes`` of those. What is believed of a worker it still names is kept; the
        others are forgotten."""
        kept = self._workers
        self._workers = {}
        for worker, address in addresses.items():
            belief = kept.get(worker) or WorkerBelief(address)
            belief.address = address
            belief.level = levels.get(worker)
            belief.gpu_class = classes[worker] if worker in levels else None
            self._workers[worker] = belief
        self._levels = dict(levels)

    # reads --------------------------------------------------------------------------------

    @property
    def levels(self) -> Mapping[str, int]:
        """Each worker the plan assigns a level → its level index, in the plan's order (the
        order the policy walks them in)."""
        return self._levels

    def has_workers(self) -> bool:
        """Whether the plan names any worker."""
        return any(b.address is not None for b in self._workers.values())

    def address(self, worker: str) -> str:
        """Where ``worker`` listens; KeyError for a worker the plan does not name."""
        address = self._workers[worker].address
        if address is None:
            raise KeyError(worker)
        return address

    def addresses(self) -> set[str]:
        return {b.address for b in self._workers.values() if b.address is not None}

    def gpu_class(self, worker: str) -> str:
        """``worker``'s GPU class; KeyError for a worker the plan assigns no level."""
        belief = self._workers.get(worker)
        if belief is None or belief.gpu_class is None:
            raise KeyError(worker)
        return belief.gpu_class

    def planned(self, worker: str) -> bool:
        """Whether the plan assigns ``worker`` a level."""
        belief = self._workers.get(worker)
        return belief is not None and belief.gpu_class is not None

    def answered_level(self, worker: str) -> str | None:
        belief = self._workers.get(worker)
        return None if belief is None else belief.answered_level

    def queues(self) -> dict[str, int]:
        """Each worker of the plan → the requests sent to it and not answered."""
        return {w: b.queue for w, b in self._workers.items() if b.address is not None}

    def queue_view(self, now: float) -> dict[str, int]:
        """:meth:`queues`, one more on a worker still finishing a request whose caller gave up
        (it stops at its next step, which the router waits out)."""
        return {
            w: b.queue + (b.abandoned_until is not None and b.abandoned_until > now)
            for w, b in self._workers.items()
            if b.address is not None
        }

    def down(self, now: float) -> set[str]:
        """The workers believed down at ``now``."""
        return {
            w for w, b in self._workers.items() if b.down_until is not None and b.down_until > now
        }

    def elapsed_s(self, worker: str, now: float) -> float:
        """How long ``worker``'s current request has run (0 before it was sent one)."""
        belief = self._workers.get(worker)
        if belief is None or belief.head_started is None:
            return 0.0
        return now - belief.head_started

    # updates ------------------------------------------------------------------------------

    def sent(self, worker: str, now: float) -> None:
        """A request was sent to ``worker`` (one the plan names)."""
        belief = self._workers[worker]
        if belief.queue == 0:
            belief.head_started = now
        belief.queue += 1

    def answered(self, worker: str, now: float) -> None:
        """A request sent to ``worker`` ended, answered or not. A worker serves in order: the
        next request started as this one ended. Nothing for a worker no longer counted."""
        belief = self._workers.get(worker)
        if belief is not None and belief.queue > 0:
            belief.queue -= 1
            belief.head_started = now

    def withdrawn(self, worker: str) -> None:
        """A request counted on ``worker`` and not yet sent there will not be (refused while
        the router held it, or routed again). Nothing for a worker no longer counted."""
        belief = self._workers.get(worker)
        if belief is not None and belief.queue > 0:
            belief.queue -= 1

    def moved(self, source: str, target: str, now: float) -> None:
        """A request counted on ``source`` and not yet sent there goes to ``target`` (one the
        plan names) instead."""
        self.withdrawn(source)
        self.sent(target, now)

    def mark_down(self, worker: str, until: float) -> None:
        """``worker`` answered UNAVAILABLE: believe it down until ``until``. Kept for a worker
        that has left the plan too, in case the next plan names it again."""
        belief = self._workers.get(worker)
        if belief is None:
            belief = self._workers[worker] = WorkerBelief(None)
        belief.down_until = until

    def replied(self, worker: str, level: str) -> None:
        """``worker`` (assigned a level) answered at ``level``."""
        self._workers[worker].answered_level = level

    def abandoned(self, worker: str, now: float, until: float) -> None:
        """``worker`` (assigned a level) is busy until ``until`` with a request whose caller gave
        up, or longer if it already was."""
        belief = self._workers[worker]
        was = now if belief.abandoned_until is None else belief.abandoned_until
        belief.abandoned_until = max(was, until)
