"""Late binding: the router holds the requests it has routed and admitted, and sends one to a
worker only when that worker has room for it.

A request queued at a worker is out of the router's hands: if the worker slows (a noisy
neighbour on its node, a long ControlNet run ahead of it), nothing re-decides the request, and
it ends as a timeout at its full deadline. So each worker is sent at most ``window`` requests
at a time (the one it runs and a few to start without a gap); the rest wait here, in their
routed worker's line. When a worker has room again it takes the first request, by deadline,
that it may serve: one counted on it, or one counted on a busier worker of the same level that
is not tied there. A request tied to its worker (its cached neighbour or its edit template is
there) waits for that one.

Every decision is taken with the newest service times: when a worker answers, the requests in
its line are predicted again (their place in line as the queue) and those that can no longer
finish by their deadlines are given back to be refused at once; a request about to be sent
that could not finish behind what still runs there (counted as admission counts it, less what
the running request has done) is refused too; and each held request has
an expiry (its deadline less its service time on an idle worker) after which no wait could
save it. A request is sent only if admission's rule (its quantile, on its service time with
admission's headroom) still admits it there, the standard it was admitted by; while it
waits, it is refused only when even its expected completion (the mean, on the service time
as learned) is late: admission's margin covers the whole wait it admitted, and asking for it
again at every answer refused each time the requests whose wait ran a little long, most of
which would still have finished in time.

Pure control-plane code with no clock and no threads of its own: the live core calls it under
its lock and wakes the held requests' threads; the simulator calls the same methods from its
event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from argus.router.admission import AdmissionRule


@dataclass(eq=False)
class Held:
    """A routed, admitted request waiting for room on a worker."""

    token: int  # the caller's key for the request
    worker: str  # the worker it is counted on: the one routed to, until another takes it
    level: int  # the planned level of ``worker``: a worker of this level may take it
    served: int  # the level index it is to be served at
    deadline: float  # the clock time by which it must be answered
    service_s: Callable[[str], float]  # its service time on a worker, as admission prices it
    pinned: bool = False  # only ``worker`` may take it (its neighbour or template is there)
    sent_to: str | None = None  # set when a worker takes it
    late: bool = False  # set when it can no longer finish in time: refuse it
    dropped: bool = False  # set when it is given back unsent: route it again
    predicted_s: float = 0.0  # when ``late``: its predicted completion, seconds from then
    budget_s: float = 0.0  # when ``late``: the time it had left then
    wake: Callable[[], object] = lambda: None  # called when any of the above changes
    expected_s: Callable[[str], float] | None = None
    """Its expected service time on a worker, for the checks while it waits, when admission
    prices it with a margin (the live router's headroom); None: ``service_s``."""


class LateBinder:
    """The held requests of one router and its rule for sending them (see the module)."""

    def __init__(self, window: int, rule: AdmissionRule) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.window = window
        self.rule = rule  # admission's
        self.mean = replace(rule, confidence=0.5)  # the rule waiting requests are re-checked by
        self._held: dict[int, Held] = {}  # by token, in the order they were held
        self._sent: Counter[str] = Counter()  # requests sent to each worker, not answered
        self._lines: Counter[str] = Counter()  # held requests counted on each worker

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Held]:
        return iter(list(self._held.values()))

    def sent(self, worker: str) -> int:
        """Requests sent to ``worker`` and not yet answered."""
        return self._sent[worker]

    def has_room(self, worker: str) -> bool:
        """Whether ``worker`` may be sent one more request now."""
        return self._sent[worker] < self.window

    def line(self, worker: str) -> int:
        """Held requests counted on ``worker``."""
        return self._lines[worker]

    def send(self, worker: str) -> None:
        """A request goes to ``worker`` now, without waiting."""
        self._sent[worker] += 1

    def done(self, worker: str) -> None:
        """A request sent to ``worker`` ended (answered, failed or given up)."""
        if self._sent[worker] > 0:
            self._sent[worker] -= 1
        if self._sent[worker] == 0:
            del self._sent[worker]

    def hold(self, held: Held) -> None:
        self._held[held.token] = held
        self._lines[held.worker] += 1

    def withdraw(self, token: int) -> Held | None:
        """Stop holding the request of ``token`` (its caller left, or it expired); None when
        it is no longer held."""
        held = self._held.pop(token, None)
        if held is not None:
            self._unline(held)
        return held

    def take(
        self, worker: str, level: int, now: float, elapsed_s: float = 0.0
    ) -> tuple[Held | None, list[Held]]:
        """The held request ``worker`` (serving ``level``, with room) takes now, marked sent
        there, and the held requests found late on the way (removed and marked ``late``):
        those that ``worker``, with the requests sent there still ahead (the one running for
        ``elapsed_s``, as admission counts it), could not finish by their deadlines. First by
        deadline among those counted on ``worker`` and those not pinned counted on another
        worker of ``level`` that has no room itself."""
        late: list[Held] = []
        while self.has_room(worker):
            candidates = [h for h in self._held.values() if self._may_take(h, worker, level)]
            if not candidates:
                return None, late
            held = min(candidates, key=lambda h: (h.deadline, h.token))
            self._remove(held)
            completion = self.rule.completion_s(
                self._sent[worker], held.service_s(worker), elapsed_s
            )
            if completion > held.deadline - now:
                late.append(self._late(held, completion, held.deadline - now))
                continue
            held.sent_to = worker
            self._sent[worker] += 1
            return held, late
        return None, late

    def overdue(self, worker: str, now: float, elapsed_s: float) -> list[Held]:
        """The held requests counted on ``worker`` that can no longer finish in time, predicted
        again now (each with the requests sent there and those ahead of it in its line as its
        queue, the one running there for ``elapsed_s``): removed and marked ``late``."""
        if not self._lines[worker]:
            return []
        line = sorted(
            (h for h in self._held.values() if h.worker == worker),
            key=lambda h: (h.deadline, h.token),
        )
        late = []
        for ahead, held in enumerate(line):
            queue = self._sent[worker] + ahead
            completion = self.mean.completion_s(queue, self._expected(held, worker), elapsed_s)
            if completion > held.deadline - now:
                self._remove(held)
                late.append(self._late(held, completion, held.deadline - now))
        return late

    def expires_at(self, held: Held) -> float:
        """The clock time after which ``held`` cannot finish by its deadline even started at
        once on the worker it is counted on."""
        return held.deadline - self.mean.completion_s(0, self._expected(held, held.worker))

    def expired(self, now: float) -> list[Held]:
        """The held requests past :meth:`expires_at`: removed and marked ``late``."""
        return [h for h in list(self._held.values()) if self.expire(h, now)]

    def expire(self, held: Held, now: float) -> bool:
        """Remove ``held`` and mark it ``late`` if it is held and past :meth:`expires_at`;
        whether it was."""
        if held.token not in self._held or now < self.expires_at(held):
            return False
        self._remove(held)
        idle = self.mean.completion_s(0, self._expected(held, held.worker))
        self._late(held, idle, held.deadline - now)
        return True

    def forget(self, workers: set[str]) -> list[Held]:
        """The held requests counted on a worker not in ``workers`` (it left the plan or is
        down), removed: the caller routes them again."""
        gone = [h for h in self._held.values() if h.worker not in workers]
        for held in gone:
            self._remove(held)
        for worker in [w for w in self._sent if w not in workers]:
            del self._sent[worker]
        return gone

    @staticmethod
    def _expected(held: Held, worker: str) -> float:
        return (held.expected_s or held.service_s)(worker)

    def _remove(self, held: Held) -> None:
        del self._held[held.token]
        self._unline(held)

    def _unline(self, held: Held) -> None:
        self._lines[held.worker] -= 1
        if not self._lines[held.worker]:
            del self._lines[held.worker]

    def _may_take(self, held: Held, worker: str, level: int) -> bool:
        if held.worker == worker:
            return True
        return not held.pinned and held.level == level and not self.has_room(held.worker)

    @staticmethod
    def _late(held: Held, predicted_s: float, budget_s: float) -> Held:
        held.late, held.predicted_s, held.budget_s = True, predicted_s, budget_s
        return held
