"""Load forecast W_t and affinity histogram H(v) (Argus §4.2, §5.7).

Two predictors feed the solver each planning period:

* :class:`LoadPredictor` forecasts the load W_t (QPM) of the next period from past arrivals.
  Arrivals are counted in fixed periods of ``period_s`` seconds. Each completed period gives a
  rate; the forecast is ``max(ewma, peak_fraction * peak)`` where ``ewma`` is an exponentially
  weighted mean of the completed period rates (weight ``alpha`` on the newest) and ``peak`` the
  highest rate among the last ``peak_window`` completed periods. The EWMA follows slow trends;
  the peak term lifts the forecast at once after a burst, because a serving system would rather
  hold a little spare capacity than fall behind.
* :class:`AffinityHistogram` keeps, per strategy, the last ``window`` optimal-level indices the
  classifier produced and returns their normalised histogram H(v). The paper uses a look-back of
  1000 prompts and reports an L2 error of about 0.01; :func:`histogram_l2_error` measures ours.

Default choice: ``alpha=0.3, peak_window=2, peak_fraction=1.0``, i.e. the forecast is the larger
of a slow EWMA and the busiest of the last two completed minutes. Measured with
``benchmarks/predictor_error.py`` on the Azure LLM inference trace 2023 (19,366 arrivals, 57
scored one-minute periods, 190 to 510 QPM)::

    config                     MAPE   p95 APE  periods under  shortfall  over-forecast when over
    last period (alpha=1)       8.8 %  21 %     47 %           14.6 QPM   27.6 QPM
    EWMA alone (alpha=0.3)     11.2 %  36 %     54 %           19.7 QPM   36.2 QPM
    default                    12.0 %  43 %     35 %           10.1 QPM   43.7 QPM
    peak of 5 periods, a=0.5   17.5 %  50 %     21 %            6.8 QPM   60.7 QPM

(shortfall: mean over all periods of max(actual - forecast, 0); when the default under-forecasts,
it is by 28.7 QPM on average). The per-minute rate of this trace moves by about 9 % from one
minute to the next, so any forecast that tracks the last minute under-forecasts about half the
time. The peak term trades a few points of MAPE for fewer and smaller under-forecasts, which a
serving system prefers (an under-forecast means queueing and SLO misses, an over-forecast only a
slightly faster, lower-quality plan). A longer peak window lowers the under-forecast share
further but over-forecasts by more after every burst (MAPE 17.5 % with five periods); a
``peak_fraction`` below 1 gave no better trade-off on this trace. The ranking holds with 30 s
and 120 s periods. The small ``alpha`` keeps the EWMA from chasing single-minute noise; it
mostly matters on the way down, where it holds the forecast up for a few periods.

Levels are indexed slowest first (``argus.types``); loads are in queries per minute.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from argus import defaults
from argus.types import LoadForecast, Strategy

__all__ = [
    "AffinityHistogram",
    "ForecastErrors",
    "HistogramErrors",
    "LoadPredictor",
    "LoadPredictorConfig",
    "forecast_errors",
    "histogram_l2_error",
]

# With no completed period yet, the partial period's rate is extrapolated as count / elapsed;
# the elapsed time is floored at this many seconds (or the period, if shorter) so that a single
# arrival seen a moment ago does not read as an unbounded rate.
_MIN_ELAPSED_S = 1.0


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return result


def _period(period_s: float) -> float:
    value = _finite("period_s", period_s)
    if value <= 0.0:
        raise ValueError(f"period_s must be > 0 seconds, got {period_s!r}")
    return value


@dataclass(frozen=True)
class LoadPredictorConfig:
    """Parameters of :class:`LoadPredictor`; see the module docstring for how the defaults were
    chosen. The counting period is not here: it is the planning period, the allocator's
    (:attr:`~argus.allocator.config.ControlConfig.period_s`), given to the predictor."""

    alpha: float = 0.3  # EWMA weight of the newest completed period, in (0, 1]; 1 = last period
    peak_window: int = 2  # completed periods the peak term looks back over (>= 1)
    peak_fraction: float = 1.0  # share of that peak the forecast never drops below, in [0, 1]
    partial_min_s: float = 0.0  # once this much of the open period has passed, its rate counts
    # too (0: only completed periods); lets a re-plan in the middle of a burst see the burst
    partial_z: float = 0.0  # the open period's rate counts only when it stays above the EWMA
    # with its count lowered by this many Poisson standard deviations (count - z·√count): a few
    # seconds of arrivals are noisy, and the forecast, a max, would otherwise follow every
    # upward blip (0: always)

    def __post_init__(self) -> None:
        alpha = _finite("alpha", self.alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if (
            isinstance(self.peak_window, bool)
            or not isinstance(self.peak_window, int)
            or self.peak_window < 1
        ):
            raise ValueError(f"peak_window must be an integer >= 1, got {self.peak_window!r}")
        partial = _finite("partial_min_s", self.partial_min_s)
        if partial < 0.0:
            raise ValueError(f"partial_min_s must be >= 0 seconds, got {self.partial_min_s!r}")
        if _finite("partial_z", self.partial_z) < 0.0:
            raise ValueError(f"partial_z must be >= 0, got {self.partial_z!r}")
        peak_fraction = _finite("peak_fraction", self.peak_fraction)
        if not 0.0 <= peak_fraction <= 1.0:
            raise ValueError(f"peak_fraction must be in [0, 1], got {self.peak_fraction!r}")


class LoadPredictor:
    """Forecasts the load W_t (QPM) of the next period from arrival times.

    Periods: ``[origin + k * period_s, origin + (k + 1) * period_s)``. The origin is ``start_s``
    when given (the time the predictor started watching, so that quiet periods before the first
    arrival count as 0 QPM), otherwise the first arrival observed. Only completed periods feed
    the estimate; periods without arrivals count as 0 QPM.

    The clock is the caller's: arrival times and ``forecast(now_s)`` use the same time base
    (seconds) and nothing here reads the wall clock.

    An arrival counts as its weight (1 unless :meth:`observe` is told otherwise): the rates
    are in full requests per minute, so an edit that costs a share of one counts as that share.

    Arrivals may come out of order within the current period (the newest period any arrival fell
    into). An arrival older than the current period's start is *not* counted, because its period
    has already been folded into the estimate; it increments :attr:`late_arrivals` instead.
    ``forecast`` does not change the state: it evaluates the periods that have ended by
    ``now_s`` without closing them, so an arrival stamped before ``now_s`` but delivered after
    the forecast still counts.

    Memory: the EWMA, the current period's count and at most ``peak_window`` period rates; time
    per arrival O(1), per period change O(peak_window) however long the gap.
    """

    def __init__(
        self,
        config: LoadPredictorConfig | None = None,
        start_s: float | None = None,
        *,
        period_s: float = defaults.PLANNING_PERIOD_S,
    ) -> None:
        """``period_s``: the counting period, seconds (> 0): the planning period."""
        self.config = config if config is not None else LoadPredictorConfig()
        self._period_s = _period(period_s)
        self._origin: float | None = None if start_s is None else _finite("start_s", start_s)
        self._period: int = 0  # index of the current (open) period
        self._count: float = 0.0  # weight of the arrivals counted in the current period
        self._ewma: float | None = None  # over completed periods; None before the first
        self._recent: deque[float] = deque(maxlen=self.config.peak_window)  # newest last, QPM
        self._completed: int = 0  # periods completed so far
        self.late_arrivals: int = 0  # arrivals older than the current period, not counted
        self.arrivals: int = 0  # arrivals counted

    # -- time -> period ------------------------------------------------------------------------
    def _period_of(self, t: float) -> int:
        assert self._origin is not None
        period_s = self._period_s
        index = math.floor((t - self._origin) / period_s)
        # Keep the index consistent with period_start() despite rounding of the division.
        if self._origin + (index + 1) * period_s <= t:
            index += 1
        elif self._origin + index * period_s > t:
            index -= 1
        return index

    def period_start(self, index: int) -> float:
        """Start time (s) of period ``index``; the origin must be known."""
        if self._origin is None:
            raise ValueError("no origin yet: give start_s or observe an arrival first")
        return self._origin + index * self._period_s

    # -- rates ---------------------------------------------------------------------------------
    def _rate(self, count: float) -> float:
        return count * 60.0 / self._period_s

    def _closed(self, upto: int) -> tuple[float | None, list[float], int]:
        """(ewma, recent rates newest last, completed) after closing every period < ``upto``."""
        ewma = self._ewma
        recent = list(self._recent)
        completed = self._completed
        gap = upto - self._period
        if gap <= 0:
            return ewma, recent, completed
        alpha = self.config.alpha
        rate = self._rate(self._count)
        ewma = rate if ewma is None else alpha * rate + (1.0 - alpha) * ewma
        recent.append(rate)
        empty = gap - 1  # whole periods with no arrival between the current one and ``upto``
        if empty > 0:
            ewma *= (1.0 - alpha) ** empty  # the EWMA update with a 0 QPM rate, ``empty`` times
            recent.extend([0.0] * min(empty, self.config.peak_window))
        return ewma, recent[-self.config.peak_window :], completed + gap

    def _advance(self, upto: int) -> None:
        if upto <= self._period:
            return
        ewma, recent, completed = self._closed(upto)
        self._ewma, self._completed = ewma, completed
        self._recent.clear()
        self._recent.extend(recent)
        self._period, self._count = upto, 0.0

    # -- public --------------------------------------------------------------------------------
    def observe(self, arrival_s: float, weight: float = 1.0) -> None:
        """Count one arrival at ``arrival_s`` (seconds, caller's clock) as ``weight`` requests
        (finite, > 0): the rates are sums of weights per minute. An inpainting edit on workers
        that batch edits weighs its share of a full request (``RouterReport.arrival_costs``,
        priced by the edit cost model, InstGenIE §4.4); anything else 1."""
        t = _finite("arrival_s", arrival_s)
        if not (_finite("weight", weight) > 0.0):
            raise ValueError(f"weight must be > 0, got {weight!r}")
        if self._origin is None:
            self._origin = t
        index = self._period_of(t)
        if index < self._period:
            self.late_arrivals += 1
            return
        self._advance(index)
        self._count += weight
        self.arrivals += 1

    def observe_many(self, arrivals_s: Iterable[float]) -> None:
        """``observe`` each arrival in turn."""
        for t in arrivals_s:
            self.observe(t)

    def forecast(self, now_s: float) -> LoadForecast:
        """Forecast W_t for the period that contains ``now_s``.

        Uses the periods completed by ``now_s``. With none completed it extrapolates the open
        period's rate (count / elapsed, elapsed floored at 1 s) and returns 0 QPM when nothing
        has been seen.
        """
        now = _finite("now_s", now_s)
        if self._origin is None:
            return LoadForecast(qpm=0.0, ewma_qpm=0.0, peak_qpm=0.0, at_s=now)
        upto = max(self._period_of(now), self._period)
        ewma, recent, completed = self._closed(upto)
        if completed == 0 or ewma is None:
            elapsed = now - self.period_start(self._period)
            elapsed = max(elapsed, min(_MIN_ELAPSED_S, self._period_s))
            rate = self._count * 60.0 / elapsed
            return LoadForecast(qpm=rate, ewma_qpm=rate, peak_qpm=rate, at_s=now)
        peak = max(recent)
        qpm = max(ewma, self.config.peak_fraction * peak, self._open_rate(now, upto, ewma))
        return LoadForecast(qpm=qpm, ewma_qpm=ewma, peak_qpm=peak, at_s=now)

    def _open_rate(self, now: float, upto: int, ewma: float) -> float:
        """Rate of the open period so far, once ``partial_min_s`` of it has passed and if it is
        ``partial_z`` standard deviations above ``ewma``; else 0."""
        if not self.config.partial_min_s or upto != self._period:
            return 0.0
        elapsed = now - self.period_start(self._period)
        if elapsed < self.config.partial_min_s:
            return 0.0
        low = self._count - self.config.partial_z * math.sqrt(self._count)
        if low * 60.0 / elapsed <= ewma:
            return 0.0
        return self._count * 60.0 / elapsed


@dataclass(frozen=True)
class ForecastErrors:
    """Forecast vs realised per-period rate over a trace (see :func:`forecast_errors`).

    Percentage figures leave out periods whose realised rate is 0 (no percentage exists); the
    QPM figures and fractions use every evaluated period.
    """

    periods: int  # periods evaluated (every complete period after the first)
    mape_pct: float  # mean |forecast - actual| / actual, percent
    p95_ape_pct: float  # 95th percentile of the same, percent
    mae_qpm: float  # mean |forecast - actual|, QPM
    under_fraction: float  # share of periods with forecast < actual
    mean_under_qpm: float  # mean (actual - forecast) over the under-forecast periods (0 if none)
    mean_under_pct: float  # mean (actual - forecast) / actual over those periods, percent
    mean_shortfall_qpm: float  # mean max(actual - forecast, 0) over all periods
    over_fraction: float  # share of periods with forecast > actual
    mean_over_qpm: float  # mean (forecast - actual) over the over-forecast periods (0 if none)
    mean_actual_qpm: float  # mean realised rate of the evaluated periods


def forecast_errors(
    arrivals_s: Sequence[float],
    config: LoadPredictorConfig | None = None,
    *,
    period_s: float = defaults.PLANNING_PERIOD_S,
) -> ForecastErrors:
    """Replay ``arrivals_s`` through a :class:`LoadPredictor` and score its forecasts.

    Periods are aligned to the first arrival. For every period k >= 1, the forecast made at the
    period's start (having seen every arrival before it) is compared with the period's realised
    rate. The last period is left out when the trace ends before it does (its rate would be
    understated). Raises ``ValueError`` when fewer than two complete periods exist.
    """
    config = config if config is not None else LoadPredictorConfig()
    times = np.sort(np.asarray(arrivals_s, dtype=float))
    if times.size == 0 or not np.all(np.isfinite(times)):
        raise ValueError("forecast_errors needs a non-empty sequence of finite arrival times")
    origin = float(times[0])
    period_s = _period(period_s)
    complete = math.floor((float(times[-1]) - origin) / period_s)  # periods fully covered
    if complete < 2:
        raise ValueError(
            f"forecast_errors needs at least 2 complete periods of {period_s} s; the trace spans "
            f"{float(times[-1]) - origin:.3f} s"
        )
    predictor = LoadPredictor(config, start_s=origin, period_s=period_s)
    # Period boundaries computed the way the predictor computes them.
    bounds = [predictor.period_start(k) for k in range(complete + 1)]
    cuts = np.searchsorted(times, bounds, side="left")
    forecasts = np.empty(complete - 1)
    actuals = np.empty(complete - 1)
    for k in range(1, complete):
        predictor.observe_many(times[cuts[k - 1] : cuts[k]].tolist())
        forecasts[k - 1] = predictor.forecast(bounds[k]).qpm
        actuals[k - 1] = (cuts[k + 1] - cuts[k]) * 60.0 / period_s
    diff = forecasts - actuals
    under = diff < 0.0
    over = diff > 0.0
    positive = actuals > 0.0
    ape = np.abs(diff[positive]) / actuals[positive] * 100.0
    under_pct = -diff[under & positive] / actuals[under & positive] * 100.0
    return ForecastErrors(
        periods=int(diff.size),
        mape_pct=float(ape.mean()) if ape.size else 0.0,
        p95_ape_pct=float(np.percentile(ape, 95)) if ape.size else 0.0,
        mae_qpm=float(np.abs(diff).mean()),
        under_fraction=float(under.mean()),
        mean_under_qpm=float(-diff[under].mean()) if under.any() else 0.0,
        mean_under_pct=float(under_pct.mean()) if under_pct.size else 0.0,
        mean_shortfall_qpm=float(np.maximum(-diff, 0.0).mean()),
        over_fraction=float(over.mean()),
        mean_over_qpm=float(diff[over].mean()) if over.any() else 0.0,
        mean_actual_qpm=float(actuals.mean()),
    )


class AffinityHistogram:
    """Per strategy, the histogram H(v) of the last ``window`` classified optimal levels.

    ``num_levels_by_strategy[s]`` is the number of levels of strategy ``s``; level indices are
    slowest first. Each strategy keeps a deque of its last ``window`` indices and running counts,
    so ``observe`` is O(1) and memory is O(window) per strategy.
    """

    def __init__(
        self,
        num_levels_by_strategy: Mapping[Strategy, int],
        window: int = defaults.HISTOGRAM_WINDOW,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if not num_levels_by_strategy:
            raise ValueError("num_levels_by_strategy is empty: give at least one strategy")
        self.window = window
        self._levels: dict[Strategy, int] = {}
        self._recent: dict[Strategy, deque[int]] = {}
        self._counts: dict[Strategy, list[int]] = {}
        for strategy, levels in num_levels_by_strategy.items():
            if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
                raise ValueError(f"strategy {strategy} needs >= 1 level, got {levels!r}")
            self._levels[strategy] = levels
            self._recent[strategy] = deque()
            self._counts[strategy] = [0] * levels

    def _check(self, strategy: Strategy) -> int:
        try:
            return self._levels[strategy]
        except (KeyError, TypeError):
            known = ", ".join(str(s) for s in self._levels)
            raise ValueError(f"unknown strategy {strategy!r}; known: {known}") from None

    def num_levels(self, strategy: Strategy) -> int:
        """Number of levels of ``strategy``."""
        return self._check(strategy)

    def observe(self, strategy: Strategy, level_index: int) -> None:
        """Record the classifier's optimal level (index, slowest first) for one prompt."""
        levels = self._check(strategy)
        index = operator.index(level_index)
        if not 0 <= index < levels:
            raise ValueError(
                f"level index {level_index!r} out of range for strategy {strategy} "
                f"({levels} levels, valid 0..{levels - 1})"
            )
        recent = self._recent[strategy]
        counts = self._counts[strategy]
        if len(recent) == self.window:
            counts[recent.popleft()] -= 1
        recent.append(index)
        counts[index] += 1

    def count(self, strategy: Strategy) -> int:
        """Observations currently in the window of ``strategy`` (at most ``window``)."""
        self._check(strategy)
        return len(self._recent[strategy])

    def histogram(
        self, strategy: Strategy, prior: Sequence[float] | None = None, prior_prompts: int = 0
    ) -> tuple[float, ...]:
        """H(v) of ``strategy``, slowest level first, summing to 1.

        While the window holds fewer than ``prior_prompts`` observations, ``prior`` (shares per
        level, normalised here) stands in for the missing ones: the first plans of a run then
        see a histogram of ``prior_prompts`` prompts, the prior's shape at first and the
        traffic's as it is observed; from ``prior_prompts`` observations on the prior has no
        weight. With neither observations nor a prior the distribution is uniform: no
        evidence, no preference.
        """
        levels = self._check(strategy)
        total = len(self._recent[strategy])
        counts: list[float] = [float(c) for c in self._counts[strategy]]
        fill = max(0, prior_prompts - total)
        if prior is not None and fill > 0:
            if len(prior) != levels:
                raise ValueError(
                    f"prior: expected {levels} shares for strategy {strategy}, got {len(prior)}"
                )
            mass = float(sum(prior))
            if mass > 0.0 and all(math.isfinite(p) and p >= 0.0 for p in prior):
                counts = [c + fill * p / mass for c, p in zip(counts, prior, strict=True)]
                total += fill
        if total == 0:
            return tuple([1.0 / levels] * levels)
        return tuple(c / total for c in counts)


@dataclass(frozen=True)
class HistogramErrors:
    """Error of predicting the next window's histogram by the previous window's.

    The paper's "L2 error ≈ 0.01" does not say whether it means the L2 norm of the difference or
    a mean squared error, so both are reported.
    """

    windows: int  # (previous, next) window pairs evaluated
    window: int  # labels per window
    num_levels: int
    mean_l2: float  # mean of ||H_pred - H_next||_2
    p95_l2: float  # 95th percentile of the same
    mean_mse: float  # mean over pairs of mean over bins of (H_pred - H_next)^2


def histogram_l2_error(
    labels: Sequence[int], num_levels: int, window: int = defaults.HISTOGRAM_WINDOW
) -> HistogramErrors:
    """Slide over ``labels`` in non-overlapping steps of ``window`` and score the predictor.

    Window j is ``labels[j*window:(j+1)*window]`` (a trailing partial window is dropped). For
    each j >= 1 the prediction is window j-1's normalised histogram — what
    :class:`AffinityHistogram` returns at that point — and the truth is window j's.
    Raises ``ValueError`` for fewer than two complete windows or an out-of-range label.
    """
    if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 1:
        raise ValueError(f"num_levels must be an integer >= 1, got {num_levels!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    values = np.asarray(labels)
    if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
        raise ValueError("labels must be a flat sequence of integer level indices")
    bad = np.flatnonzero((values < 0) | (values >= num_levels))
    if bad.size:
        position = int(bad[0])
        raise ValueError(
            f"level index {int(values[position])} at position {position} out of range "
            f"0..{num_levels - 1}"
        )
    windows = values.size // window
    if windows < 2:
        raise ValueError(
            f"need at least 2 complete windows of {window} labels, got {values.size} labels"
        )
    blocks = values[: windows * window].reshape(windows, window)
    hists = np.stack([np.bincount(row, minlength=num_levels) for row in blocks]) / window
    diff = hists[:-1] - hists[1:]
    l2 = np.sqrt((diff**2).sum(axis=1))
    return HistogramErrors(
        windows=int(l2.size),
        window=window,
        num_levels=num_levels,
        mean_l2=float(l2.mean()),
        p95_l2=float(np.percentile(l2, 95)),
        mean_mse=float((diff**2).mean()),
    )
