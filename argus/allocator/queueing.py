"""Headroom from queueing: how busy a level's workers may be planned so requests meet the SLO.

A plan that loads a level's workers to their peak throughput P_th leaves no room for the
queue that random arrivals build: the wait grows without bound as utilisation nears 1. Instead
of a flat multiplier on the forecast, the planner caps each level's utilisation so that the
wait of all but a small share ε of the requests, at the forecast load, fits in what the SLO
leaves after their service time (the mean alone is not enough: the router refuses every
request predicted to miss its deadline, so the tail is what costs)::

    P(W_q > SLO − s) ≤ ε       (s: the level's service time on that worker class)

The router sends a prompt to the level's worker with the shortest expected completion
(Eq. 3), which behaves like one queue in front of the level's c workers, so W_q is that of a
G/G/c queue, estimated by the Allen–Cunneen approximation: the M/M/c wait (Erlang C, with
its exponential tail ``P(W > t) = C·e^{−(cμ−λ)t}``) scaled by ``(c_a² + c_s²) / 2``, where
c_a² and c_s² are the squared coefficients of variation of
inter-arrival and service times (1 and 1 for M/M/c; service times of one diffusion level vary
little, so c_s² is small, and bursts within a minute make c_a² ≥ 1).

Pure functions; results are cached, since plans ask for the same few (c, s, budget) again and
again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class QueueModel:
    """How the planner turns the SLO into a utilisation cap per level."""

    slo_s: float
    """Latency objective of a request, seconds (the router's default deadline)."""

    arrival_scv: float = 1.0
    """Squared coefficient of variation of inter-arrival times (1: Poisson arrivals)."""

    service_scv: float = 0.1
    """Squared coefficient of variation of service times at one level (0: deterministic)."""

    late_share: float = 0.02
    """Share of requests whose wait may exceed what the SLO leaves after service. The
    router refuses a request whose predicted completion misses its deadline, so planning
    only the *mean* wait into the budget (a share of a half) leaves too many to refusal."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slo_s) and self.slo_s > 0.0):
            raise ValueError(f"slo_s: must be a finite number > 0, got {self.slo_s}")
        for name in ("arrival_scv", "service_scv"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if not 0.0 < self.late_share < 1.0:
            raise ValueError(f"late_share: must be in (0, 1), got {self.late_share}")

    def max_utilisation(self, service_s: float, servers: int) -> float:
        """The highest utilisation of ``servers`` workers of service time ``service_s`` at
        which at most ``late_share`` of the requests wait longer than ``slo_s − service_s``
        (0 when none does)."""
        if servers < 1:
            raise ValueError(f"servers: must be >= 1, got {servers}")
        return _cap(
            self.slo_s, self.arrival_scv + self.service_scv, self.late_share, service_s, servers
        )

    def expected_wait_s(self, service_s: float, servers: int, utilisation: float) -> float:
        """Expected wait in queue (seconds) at ``utilisation`` (inf at 1 or above)."""
        variability = (self.arrival_scv + self.service_scv) / 2.0
        return variability * mmc_wait_s(service_s, servers, utilisation)


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``offered`` = λ/μ Erlangs."""
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its stable recursion, then C from B
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1.0 - rho * (1.0 - blocking))


def mmc_wait_s(service_s: float, servers: int, utilisation: float) -> float:
    """Expected wait in queue of M/M/c at per-server ``utilisation`` (inf at 1 or above)."""
    if utilisation >= 1.0:
        return math.inf
    if utilisation <= 0.0:
        return 0.0
    waits = erlang_c(servers, utilisation * servers)
    return waits * service_s / (servers * (1.0 - utilisation))


def mmc_late_share(service_s: float, servers: int, utilisation: float, wait_s: float) -> float:
    """P(wait > ``wait_s``) in M/M/c: Erlang C × exp(−(cμ − λ)·wait)."""
    if utilisation >= 1.0:
        return 1.0
    waits = erlang_c(servers, utilisation * servers)
    return waits * math.exp(-servers * (1.0 - utilisation) * wait_s / service_s)


UTILISATION_TOLERANCE = 2.0**-40  # how close below the largest admissible utilisation


@lru_cache(maxsize=65536)
def _cap(slo_s: float, scv_sum: float, late_share: float, service_s: float, servers: int) -> float:
    """:meth:`QueueModel.max_utilisation`, cached by its inputs as given (a plan asks for the
    same few dozen four times, and a key of rounded inputs cost its rounding on each); the
    search runs on them rounded to 1e-6."""
    return _max_utilisation(
        round(service_s, 6),
        servers,
        round(slo_s - service_s, 6),
        round(scv_sum / 2.0, 6),
        late_share,
    )


def _max_utilisation(
    service_s: float, servers: int, budget_s: float, variability: float, late_share: float
) -> float:
    """The largest utilisation whose late share is at most ``late_share``, to within
    ``UTILISATION_TOLERANCE`` below it. The log of the late share grows smoothly with the
    utilisation, so regula falsi on it with the Illinois step (which halves the weight of
    an end kept twice in a row) gets there in about ten Erlang C evaluations, where
    bisection takes forty."""
    if budget_s <= 0.0:
        return 0.0
    if variability == 0.0:
        return 1.0
    # Allen–Cunneen: a G/G/c wait is the M/M/c one scaled by the variability factor
    wait_s = budget_s / variability
    bound = math.log(late_share)
    low, high = 0.0, 1.0
    low_excess, high_excess = -math.inf, -bound  # log(late share / bound); at 1 all are late
    kept = 0  # the end the last step kept: -1 low, +1 high
    # 11 steps on average and 33 at most on 3000 random queues; were the cap ever reached,
    # low would still be admissible, only further below the largest
    for _ in range(200):
        if high - low <= UTILISATION_TOLERANCE:
            break
        mid = (low + high) / 2.0
        if -math.inf < low_excess < 0.0 < high_excess:
            guess = low + (high - low) * low_excess / (low_excess - high_excess)
            if low < guess < high:
                mid = guess
        share = mmc_late_share(service_s, servers, mid, wait_s)
        excess = math.log(share) - bound if share > 0.0 else -math.inf
        if share <= late_share:  # not the log: it may round either way at the bound
            low, low_excess = mid, excess
            if kept == -1:
                high_excess /= 2.0
            kept = -1
        else:
            high, high_excess = mid, excess
            if kept == 1:
                low_excess /= 2.0
            kept = 1
    return low
