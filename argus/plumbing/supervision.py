"""Keeping a set of processes up: restart a part that died, with backoff, and give up on one
that keeps dying.

``argus up`` runs a :class:`Supervisor` over its :class:`~argus.tools.local_cluster.LocalCluster`.
The policy is the usual one of process supervisors (systemd's ``Restart=on-failure`` with
``StartLimitBurst``, Kubernetes' crash-loop backoff): the first restart comes after
``initial_s``, each further one waits ``factor`` times longer up to ``max_s``, and a part that
died ``max_deaths`` times within ``window_s`` is not restarted again: the supervisor reports
it, and ``argus up`` stops the cluster with a non-zero exit naming it. A crash loop that
restarts forever hides the fault and burns the machine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead part is restarted, and when the supervisor gives up on it."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    max_deaths: int = 5  # deaths within window_s that make the supervisor give up
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.initial_s >= 0.0:
            raise ValueError(f"initial_s: must be >= 0, got {self.initial_s}")
        if not self.factor >= 1.0:
            raise ValueError(f"factor: must be >= 1, got {self.factor}")
        if not self.max_s >= self.initial_s:
            raise ValueError(f"max_s: must be >= initial_s, got {self.max_s}")
        if self.max_deaths < 1:
            raise ValueError(f"max_deaths: must be >= 1, got {self.max_deaths}")
        if not self.window_s > 0.0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")

    def delay_s(self, recent_deaths: int) -> float | None:
        """Seconds to wait before restarting a part that has died ``recent_deaths`` times in
        the window (this death included); None: give up."""
        if recent_deaths >= self.max_deaths:
            return None
        return min(self.max_s, self.initial_s * self.factor ** (recent_deaths - 1))


class Supervised(Protocol):
    """What the supervisor needs from a cluster."""

    def dead(self) -> Iterable[tuple[str, int | None]]:
        """Parts whose process has exited, with the exit code."""
        ...

    def restart(self, name: str) -> object:
        """Start the part ``name`` again, where it was (same address)."""
        ...


@dataclass
class _Deaths:
    times: deque[float] = field(default_factory=deque)
    restart_at: float | None = None  # a restart is pending at this clock time


class GaveUp(RuntimeError):
    """A part died too often; the message names it."""

    def __init__(self, name: str, deaths: int, window_s: float, code: int | None) -> None:
        super().__init__(
            f"{name} died {deaths} times within {window_s:.0f} s (last exit code {code}); "
            "not restarting it"
        )
        self.name = name


class Supervisor:
    """Watches ``cluster`` and restarts what dies; ``check`` does one round (tests call it
    with a fake clock), ``start`` runs rounds every ``interval_s`` on a thread until ``stop``
    or until it gives up on a part (then ``failure`` holds the :class:`GaveUp` and
    ``failed`` is set)."""

    def __init__(
        self,
        cluster: Supervised,
        policy: RestartPolicy = RestartPolicy(),
        *,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = log.warning,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.interval_s = interval_s
        self._clock = clock
        self._say = say
        self._deaths: dict[str, _Deaths] = {}
        self.restarts = 0
        self.failure: GaveUp | None = None
        self.failed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def check(self) -> None:
        """One round: note new deaths, restart what is due; raises :class:`GaveUp`."""
        now = self._clock()
        for name, code in self.cluster.dead():
            record = self._deaths.setdefault(name, _Deaths())
            if record.restart_at is None:
                record.times.append(now)
                while record.times and now - record.times[0] > self.policy.window_s:
                    record.times.popleft()
                delay = self.policy.delay_s(len(record.times))
                if delay is None:
                    raise GaveUp(name, len(record.times), self.policy.window_s, code)
                record.restart_at = now + delay
                self._say(
                    f"{name} exited with code {code}; restarting it in {delay:.1f} s "
                    f"(death {len(record.times)} of {self.policy.max_deaths} allowed "
                    f"within {self.policy.window_s:.0f} s)"
                )
            if record.restart_at <= now:
                record.restart_at = None
                self.cluster.restart(name)
                self.restarts += 1
                self._say(f"{name} restarted")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.check()
            except GaveUp as err:
                self.failure = err
                self.failed.set()
                return
            except Exception:  # a restart that failed to launch: try again next round
                log.exception("supervisor round failed")
