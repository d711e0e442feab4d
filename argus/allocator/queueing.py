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

**Measured caps** (:attr:`QueueModel.caps` = ``measured``, :func:`measured_caps`). Allen–Cunneen
sees a service time through its mean and one SCV, and its exponential tail is an
approximation of an approximation; what the router refuses is the real tail. The measured
variant finds each cap by simulating the queue itself: a first-come-first-served c-server
queue with Poisson arrivals whose service times are drawn from a :class:`ServiceSpread` (in
simulation, the simulator's own distribution: jitter, and adapters' seconds, the LoRA fetch
hidden by the request's own wait), and takes the largest utilisation at which at most
``late_share`` of the requests wait and are served past the SLO. Every (level, pool size,
utilisation) of a table runs at once, as one vectorised pass over the requests (common random
numbers: one arrival sequence, one draw of service times per level), first on a grid of step
0.05, then on a grid of step 0.005 within the bracket found. Tables are cached by the
distribution, the SLO and the share, so a process computes each once; what a table costs and
how much a cap moves between seeds is in ``docs/control-plane-internals.md``.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class CapSource(enum.StrEnum):
    """Where the utilisation caps come from (the first is the default)."""

    ANALYTIC = "analytic"  # Allen–Cunneen over Erlang C (a bound)
    MEASURED = "measured"  # the simulated queue with the service-time spread


@dataclass(frozen=True, eq=False)
class ServiceDraws:
    """Draws of one level's service time on one worker class: request ``i``, having waited
    ``w`` seconds in the queue, is served in ``factor[i] × (fixed_s[i] + max(hideable_s[i] −
    w, 0))`` seconds (what a wait can hide: a LoRA fetch started at arrival)."""

    fixed_s: FloatArray
    hideable_s: FloatArray
    factor: FloatArray

    def at_no_wait(self) -> FloatArray:
        """Each draw's service seconds after no wait (the widest case)."""
        seconds: FloatArray = self.factor * (self.fixed_s + self.hideable_s)
        return seconds


class ServiceSpread(Protocol):
    """How service times of each (worker class, level) are distributed."""

    def key(self, worker_class: str, level: str) -> Hashable:
        """Equal keys: the same distribution (what measured tables are cached by)."""
        ...

    def draws(self, worker_class: str, level: str, count: int, seed: int) -> ServiceDraws:
        """``count`` seeded draws (the same seed, the same draws)."""
        ...


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

    caps: CapSource = CapSource.ANALYTIC
    """``analytic``: Allen–Cunneen with :attr:`service_scv`; ``measured``: the simulated queue
    with :attr:`spread`'s service times (:func:`measured_caps`)."""

    spread: ServiceSpread | None = field(default=None, compare=False)
    """The service-time distribution the measured caps simulate; required by them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "caps", CapSource(self.caps))
        if self.caps is CapSource.MEASURED and self.spread is None:
            raise ValueError("caps: 'measured' needs the service-time spread (spread=None)")
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

    def cap(self, worker_class: str, level: str, service_s: float, servers: int) -> float:
        """The utilisation cap of ``servers`` workers of ``worker_class`` at ``level``, whose
        mean service time is ``service_s``: measured from :attr:`spread` when :attr:`caps` says
        so, else :meth:`max_utilisation`."""
        if self.caps is CapSource.ANALYTIC or self.spread is None:
            return self.max_utilisation(service_s, servers)
        if servers < 1:
            raise ValueError(f"servers: must be >= 1, got {servers}")
        table = measured_caps(
            self.spread, [(worker_class, level)], servers, self.slo_s, self.late_share
        )
        return table[worker_class, level][servers - 1]

    def prepare(self, cells: Iterable[tuple[str, str]], servers: int) -> None:
        """Measure at once the caps of every (worker class, level) in ``cells`` for pools of 1
        to ``servers`` (one vectorised run instead of one per cell; nothing when analytic)."""
        if self.caps is CapSource.MEASURED and self.spread is not None:
            measured_caps(self.spread, list(cells), servers, self.slo_s, self.late_share)

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


# -- measured caps ---------------------------------------------------------------------------

MEASURED_REQUESTS = 20_000
"""Requests per simulated queue (the first tenth is warm-up and not counted)."""

MEASURED_SEED = 0
"""Seed of the arrivals and of the service draws of the measured caps."""

COARSE_GRID = tuple(round(0.04 + 0.05 * i, 2) for i in range(20))  # 0.04 … 0.99
FINE_STEPS = 10  # the fine grid's points inside one coarse step

_TABLES: dict[tuple[Hashable, float, float, int, int], tuple[float, ...]] = {}


def measured_caps(
    spread: ServiceSpread,
    cells: Iterable[tuple[str, str]],
    servers: int,
    slo_s: float,
    late_share: float,
    *,
    requests: int = MEASURED_REQUESTS,
    seed: int = MEASURED_SEED,
) -> dict[tuple[str, str], tuple[float, ...]]:
    """(worker class, level) → the measured cap of pools of 1 … ``servers`` workers (at
    least; a cached table may be longer): the largest utilisation, to 0.005, at which at most
    ``late_share`` of the requests of a simulated FCFS queue are late (wait + service >
    ``slo_s``). Utilisation is the arrival rate × the mean service time after no wait, over
    the pool. Below the first grid point that fails: a cap of 0 when even 0.004 fails.

    A cap may pass 1 where a wait hides part of the service (a LoRA fetch started at arrival:
    under load the queue hides it, so the pool serves more than its no-wait time says). The
    grid then goes on past 0.99 in the same steps up to :func:`saturation`, the utilisation at
    which every hideable second is hidden."""
    cells = list(dict.fromkeys(cells))
    keys = {cell: spread.key(*cell) for cell in cells}
    missing = [
        cell
        for cell in cells
        if len(_TABLES.get((keys[cell], slo_s, late_share, requests, seed), ())) < servers
    ]
    unique = list({keys[cell]: cell for cell in missing}.values())
    if unique:
        draws = [spread.draws(g, level, requests, seed) for g, level in unique]
        arrivals = _unit_arrivals(requests, seed)
        pools = list(range(1, servers + 1))
        coarse = coarse_grid(max(saturation(d) for d in draws))
        shares = _late_shares(draws, arrivals, pools, coarse, slo_s)
        low = np.array([[_last_fitting(coarse, row, late_share) for row in d] for d in shares])
        step = float(coarse[1] - coarse[0])
        fine: FloatArray = np.arange(1, FINE_STEPS + 1, dtype=np.float64) * (step / FINE_STEPS)
        fine_shares = _late_shares(draws, arrivals, pools, fine, slo_s, offsets=low)
        for index, cell in enumerate(unique):
            caps = []
            for c in range(servers):
                base = float(low[index, c])
                if base >= coarse[-1]:
                    caps.append(base)
                    continue
                fits = _last_fitting(base + fine, fine_shares[index, c], late_share, base)
                caps.append(round(fits, 6))
            _TABLES[keys[cell], slo_s, late_share, requests, seed] = tuple(caps)
    return {cell: _TABLES[keys[cell], slo_s, late_share, requests, seed] for cell in cells}


def saturation(draws: ServiceDraws) -> float:
    """The utilisation (over the mean service time after no wait) at which a pool serving
    ``draws`` is saturated when every wait hides all it can: 1 without hideable seconds."""
    hidden = float((draws.factor * draws.fixed_s).mean())
    no_wait = float(draws.at_no_wait().mean())
    return no_wait / hidden if hidden > 0.0 else 1.0


def coarse_grid(limit: float) -> FloatArray:
    """:data:`COARSE_GRID`, continued in its steps while below ``limit`` (see
    :func:`measured_caps`)."""
    points = list(COARSE_GRID)
    step = COARSE_GRID[1] - COARSE_GRID[0]
    while points[-1] + step < limit:
        points.append(round(points[-1] + step, 2))
    return np.asarray(points)


def late_shares_at(
    draws: list[ServiceDraws],
    pools: list[int],
    utilisation: FloatArray,
    slo_s: float,
    *,
    seed: int = MEASURED_SEED,
) -> FloatArray:
    """Late shares, shaped (distribution, pool) like ``utilisation``, of the FCFS queues of
    ``pools[p]`` workers with ``draws[d]``' service times at ``utilisation[d, p]``, all run
    together (arrivals by ``seed``; as many requests as the draws)."""
    arrivals = _unit_arrivals(draws[0].fixed_s.size, seed)
    offsets = np.asarray(utilisation, dtype=np.float64)
    shares = _late_shares(draws, arrivals, pools, np.zeros(1), slo_s, offsets=offsets)
    result: FloatArray = shares[:, :, 0]
    return result


def _unit_arrivals(count: int, seed: int) -> FloatArray:
    """Poisson arrival times at rate 1 (scaled per queue to its rate)."""
    rng = np.random.default_rng([seed, zlib.crc32(b"arrivals")])
    times: FloatArray = np.cumsum(rng.exponential(1.0, count))
    return times


def _last_fitting(
    grid: FloatArray, shares: FloatArray, late_share: float, below: float = 0.0
) -> float:
    """The grid point before the first whose late share exceeds ``late_share`` (``below``
    when the first does): noise above a failing point is not trusted."""
    fitting = below
    for point, share in zip(grid.tolist(), shares.tolist(), strict=True):
        if share > late_share:
            break
        fitting = point
    return fitting


def _late_shares(
    draws: list[ServiceDraws],
    arrivals: FloatArray,
    pools: list[int],
    grid: FloatArray,
    slo_s: float,
    *,
    offsets: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """Late shares, shaped (distribution, pool, grid point), of FCFS queues with every
    combination run together: each queue is a row of a (rows × largest pool) array of the
    times its workers come free, and each request one step over all rows. ``offsets[d, p]``
    is added to the grid of that distribution and pool (the fine pass)."""
    count = arrivals.size
    shape = (len(draws), len(pools), grid.size)
    which = np.repeat(np.arange(len(draws)), len(pools) * grid.size)
    servers = np.tile(np.repeat(np.asarray(pools), grid.size), len(draws))
    utilisation = np.tile(grid, len(draws) * len(pools))
    if offsets is not None:
        utilisation = utilisation + np.repeat(offsets.reshape(-1), grid.size)
    utilisation = np.clip(utilisation, 1e-3, None)
    means = np.array([d.at_no_wait().mean() for d in draws])
    scale = means[which] / (utilisation * servers)  # seconds per unit of arrival time
    rows = np.arange(which.size)
    free = np.zeros((which.size, max(pools)))
    free[np.arange(max(pools))[None, :] >= servers[:, None]] = np.inf
    fixed = np.stack([d.fixed_s for d in draws], axis=1)  # (request, distribution)
    hideable = np.stack([d.hideable_s for d in draws], axis=1)
    factor = np.stack([d.factor for d in draws], axis=1)
    late = np.zeros(which.size)
    warm_up = count // 10
    for i in range(count):
        arrive = arrivals[i] * scale
        worker = free.argmin(axis=1)
        start = np.maximum(arrive, free[rows, worker])
        wait = start - arrive
        service = factor[i][which] * (fixed[i][which] + np.maximum(hideable[i][which] - wait, 0.0))
        free[rows, worker] = start + service
        if i >= warm_up:
            late += wait + service > slo_s
    result: npt.NDArray[np.float64] = (late / (count - warm_up)).reshape(shape)
    return result
