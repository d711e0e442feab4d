"""Workload generators, the Azure trace, the trace file format and its validation."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from argus.sim.arrivals import azure_trace, bursty, gamma_arrivals, poisson, ramp, rescale
from argus.sim.named_workloads import KNOWN_WORKLOADS, workload_by_name
from argus.sim.trace_files import load_workload, save_workload
from argus.sim.workloads import AZURE_ATTRIBUTION, Workload, WorkloadError, load_prompt_file
from argus.traces import (
    PromptRecord,
    default_arrival_trace,
    default_prompt_trace,
    load_arrivals,
    load_prompts,
)

pytestmark = pytest.mark.unit


AZURE_ARRIVALS = 19_366


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ generators


def test_poisson_mean_rate_and_gaps() -> None:
    w = poisson(300.0, 100.0, seed=1)
    expected = 300.0 * 100.0
    assert abs(len(w) - expected) < 5 * np.sqrt(expected)  # about 0.6 %
    assert w.duration_s == pytest.approx(6000.0)
    assert w.mean_qpm() == pytest.approx(300.0, rel=0.03)
    gaps = np.diff(w.arrivals_s)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential gaps
    assert w.arrivals_s[0] >= 0.0
    assert w.arrivals_s[-1] < 6000.0
    assert np.all(np.diff(w.arrivals_s) >= 0.0)
    assert w.source.startswith("synthetic")


def test_rate_per_minute_counts_each_minute() -> None:
    w = poisson(120.0, 30.0, seed=2)
    rates = w.rate_per_minute()
    assert rates.shape == (30,)
    assert rates.sum() == len(w)
    assert rates.mean() == pytest.approx(120.0, rel=0.05)


def test_ramp_rates_at_start_and_end() -> None:
    w = ramp(seed=3)  # 50 -> 600 QPM over 800 minutes
    rates = w.rate_per_minute()
    assert rates.shape == (800,)
    slope, intercept = np.polyfit(np.arange(800) + 0.5, rates, 1)
    assert intercept == pytest.approx(50.0, abs=5.0)
    assert intercept + slope * 800 == pytest.approx(600.0, abs=5.0)
    assert rates[:20].mean() == pytest.approx(50.0 + 0.6875 * 10, rel=0.1)
    assert rates[-20:].mean() == pytest.approx(600.0 - 0.6875 * 10, rel=0.05)
    assert len(w) == pytest.approx(325.0 * 800, rel=0.01)


def test_decreasing_and_flat_ramps() -> None:
    down = ramp(600.0, 0.0, 60.0, seed=4).rate_per_minute()
    assert down[:10].mean() > 500 > 100 > down[-10:].mean()
    flat = ramp(200.0, 200.0, 60.0, seed=4)
    assert flat.mean_qpm() == pytest.approx(200.0, rel=0.05)


def test_bursty_has_both_rates() -> None:
    w = bursty(200.0, 100.0, 400.0, 10.0, 0.3, seed=5)
    rates = w.rate_per_minute()
    minute_in_period = np.arange(rates.size) % 10
    high = minute_in_period >= 7
    assert rates[~high].mean() == pytest.approx(100.0, rel=0.05)
    assert rates[high].mean() == pytest.approx(400.0, rel=0.05)
    assert w.mean_qpm() == pytest.approx(0.7 * 100 + 0.3 * 400, rel=0.05)


def test_bursty_with_silent_low_phase_and_partial_period() -> None:
    w = bursty(25.0, 0.0, 300.0, 10.0, 0.5, seed=6)
    phase = (w.arrivals_s / 60.0) % 10.0
    assert np.all(phase >= 5.0 - 1e-9)  # nothing in the silent halves
    assert w.arrivals_s[-1] < 25 * 60
    assert len(w) == pytest.approx(300.0 * 10.0, rel=0.1)  # two full bursts, no third one


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_mean_and_cv(cv: float) -> None:
    w = gamma_arrivals(600.0, cv, 400.0, seed=7)
    gaps = np.diff(w.arrivals_s)
    assert gaps.size > 200_000
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_generators_are_deterministic_by_seed() -> None:
    makers: list[Callable[[int], Workload]] = [
        lambda s: poisson(100.0, 30.0, seed=s),
        lambda s: ramp(10.0, 100.0, 30.0, seed=s),
        lambda s: bursty(30.0, 50.0, 200.0, 5.0, 0.4, seed=s),
        lambda s: gamma_arrivals(100.0, 2.0, 30.0, seed=s),
        lambda s: azure_trace(rate_scale=0.5, seed=s),
        lambda s: azure_trace(rate_scale=1.7, seed=s),
    ]
    for make in makers:
        a, b, c = make(0), make(0), make(1)
        np.testing.assert_array_equal(a.arrivals_s, b.arrivals_s)
        assert len(a) != len(c) or not np.array_equal(a.arrivals_s, c.arrivals_s)
    g1, g2 = np.random.default_rng(9), np.random.default_rng(9)
    np.testing.assert_array_equal(
        poisson(100.0, 10.0, seed=g1).arrivals_s, poisson(100.0, 10.0, seed=g2).arrivals_s
    )


def test_arrivals_are_read_only() -> None:
    w = poisson(60.0, 5.0, seed=0)
    with pytest.raises(ValueError):
        w.arrivals_s[0] = 1.0


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: poisson(-5.0, 10.0), "mean_qpm must be positive, got -5.0"),
        (lambda: poisson(0, 10.0), "mean_qpm must be positive, got 0"),
        (lambda: poisson(10.0, float("nan")), "duration_min must be a finite number"),
        (lambda: poisson("10", 10.0), "mean_qpm must be a number, got '10'"),  # type: ignore[arg-type]
        (lambda: poisson(10.0, 10.0, seed=-1), "seed must be a non-negative integer"),
        (lambda: gamma_arrivals(100.0, 0.0, 10.0), "cv must be positive, got 0.0"),
        (lambda: gamma_arrivals(100.0, -1.5, 10.0), "cv must be positive, got -1.5"),
        (lambda: ramp(-1.0, 100.0, 10.0), "start_qpm must be zero or positive, got -1.0"),
        (lambda: ramp(0.0, 0.0, 10.0), "both 0"),
        (lambda: bursty(60.0, 100.0, 400.0, 10.0, 1.0), "high_fraction must be between 0 and 1"),
        (lambda: bursty(60.0, 500.0, 400.0, 10.0, 0.3), "high_qpm 400 is below low_qpm 500"),
        (lambda: bursty(60.0, 100.0, 400.0, 0.0, 0.3), "period_min must be positive, got 0.0"),
        (lambda: poisson(1e9, 1e3), "the limit is"),
        (lambda: azure_trace(rate_scale=0.0), "rate_scale must be positive, got 0.0"),
        (lambda: azure_trace(time_stretch=-2.0), "time_stretch must be positive, got -2.0"),
        (lambda: azure_trace(rate_scale=2.0, target_mean_qpm=100.0), "not both"),
    ],
)
def test_generators_validate_arguments(make: Callable[[], object], words: str) -> None:
    with pytest.raises(WorkloadError) as info:
        make()
    assert words in str(info.value)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------- prompts


def test_prompts_cycle_through_partiprompts_in_a_fixed_shuffled_order() -> None:
    parti = load_prompts(default_prompt_trace())
    w = poisson(600.0, 10.0, seed=0)
    assert len(w) > 2 * len(parti)
    assert sorted(w.prompts, key=repr) == sorted(parti, key=repr)
    assert w.prompts == poisson(60.0, 10.0, seed=5).prompts  # the same order every time
    first = {p.category for p in w.prompts[:100]}
    assert len(first) >= 5  # not the file's category blocks
    for i in (0, 1, len(parti) - 1, len(parti), len(parti) + 7, len(w) - 1):
        assert w.prompt(i) == w.prompts[i % len(parti)]


def test_custom_prompt_file_with_only_a_prompt_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.tsv", "Prompt\tExtra\na cat\tx\n\na dog\ty\n")
    records = load_prompt_file(path)
    assert [r.prompt for r in records] == ["a cat", "a dog"]
    w = workload_by_name("poisson", duration_min=1.0, prompts_path=path)
    assert w.prompt(3) == PromptRecord("a dog", "", "")


def test_bad_prompt_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        workload_by_name("poisson", prompts_path=tmp_path / "missing.tsv")
    with pytest.raises(WorkloadError, match="has no prompts"):
        load_prompt_file(_write(tmp_path / "empty.tsv", ""))
    with pytest.raises(WorkloadError, match="has no prompts"):
        load_prompt_file(_write(tmp_path / "header.tsv", "Prompt\tCategory\tChallenge\n"))
    with pytest.raises(WorkloadError, match="has no prompts"):
        load_prompt_file(_write(tmp_path / "header2.tsv", "Prompt\n\n"))
    with pytest.raises(WorkloadError, match="no Prompt column"):
        load_prompt_file(_write(tmp_path / "nocol.tsv", "Text\nhello\n"))
    with pytest.raises(WorkloadError, match="line 3: empty prompt"):
        load_prompt_file(_write(tmp_path / "blank.tsv", "Prompt\tNote\nok\t\n\tnote\n"))
    with pytest.raises(WorkloadError, match="empty"):
        poisson(10.0, 1.0, prompts=[])


# -------------------------------------------------------------------------------------------- azure


def test_azure_trace_at_scale_one_is_the_recording() -> None:
    w = azure_trace()
    assert len(w) == AZURE_ARRIVALS
    assert w.source.startswith(AZURE_ATTRIBUTION)
    np.testing.assert_array_equal(w.arrivals_s, load_arrivals(default_arrival_trace()))
    rates = w.rate_per_minute()
    assert rates.sum() == AZURE_ARRIVALS
    assert rates.max() == 507  # the busiest minute of the recording


def test_azure_trace_rescaled() -> None:
    base = azure_trace()
    half = azure_trace(rate_scale=0.5, seed=1)
    assert abs(len(half) - AZURE_ARRIVALS / 2) < 400  # binomial: sd about 70
    assert set(half.arrivals_s.tolist()) <= set(base.arrivals_s.tolist())  # thinned
    double = azure_trace(rate_scale=2.0, seed=1)
    assert len(double) == 2 * AZURE_ARRIVALS
    assert double.duration_s == pytest.approx(base.duration_s)
    # the shape is kept minute by minute
    ratio = double.rate_per_minute()[:-1] / base.rate_per_minute()[:-1]
    assert ratio == pytest.approx(np.full(ratio.size, 2.0), abs=0.35)
    stretched = azure_trace(time_stretch=2.0)
    assert len(stretched) == AZURE_ARRIVALS
    assert stretched.duration_s == pytest.approx(2.0 * base.duration_s)
    assert "rate ×2" in double.source and "time ×2" in stretched.source


def test_azure_target_mean() -> None:
    w = azure_trace(target_mean_qpm=120.0, time_stretch=3.0, seed=2)
    assert w.mean_qpm() == pytest.approx(120.0, rel=0.02)
    assert w.duration_s == pytest.approx(3.0 * azure_trace().duration_s)


def test_rescale_keeps_prompts_and_horizon() -> None:
    w = poisson(100.0, 10.0, seed=0)
    scaled = rescale(w, rate_scale=2.5, time_stretch=0.5, seed=3)
    assert scaled.prompts == w.prompts
    assert scaled.horizon_s == pytest.approx(300.0)
    assert len(scaled) == pytest.approx(2.5 * len(w), rel=0.05)
    assert np.all(np.diff(scaled.arrivals_s) >= 0.0)


def test_load_workload_reads_the_azure_csv() -> None:
    w = load_workload(default_arrival_trace())
    assert len(w) == AZURE_ARRIVALS
    assert AZURE_ATTRIBUTION in w.source
    np.testing.assert_array_equal(w.arrivals_s, azure_trace().arrivals_s)


def test_lowercase_and_iso_timestamps_are_sorted(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.csv",
        "timestamp,prompt\n"
        "2024-01-01T00:00:10.5,b\n"
        "2024-01-01 00:00:00,a\n"
        "2024-01-01T00:01:00+00:00,c\n",
    )
    w = load_workload(path)
    np.testing.assert_allclose(w.arrivals_s, [0.0, 10.5, 60.0])
    assert [w.prompt(i).prompt for i in range(3)] == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["timestamp", "Timestamp", "TIME", "time"])
def test_numeric_clock_columns_are_seconds_from_the_first_arrival(
    tmp_path: Path, name: str
) -> None:
    path = _write(
        tmp_path / "t.csv",
        f"{name},prompt\n1700000010.25,b\n1700000000,a\n1700000060,c\n",
    )
    w = load_workload(path)
    np.testing.assert_allclose(w.arrivals_s, [0.0, 10.25, 60.0])
    assert [w.prompt(i).prompt for i in range(3)] == ["a", "b", "c"]


def test_datetimes_in_a_time_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.csv", "time\n2024-01-01 00:00:30\n2024-01-01 00:00:00\n")
    np.testing.assert_allclose(load_workload(path).arrivals_s, [0.0, 30.0])


def test_arrival_s_wins_over_timestamp_and_timestamp_over_time(tmp_path: Path) -> None:
    both = _write(tmp_path / "both.csv", "time,TIMESTAMP,arrival_s\n5,100,3\n9,130,4\n")
    np.testing.assert_allclose(load_workload(both).arrivals_s, [3.0, 4.0])  # not shifted
    two = _write(tmp_path / "two.csv", "time,TIMESTAMP\n5,100\n9,130\n")
    np.testing.assert_allclose(load_workload(two).arrivals_s, [0.0, 30.0])


# ---------------------------------------------------------------------------------- trace files


def test_save_load_round_trip(tmp_path: Path) -> None:
    w = bursty(20.0, 30.0, 90.0, 5.0, 0.4, seed=8)
    path = tmp_path / "bursty.csv"
    save_workload(w, path)
    back = load_workload(path)
    np.testing.assert_array_equal(back.arrivals_s, w.arrivals_s)
    assert back.name == w.name and back.source == w.source
    assert back.horizon_s == w.horizon_s == 1200.0
    assert all(back.prompt(i) == w.prompt(i) for i in range(len(w)))
    # without prompts the file gives PartiPrompts back
    save_workload(w, path, with_prompts=False)
    assert path.read_text().splitlines()[3] == "arrival_s"
    bare = load_workload(path)
    np.testing.assert_array_equal(bare.arrivals_s, w.arrivals_s)
    assert bare.prompts == w.prompts


def test_minimal_file_and_prompt_override(tmp_path: Path) -> None:
    path = _write(tmp_path / "mine.csv", "Arrival_s,prompt,category\n0.5,a fox,Animals\n2,a owl,\n")
    w = load_workload(path)
    assert w.name == "mine" and w.source == f"trace file {path}"
    assert w.duration_s == 2.0 and w.horizon_s is None
    assert w.prompt(0) == PromptRecord("a fox", "Animals", "")
    override = load_workload(path, prompts=[PromptRecord("x", "y", "z")])
    assert override.prompt(1).prompt == "x"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("arrival_s\n0\n15.0\n12.0\n", "line 4: arrival_s 12.0 is before the previous 15.0"),
        ("# name: x\narrival_s\n-1.5\n", "line 3: arrival_s -1.5 is negative"),
        ("arrival_s\n1\nsoon\n", "line 3: arrival_s 'soon' is not a number"),
        ("arrival_s\n1\ninf\n", "line 3: arrival_s inf is not finite"),
        ("arrival_s\n", "empty trace"),
        ("", "empty trace"),
        (
            "when,prompt\n1,a\n",
            "no arrival time column (looked for arrival_s, timestamp, time, any case); "
            "header is when,prompt",
        ),
        ("TIMESTAMP\n2023-11-16 18:15:46\nyesterday\n", "line 3: malformed TIMESTAMP 'yesterday'"),
        ("Time\n17.5\n2023-11-16 18:15:46\n", "line 3: Time '2023-11-16 18:15:46' is not a number"),
        ("timestamp\n1.0\nnan\n", "line 3: timestamp nan is not finite"),
        ("arrival_s,prompt\n1,a\n2,\n", "line 3: empty prompt"),
        ("# horizon_s: 5\narrival_s\n1\n9\n", "horizon_s 5.0 is before the last arrival 9.0"),
    ],
)
def test_bad_trace_files(tmp_path: Path, text: str, words: str) -> None:
    path = _write(tmp_path / "bad.csv", text)
    with pytest.raises(WorkloadError) as info:
        load_workload(path)
    message = str(info.value)
    assert words in message
    assert str(path) in message
    assert "\n" not in message


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such trace file"):
        load_workload(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError, match="no such trace file"):
        workload_by_name(str(tmp_path / "nope.csv"))
    with pytest.raises(WorkloadError, match="no such trace file"):
        azure_trace(tmp_path / "nope.csv")


def test_workload_validates_arrays() -> None:
    prompts = (PromptRecord("p", "c", "d"),)
    with pytest.raises(
        WorkloadError, match=re.escape("arrival 2 at 1.0 s is before the previous 3.0 s")
    ):
        Workload("w", np.array([0.0, 3.0, 1.0]), prompts, "test")
    with pytest.raises(WorkloadError, match="negative"):
        Workload("w", np.array([-1.0]), prompts, "test")
    with pytest.raises(WorkloadError, match="no prompts"):
        Workload("w", np.array([1.0]), (), "test")
    empty = Workload("w", np.zeros(0), prompts, "test", horizon_s=120.0)
    assert len(empty) == 0 and empty.rate_per_minute().tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------------- named access


def test_workload_by_name_defaults() -> None:
    w = workload_by_name("bursty")
    assert w.duration_s == 3600.0
    rates = w.rate_per_minute()
    assert rates[(np.arange(60) % 10) < 7].mean() == pytest.approx(60.0, rel=0.1)
    assert rates[(np.arange(60) % 10) >= 7].mean() == pytest.approx(180.0, rel=0.1)
    assert workload_by_name("ramp").duration_s == 800 * 60.0
    assert workload_by_name("gamma", duration_min=30.0).mean_qpm() == pytest.approx(150, rel=0.1)
    assert workload_by_name(" Poisson ", scale=2.0).mean_qpm() == pytest.approx(300, rel=0.05)
    assert len(workload_by_name("azure")) == AZURE_ARRIVALS


def test_workload_by_name_stretches_recorded_traces(tmp_path: Path) -> None:
    w = workload_by_name("azure", duration_min=120.0, scale=0.5, seed=1)
    base = azure_trace()
    assert w.duration_s == pytest.approx(7200.0)
    assert w.mean_qpm() == pytest.approx(0.5 * base.mean_qpm(), rel=0.03)
    path = tmp_path / "p.csv"
    save_workload(poisson(60.0, 10.0, seed=0), path)
    from_file = workload_by_name(str(path), scale=2.0)
    assert len(from_file) == pytest.approx(1200, rel=0.1)


def test_workload_by_name_rejects_unknown_names() -> None:
    with pytest.raises(WorkloadError) as info:
        workload_by_name("twitter")
    assert all(name in str(info.value) for name in KNOWN_WORKLOADS)
    with pytest.raises(WorkloadError, match="scale must be positive, got -1"):
        workload_by_name("poisson", scale=-1)
    with pytest.raises(WorkloadError, match="duration_min must be positive, got 0"):
        workload_by_name("ramp", duration_min=0)
