"""Which workers the allocator plans for: the last heartbeat of each, and who has gone quiet.

A worker joins with its first heartbeat and stays a member while heartbeats keep coming. One
that has sent none for ``timeout_s`` (3 heartbeat intervals in the service) is dead: it is
removed and planned around; should it come back, its next heartbeat is a join like any other.
A worker that says it is leaving is removed at once. Only live workers are kept, so memory is
bounded by ``max_workers``.

A worker id is bound to the identity (its certificate's, see
:mod:`argus.plumbing.internal_tls`) whose heartbeat first registered it: another identity
cannot heartbeat for it, leave for it or move it (:class:`NotOwnerError`). The binding
outlives the member (a dead worker's id cannot be taken over by another identity while it
restarts); the oldest bindings of ids no longer live are dropped beyond ``2 × max_workers``.
On a plaintext plane every caller is ``""``, so the binding holds nothing back. On the
mutual-TLS plane the service checks more before a heartbeat reaches this: the id must be the
certificate's own name (:func:`argus.allocator.service.check_worker_identity`), so a worker
certificate cannot register made-up ids either, and the binding is a second line of defence.

Pure bookkeeping: times are the caller's clock, nothing here locks (the allocator's control
holds one lock around every call) and nothing talks to a network.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from argus.contracts.workers import WorkerReport
from argus.types import ClusterView, WorkerState


@dataclass(frozen=True)
class Member:
    """A live worker as the allocator knows it."""

    report: WorkerReport  # its latest heartbeat
    joined_at_s: float
    last_seen_s: float

    @property
    def worker_id(self) -> str:
        return self.report.worker_id

    def state(self) -> WorkerState:
        """The control plane's view of this worker (for the solver)."""
        r = self.report
        return WorkerState(r.worker_id, r.worker_class, True, r.level, r.queue_length)


class Change(enum.Enum):
    """What a heartbeat changed in the membership."""

    JOINED = "joined"  # a worker not known before
    MOVED = "moved"  # a known worker at a new address or of a new class: routers must learn it
    UPDATED = "updated"  # a known worker's queue, level or retrieval: no re-plan needed
    LEFT = "left"  # a known worker said it is leaving and was removed
    IGNORED = "ignored"  # an unknown worker said it is leaving: nothing to do


class MembershipFullError(RuntimeError):
    """A join beyond ``max_workers``."""


class NotOwnerError(PermissionError):
    """A heartbeat for a worker id (or a report for a router id) that another identity
    registered."""


class Membership:
    """The live workers, by id, and which identity owns each id."""

    def __init__(self, timeout_s: float, max_workers: int) -> None:
        if not timeout_s > 0.0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers: must be >= 1, got {max_workers}")
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._members: dict[str, Member] = {}
        self._owners: dict[str, str] = {}  # worker id → identity, oldest binding first

    def __len__(self) -> int:
        return len(self._members)

    def get(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def members(self) -> tuple[Member, ...]:
        """Every live worker, sorted by id (plans list workers in this order)."""
        return tuple(self._members[k] for k in sorted(self._members))

    def view(self) -> ClusterView:
        """The live workers as the solver takes them."""
        return ClusterView(tuple(m.state() for m in self.members()))

    def heartbeat(self, report: WorkerReport, now_s: float, owner: str = "") -> Change:
        """Record ``report`` received at ``now_s`` from identity ``owner``; says whether the
        plan must change. :class:`NotOwnerError` when another identity owns the worker id."""
        bound = self._owners.get(report.worker_id)
        if bound is not None and bound != owner:
            raise NotOwnerError(
                f"worker_id: {report.worker_id!r} belongs to another identity; "
                f"{owner or 'an anonymous caller'} may not heartbeat, leave or move it"
            )
        known = self._members.get(report.worker_id)
        if report.leaving:
            if known is None:
                return Change.IGNORED
            del self._members[report.worker_id]
            return Change.LEFT
        if known is None:
            if len(self._members) >= self.max_workers:
                raise MembershipFullError(
                    f"worker_id: {report.worker_id!r} cannot join, the allocator already "
                    f"tracks its maximum of {self.max_workers} workers"
                )
            self._members[report.worker_id] = Member(report, now_s, now_s)
            self._bind(report.worker_id, owner)
            return Change.JOINED
        self._members[report.worker_id] = Member(report, known.joined_at_s, now_s)
        old = known.report
        if (old.address, old.worker_class) != (report.address, report.worker_class):
            return Change.MOVED
        return Change.UPDATED

    def _bind(self, worker_id: str, owner: str) -> None:
        self._owners.pop(worker_id, None)
        self._owners[worker_id] = owner
        excess = len(self._owners) - 2 * self.max_workers
        if excess > 0:
            gone = [w for w in self._owners if w not in self._members][:excess]
            for w in gone:
                del self._owners[w]

    def expire(self, now_s: float) -> tuple[str, ...]:
        """Remove the workers silent for more than ``timeout_s``; returns their ids, sorted."""
        dead = sorted(
            worker_id
            for worker_id, member in self._members.items()
            if now_s - member.last_seen_s > self.timeout_s
        )
        for worker_id in dead:
            del self._members[worker_id]
        return tuple(dead)
