"""Load forecast, affinity histogram and trace readers (Argus §4.2, §5.7)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sized
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from argus.allocator.config import ControlConfig
from argus.allocator.predictor import (
    AffinityHistogram,
    LoadPredictor,
    LoadPredictorConfig,
    forecast_errors,
    histogram_l2_error,
)
from argus.traces import (
    TRACES_DIR,
    default_arrival_trace,
    default_prompt_trace,
    load_arrivals,
    load_prompts,
)
from argus.types import Strategy

pytestmark = pytest.mark.unit


def _uniform_arrivals(qpm: float, start_s: float, end_s: float) -> list[float]:
    """Evenly spaced arrivals at ``qpm``, half a gap after ``start_s``."""
    gap = 60.0 / qpm
    count = round((end_s - start_s) / gap)
    return [start_s + (i + 0.5) * gap for i in range(count)]


# -- LoadPredictor -----------------------------------------------------------------------------


def test_constant_rate_is_forecast_exactly() -> None:
    predictor = LoadPredictor(LoadPredictorConfig(), start_s=0.0)
    predictor.observe_many(_uniform_arrivals(120.0, 0.0, 600.0))
    forecast = predictor.forecast(600.0)
    assert forecast.qpm == pytest.approx(120.0)
    assert forecast.ewma_qpm == pytest.approx(120.0)
    assert forecast.peak_qpm == pytest.approx(120.0)
    assert forecast.at_s == 600.0


def test_constant_rate_aligned_to_first_arrival() -> None:
    predictor = LoadPredictor()  # no start_s: periods start at the first arrival
    predictor.observe_many([1000.0 + 0.5 * i for i in range(1200)])  # 120 QPM for 10 minutes
    assert predictor.period_start(0) == 1000.0
    assert predictor.forecast(1600.0).qpm == pytest.approx(120.0)


def test_step_up_is_forecast_within_one_period() -> None:
    config = LoadPredictorConfig(alpha=0.3, peak_window=2, peak_fraction=1.0)
    predictor = LoadPredictor(config, start_s=0.0)
    predictor.observe_many(_uniform_arrivals(60.0, 0.0, 300.0))
    assert predictor.forecast(300.0).qpm == pytest.approx(60.0)
    predictor.observe_many(_uniform_arrivals(300.0, 300.0, 360.0))  # one period at 300 QPM
    forecast = predictor.forecast(360.0)
    assert forecast.ewma_qpm == pytest.approx(0.3 * 300.0 + 0.7 * 60.0)  # EWMA alone lags
    assert forecast.peak_qpm == pytest.approx(300.0)
    assert forecast.qpm == pytest.approx(300.0)  # the peak term catches the step at once


def test_peak_fraction_scales_the_peak_term() -> None:
    config = LoadPredictorConfig(alpha=0.1, peak_window=3, peak_fraction=0.5)
    predictor = LoadPredictor(config, start_s=0.0)
    predictor.observe_many(_uniform_arrivals(100.0, 0.0, 60.0))
    predictor.observe_many(_uniform_arrivals(1000.0, 60.0, 120.0))
    forecast = predictor.forecast(120.0)
    assert forecast.ewma_qpm == pytest.approx(0.1 * 1000.0 + 0.9 * 100.0)
    assert forecast.qpm == pytest.approx(500.0)


def test_gaps_count_as_zero_rate_periods() -> None:
    config = LoadPredictorConfig(alpha=0.5, peak_window=2, peak_fraction=1.0)
    predictor = LoadPredictor(config, start_s=0.0)
    predictor.observe_many(_uniform_arrivals(120.0, 0.0, 60.0))  # period 0 only
    # Periods 1..4 are empty: the EWMA decays by (1 - alpha) for each, the peak window sees 0s.
    forecast = predictor.forecast(300.0)
    assert forecast.ewma_qpm == pytest.approx(120.0 * 0.5**4)
    assert forecast.peak_qpm == 0.0
    assert forecast.qpm == pytest.approx(7.5)
    # The same after an arrival closes the gap, and the next period counts normally.
    predictor.observe(330.0)
    assert predictor.forecast(330.0).ewma_qpm == pytest.approx(7.5)  # 330 s is in the open one
    assert predictor.forecast(360.0).peak_qpm == pytest.approx(1.0)
    assert predictor.forecast(360.0).ewma_qpm == pytest.approx(0.5 * 1.0 + 0.5 * 7.5)


def test_quiet_start_counts_when_start_is_given() -> None:
    predictor = LoadPredictor(LoadPredictorConfig(), start_s=0.0)
    assert predictor.forecast(0.0).qpm == 0.0
    assert predictor.forecast(600.0).qpm == 0.0  # ten empty periods: 0 QPM, not "unknown"
    unstarted = LoadPredictor()
    assert unstarted.forecast(123.0).qpm == 0.0
    with pytest.raises(ValueError, match="no origin yet"):
        unstarted.period_start(0)


def test_partial_first_period_is_extrapolated() -> None:
    predictor = LoadPredictor()
    predictor.observe_many([3.0 * i for i in range(10)])  # 10 arrivals in the first 30 s
    forecast = predictor.forecast(30.0)
    assert forecast.qpm == pytest.approx(20.0)
    assert forecast.ewma_qpm == forecast.peak_qpm == forecast.qpm  # no period completed yet
    # One arrival "just now" reads as 60 QPM (elapsed floored at 1 s), not as infinity.
    fresh = LoadPredictor()
    fresh.observe(50.0)
    assert fresh.forecast(50.0).qpm == pytest.approx(60.0)


def test_forecast_does_not_close_periods_and_late_arrivals_are_counted() -> None:
    predictor = LoadPredictor(LoadPredictorConfig(), start_s=0.0)
    predictor.observe_many([10.0, 20.0])
    predictor.forecast(200.0)  # a query; the arrival at 50 s is still in an open period
    predictor.observe(50.0)
    assert predictor.arrivals == 3 and predictor.late_arrivals == 0
    predictor.observe(130.0)  # opens period 2; periods 0 and 1 are now closed
    predictor.observe(59.0)  # older than the current period: not counted
    predictor.observe(125.0)  # out of order within the current period: counted
    assert predictor.late_arrivals == 1
    assert predictor.arrivals == 5
    # counts per period: 3, 0, 2 (open); the window holds the last two completed periods
    assert predictor.forecast(130.0).peak_qpm == pytest.approx(3.0)
    assert predictor.forecast(180.0).peak_qpm == pytest.approx(2.0)
    assert predictor.forecast(180.0).ewma_qpm == pytest.approx(0.3 * 2 + 0.7 * (0.7 * 3))


def test_memory_does_not_grow_with_arrivals() -> None:
    config = LoadPredictorConfig(peak_window=4)
    predictor = LoadPredictor(config, start_s=0.0)

    def sizes() -> dict[str, int]:
        return {k: len(v) for k, v in vars(predictor).items() if isinstance(v, Sized)}

    predictor.observe_many(np.arange(0.0, 600.0, 0.1).tolist())
    early = sizes()
    predictor.observe_many(np.arange(600.0, 36_000.0, 0.05).tolist())  # 10 h, 700k arrivals
    predictor.observe(10_000_000.0)  # a gap of ~160,000 periods is O(peak_window) too
    late = sizes()
    assert late == early
    assert all(size <= config.peak_window for size in late.values())
    gap = predictor.forecast(10_000_000.0)  # every period of the gap was counted, as 0 QPM
    assert gap.ewma_qpm == pytest.approx(0.0) and gap.peak_qpm == 0.0


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"alpha": 0.0}, "0.0"),
        ({"alpha": 1.5}, "1.5"),
        ({"alpha": math.nan}, "nan"),
        ({"peak_window": 0}, "0"),
        ({"peak_window": 2.5}, "2.5"),
        ({"peak_fraction": -0.1}, "-0.1"),
        ({"peak_fraction": 1.25}, "1.25"),
    ],
)
def test_config_validation_quotes_the_value(kwargs: dict[str, float], quoted: str) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name) as info:
        LoadPredictorConfig(**kwargs)  # type: ignore[arg-type]
    assert quoted in str(info.value)


@pytest.mark.parametrize(("period_s", "quoted"), [(0.0, "0.0"), (-5.0, "-5.0"), (math.inf, "inf")])
def test_a_bad_period_is_refused_naming_period_s(period_s: float, quoted: str) -> None:
    """The counting period is the allocator's planning period, one field of ControlConfig;
    a predictor given one directly checks it too."""
    for make in (ControlConfig, LoadPredictor):
        with pytest.raises(ValueError, match="period_s") as info:
            make(period_s=period_s)
        assert quoted in str(info.value)


def test_bad_times_are_rejected() -> None:
    predictor = LoadPredictor()
    with pytest.raises(ValueError, match="nan"):
        predictor.observe(math.nan)
    with pytest.raises(ValueError, match="inf"):
        predictor.forecast(math.inf)


# -- forecast_errors ---------------------------------------------------------------------------


def test_forecast_errors_on_poisson_stream_is_small() -> None:
    rng = np.random.default_rng(7)
    rate_per_s = 10.0  # 600 QPM: Poisson noise per one-minute period is about 4 %
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=36_000)).tolist()
    errors = forecast_errors(arrivals, LoadPredictorConfig())
    assert errors.periods == math.floor(arrivals[-1] / 60.0) - 1
    assert errors.mape_pct < 10.0
    assert errors.mean_actual_qpm == pytest.approx(600.0, rel=0.02)
    assert 0.0 <= errors.under_fraction <= 1.0
    assert errors.under_fraction + errors.over_fraction <= 1.0
    assert errors.mean_shortfall_qpm == pytest.approx(errors.under_fraction * errors.mean_under_qpm)
    # The peak term over-forecasts a stationary stream more often than it under-forecasts.
    assert errors.over_fraction > errors.under_fraction


def test_forecast_errors_exact_on_a_step() -> None:
    arrivals = [1.0 * k for k in range(180)] + [180.0 + 0.5 * k for k in range(360)]
    config = LoadPredictorConfig(alpha=1.0, peak_window=1, peak_fraction=0.0)  # last period
    errors = forecast_errors(arrivals, config)
    # 60 QPM for three minutes, then 120 QPM; the last arrival (359.5 s) ends inside period 5,
    # so periods 0..4 are complete and 1..4 scored: only period 3, the first at 120 QPM, is
    # missed, by 60 QPM.
    assert errors.periods == 4
    assert errors.under_fraction == pytest.approx(0.25)
    assert errors.mean_under_qpm == pytest.approx(60.0)
    assert errors.mae_qpm == pytest.approx(15.0)
    assert errors.mape_pct == pytest.approx(12.5)
    assert errors.over_fraction == 0.0


def test_forecast_errors_needs_two_periods() -> None:
    with pytest.raises(ValueError, match="2 complete periods"):
        forecast_errors([0.0, 10.0, 70.0], LoadPredictorConfig())


# -- AffinityHistogram -------------------------------------------------------------------------


def test_histogram_is_uniform_without_observations() -> None:
    hist = AffinityHistogram({Strategy.AC: 4, Strategy.SM: 5})
    assert hist.histogram(Strategy.AC) == (0.25, 0.25, 0.25, 0.25)
    assert hist.histogram(Strategy.SM) == pytest.approx((0.2,) * 5)
    assert hist.count(Strategy.AC) == 0


def test_a_prior_fills_the_histogram_until_enough_prompts_are_observed() -> None:
    hist = AffinityHistogram({Strategy.AC: 3})
    prior = (6.0, 3.0, 1.0)  # normalised: 0.6, 0.3, 0.1
    assert hist.histogram(Strategy.AC, prior, 10) == pytest.approx((0.6, 0.3, 0.1))
    for _ in range(5):
        hist.observe(Strategy.AC, 2)
    # five observed, five of the prior's shape
    assert hist.histogram(Strategy.AC, prior, 10) == pytest.approx((0.3, 0.15, 0.55))
    assert hist.histogram(Strategy.AC) == (0.0, 0.0, 1.0)  # no prior: what was observed
    for _ in range(5):
        hist.observe(Strategy.AC, 2)
    assert hist.histogram(Strategy.AC, prior, 10) == (0.0, 0.0, 1.0)  # enough: no weight
    with pytest.raises(ValueError, match="prior: expected 3 shares"):
        hist.histogram(Strategy.AC, (1.0, 1.0), 20)


def test_histogram_window_evicts_the_oldest() -> None:
    hist = AffinityHistogram({Strategy.AC: 3, Strategy.SM: 2}, window=5)
    for level in (0, 0, 0, 1, 1):
        hist.observe(Strategy.AC, level)
    assert hist.histogram(Strategy.AC) == pytest.approx((0.6, 0.4, 0.0))
    for level in (2, 2):  # window + 2 observations: the first two 0s are gone
        hist.observe(Strategy.AC, level)
    assert hist.count(Strategy.AC) == 5
    assert hist.histogram(Strategy.AC) == pytest.approx((0.2, 0.4, 0.4))
    assert sum(hist.histogram(Strategy.AC)) == pytest.approx(1.0)
    assert hist.count(Strategy.SM) == 0  # strategies are independent
    assert hist.histogram(Strategy.SM) == (0.5, 0.5)


def test_histogram_matches_last_window_on_a_long_stream() -> None:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 6, size=5000).tolist()
    hist = AffinityHistogram({Strategy.SM: 6}, window=1000)
    for label in labels:
        hist.observe(Strategy.SM, label)
    expected = np.bincount(labels[-1000:], minlength=6) / 1000
    assert hist.histogram(Strategy.SM) == pytest.approx(tuple(expected))


def test_histogram_rejects_bad_levels_and_strategies() -> None:
    hist = AffinityHistogram({Strategy.AC: 3})
    with pytest.raises(ValueError, match="level index 3"):
        hist.observe(Strategy.AC, 3)
    with pytest.raises(ValueError, match="level index -1"):
        hist.observe(Strategy.AC, -1)
    with pytest.raises(ValueError, match="SM"):
        hist.observe(Strategy.SM, 0)
    with pytest.raises(ValueError, match="SM"):
        hist.histogram(Strategy.SM)
    with pytest.raises(ValueError, match="window"):
        AffinityHistogram({Strategy.AC: 3}, window=0)
    with pytest.raises(ValueError, match="0"):
        AffinityHistogram({Strategy.AC: 0})


def test_histogram_l2_error_known_values() -> None:
    labels = [0] * 100 + [1] * 100 + [1] * 100 + [0] * 30  # trailing partial window dropped
    errors = histogram_l2_error(labels, num_levels=2, window=100)
    assert errors.windows == 2
    # pairs: (0→1) l2 = sqrt(2), mse = 1; (1→1) l2 = 0, mse = 0
    assert errors.mean_l2 == pytest.approx(math.sqrt(2) / 2)
    assert errors.mean_mse == pytest.approx(0.5)
    assert errors.p95_l2 == pytest.approx(0.95 * math.sqrt(2))


def test_histogram_l2_error_stationary_stream_is_near_sampling_noise() -> None:
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 6, size=20_000).tolist()
    errors = histogram_l2_error(labels, num_levels=6, window=1000)
    assert errors.windows == 19
    assert errors.mean_l2 < math.sqrt(2 * (1 - 1 / 6) / 1000) * 1.3  # ≈ 0.041
    assert errors.mean_mse < 0.001


def test_histogram_l2_error_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="level index 7 at position 2"):
        histogram_l2_error([0, 1, 7, 0], num_levels=6, window=2)
    with pytest.raises(ValueError, match="2 complete windows"):
        histogram_l2_error([0] * 1500, num_levels=6, window=1000)


# -- traces ------------------------------------------------------------------------------------


def test_load_arrivals_real_trace() -> None:
    arrivals = load_arrivals(default_arrival_trace())
    assert len(arrivals) == 19_366
    assert arrivals[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(arrivals))
    assert 3400.0 < arrivals[-1] < 3600.0  # about one hour
    assert arrivals[1] == pytest.approx(4.314579)  # 18:15:50.9951690 - 18:15:46.6805900


def test_load_arrivals_sorts_and_names_malformed_line(tmp_path: Path) -> None:
    good = tmp_path / "good.csv"
    good.write_text(
        "TIMESTAMP,ContextTokens\n2023-11-16 18:00:02.5,1\n2023-11-16 18:00:00,1\n"
        "2023-11-16 17:59:59.0000001,1\n"
    )
    assert load_arrivals(good) == pytest.approx([0.0, 0.9999999, 3.4999999])
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,1\n2023-11-16 18:0x:00,1\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3: malformed TIMESTAMP '2023-11-16 18:0x:00'"):
        load_arrivals(bad)
    no_column = tmp_path / "nocol.csv"
    no_column.write_text("time,x\n1,2\n")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        load_arrivals(no_column)


def test_load_prompts_real_file() -> None:
    prompts = load_prompts(default_prompt_trace())
    assert len(prompts) == 1632
    assert prompts[0].prompt == "bond"
    assert prompts[0].category == "Abstract"
    assert prompts[0].challenge == "Basic"
    # Plain TSV: a prompt that starts with a quote keeps it.
    assert any(p.prompt.startswith('"G I G G L E"') for p in prompts)


def test_traces_dir_holds_data_and_licences() -> None:
    for name in (
        "azure_llm_inference_2023_conv.csv",
        "AzurePublicDataset.LICENSE",
        "parti_prompts.tsv",
        "PartiPrompts.LICENSE",
        "README.md",
    ):
        assert (TRACES_DIR / name).is_file(), name


def test_partial_period_counts_once_enough_of_it_has_passed() -> None:
    steady = [i * 1.0 for i in range(180)]  # 60 QPM for three minutes
    burst = [180.0 + i * 0.2 for i in range(100)]  # then 300 QPM for 20 s
    plain = LoadPredictor(LoadPredictorConfig(), start_s=0.0)
    eager = LoadPredictor(LoadPredictorConfig(partial_min_s=15.0), start_s=0.0)
    for predictor in (plain, eager):
        predictor.observe_many(steady + burst)
    assert plain.forecast(200.0).qpm == pytest.approx(60.0, rel=0.05)
    assert eager.forecast(200.0).qpm == pytest.approx(300.0, rel=0.05)
    assert eager.forecast(190.0).qpm == pytest.approx(60.0, rel=0.05)  # only 10 s of it so far
    with pytest.raises(ValueError, match="partial_min_s"):
        LoadPredictorConfig(partial_min_s=-1.0)


def test_open_period_noise_does_not_raise_the_forecast_but_a_surge_does() -> None:
    rng = np.random.default_rng(7)
    steady = np.sort(rng.random(2 * 110) * 120.0).tolist()  # Poisson-ish 110 QPM, 2 min
    config = LoadPredictorConfig(alpha=0.5, peak_fraction=0.0, partial_min_s=10.0)
    raw = LoadPredictor(config, start_s=0.0)
    tested = LoadPredictor(replace(config, partial_z=2.0), start_s=0.0)
    blip = [120.0 + i * 0.4 for i in range(25)]  # 150 QPM for 10 s: within Poisson noise
    for predictor in (raw, tested):
        predictor.observe_many(steady + blip)
    ewma = tested.forecast(130.0).ewma_qpm
    assert raw.forecast(130.0).qpm > 1.3 * ewma  # the raw rate follows the blip
    assert tested.forecast(130.0).qpm == ewma  # two standard deviations absorb it
    surge = [130.0 + i * (1 / 3) for i in range(30)]  # then 180 QPM for 10 s
    tested.observe_many(surge)
    assert tested.forecast(140.0).qpm > 1.3 * ewma
    with pytest.raises(ValueError, match="partial_z"):
        LoadPredictorConfig(partial_z=-1.0)
