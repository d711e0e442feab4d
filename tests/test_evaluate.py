"""argus evaluate: capacity, rescaling a trace to a load, intervals, files and the command."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from argus.cli.main import main
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import SYNTHETIC_MODELS
from argus.prompt_split import PromptSet, prompt_set
from argus.sim.adapters import AdapterModel, draw_adapters, with_adapter_costs
from argus.sim.arrivals import azure_trace, bursty, poisson
from argus.sim.classifiers import OracleClassifier
from argus.sim.evaluate import (
    EvaluationConfig,
    LoadPoint,
    RunRow,
    eval_prompts,
    gpu_counts_of,
    quality_tables,
    run_point,
    seeded_workload,
)
from argus.sim.evaluation_report import PAIRED_COLUMNS, aggregate_columns
from argus.sim.intervals import aggregate, mean_interval, paired, t_quantile_975
from argus.sim.offered_load import (
    EvaluationError,
    cluster_capacity_qpm,
    planning_profiles,
    rescale_to_load,
    target_rates,
    whole_counts,
)
from argus.sim.report import Summary
from argus.sim.workloads import Workload
from argus.types import Strategy

pytestmark = pytest.mark.unit


PROFILES = default_profiles()


# -- capacity ----------------------------------------------------------------------------------


def test_capacity_is_the_fastest_ac_level_on_every_worker():
    k25_a100 = PROFILES.profile("a100", "ac-k25").throughput_qpm
    k25_h100 = PROFILES.profile("h100", "ac-k25").throughput_qpm
    assert k25_a100 == pytest.approx(60.0 / 2.15)
    assert cluster_capacity_qpm(PROFILES, [("a100", 8)]) == pytest.approx(8 * k25_a100)
    mixed = cluster_capacity_qpm(PROFILES, [("a100", 2), ("h100", 3)])
    assert mixed == pytest.approx(2 * k25_a100 + 3 * k25_h100)
    sm = cluster_capacity_qpm(PROFILES, [("a100", 1)], Strategy.SM)
    assert sm == pytest.approx(PROFILES.profile("a100", "sm-tiny-sd").throughput_qpm)


def test_capacity_with_adapters_uses_the_planning_profiles():
    assert planning_profiles(PROFILES, "none") is PROFILES
    planned = planning_profiles(PROFILES, "katz", draws=20_000)
    draws = draw_adapters(20_000, np.random.default_rng(0), AdapterModel("katz").mix)
    expected = with_adapter_costs(PROFILES, AdapterModel("katz"), draws)
    fastest = max(
        expected.profile("a100", lv.name).throughput_qpm for lv in PROFILES.levels_for(Strategy.AC)
    )
    capacity = cluster_capacity_qpm(planned, [("a100", 4)])
    assert capacity == pytest.approx(4 * fastest)
    assert capacity < cluster_capacity_qpm(PROFILES, [("a100", 4)])  # adapters cost time


# -- rescaling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [37.0, 150.0, 412.5])
def test_rescaling_hits_the_mean(target):
    base = poisson(150.0, 20.0, seed=3)
    out = rescale_to_load(base, target, seed=1)
    assert out.mean_qpm() == pytest.approx(target, abs=1.0 / 20.0)
    assert out.duration_s == base.duration_s
    assert np.all(np.diff(out.arrivals_s) >= 0.0) and out.arrivals_s[-1] < base.duration_s
    assert out.prompts == base.prompts


def test_rescaling_hits_mean_and_peak_of_a_bursty_trace():
    base = bursty(30.0, 60.0, 180.0, 10.0, 0.3, seed=2)
    out = rescale_to_load(base, 100.0, 160.0, seed=4)
    rates = out.rate_per_minute()
    assert rates.mean() == pytest.approx(100.0, abs=1.0 / 30.0)
    assert rates.max() == pytest.approx(160.0, abs=1.0)
    # the affine map keeps the trace's shape: busy minutes stay the busy ones
    before = base.rate_per_minute()
    assert np.corrcoef(before, rates)[0, 1] > 0.95


def test_rescaling_thins_to_a_subset_and_fills_with_the_originals_kept():
    base = azure_trace(time_stretch=10.0 / 60.0, rate_scale=1.0 / 6.0, seed=0)  # 10 min
    thinner = rescale_to_load(base, 0.5 * base.mean_qpm(), seed=2)
    assert np.isin(thinner.arrivals_s, base.arrivals_s).all()  # a subset of the arrivals
    assert np.unique(base.arrivals_s).size == len(base)
    assert np.unique(thinner.arrivals_s).size == len(thinner)  # each kept at most once
    denser = rescale_to_load(base, 2.0 * base.mean_qpm(), seed=2)
    assert np.isin(base.arrivals_s, denser.arrivals_s).all()  # every original kept
    assert len(denser) == pytest.approx(2 * len(base), abs=1)


def test_rescaling_is_seeded():
    base = poisson(80.0, 5.0, seed=1)
    a = rescale_to_load(base, 60.0, seed=7).arrivals_s
    assert np.array_equal(a, rescale_to_load(base, 60.0, seed=7).arrivals_s)
    assert not np.array_equal(a, rescale_to_load(base, 60.0, seed=8).arrivals_s)


def test_an_unreachable_peak_names_the_largest_one():
    base = bursty(30.0, 60.0, 180.0, 10.0, 0.3, seed=2)
    with pytest.raises(EvaluationError, match="largest peak this trace allows"):
        rescale_to_load(base, 100.0, 1000.0)
    flat = Workload("flat", np.arange(0.0, 120.0, 1.0), base.prompts, "test", horizon_s=120.0)
    with pytest.raises(EvaluationError, match="no busiest minute"):
        rescale_to_load(flat, 60.0, 90.0)
    assert len(rescale_to_load(flat, 30.0, 30.0)) == 60


def test_target_rates_and_whole_counts():
    rates = np.array([10.0, 20.0, 30.0, 40.0])
    lengths = np.full(4, 60.0)
    np.testing.assert_allclose(target_rates(rates, lengths, 50.0), [20, 40, 60, 80])
    mapped = target_rates(rates, lengths, 50.0, 65.0)
    assert mapped.mean() == pytest.approx(50.0) and mapped.max() == pytest.approx(65.0)
    np.testing.assert_allclose(mapped, [35, 45, 55, 65])
    counts = whole_counts(np.array([0.4, 0.4, 0.4, 1.3, 2.5]))
    assert counts.sum() == 5 and counts.tolist() == [0, 1, 0, 2, 2]
    assert np.all(np.abs(np.cumsum(counts) - np.cumsum([0.4, 0.4, 0.4, 1.3, 2.5])) <= 0.5)


# -- one seed's inputs --------------------------------------------------------------------------


def test_seeds_change_arrivals_prompt_order_and_quality_noise_and_prompts_are_eval_only():
    prompts = eval_prompts(None)
    assert prompts and all(prompt_set(p.prompt) is PromptSet.EVAL for p in prompts)
    config = EvaluationConfig(duration_min=4.0)
    a = seeded_workload(config, LoadPoint(0.5), 100.0, 0, prompts)
    b = seeded_workload(config, LoadPoint(0.5), 100.0, 1, prompts)
    assert set(a.prompts) == set(b.prompts) == set(prompts)
    assert a.prompts != b.prompts  # another order
    assert not np.array_equal(a.arrivals_s, b.arrivals_s)
    assert a.mean_qpm() == pytest.approx(50.0, abs=0.25)
    tables_a, tables_b = (
        quality_tables(PROFILES, a.prompts, 0),
        quality_tables(PROFILES, a.prompts, 1),
    )
    assert "seed 1000" in tables_a[Strategy.AC].source
    assert "seed 1001" in tables_b[Strategy.AC].source
    assert not np.array_equal(tables_a[Strategy.AC].scores, tables_b[Strategy.AC].scores)


def test_a_point_runs_on_the_quality_models_and_the_classifier_given():
    prompts = eval_prompts(None)
    flat = {s: replace(SYNTHETIC_MODELS[s], feature_share=0.0) for s in Strategy}
    given = quality_tables(PROFILES, prompts, 0, flat)
    default = quality_tables(PROFILES, prompts, 0)
    for strategy in Strategy:
        assert "text share 0," in given[strategy].source
        assert "text share 1," in default[strategy].source
        assert not np.array_equal(given[strategy].scores, default[strategy].scores)
    config = EvaluationConfig(
        policies=("argus", "pac"),
        duration_min=2.0,
        adapters="none",
        classifier="/no/such/classifier",  # never read: the classifier given stands in
    )
    capacity = cluster_capacity_qpm(PROFILES, gpu_counts_of(config, PROFILES))
    rows = run_point(
        config, LoadPoint(0.65, 1.0), 0, capacity, classifier=OracleClassifier(), models=flat
    )
    by_policy = {row.policy: row.summary for row in rows}
    assert list(by_policy) == ["argus", "pac", "argus-oracle"]
    assert replace(by_policy["argus-oracle"], policy="argus") == by_policy["argus"]


# -- intervals ---------------------------------------------------------------------------------


def test_t_quantiles_match_scipy():
    for df in [*range(1, 41), 60, 120, 1000]:
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=2e-5)


def test_mean_interval_is_the_t_interval():
    values = [20.1, 19.7, 20.4, 20.0, 19.9]
    interval = mean_interval(values)
    low, high = stats.t.interval(
        0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values)
    )
    assert interval.mean == pytest.approx(np.mean(values))
    assert (interval.lo, interval.hi) == pytest.approx((low, high))
    assert interval.n == 5
    single = mean_interval([3.0, math.nan])  # NaN (no quality in that run) is left out
    assert single.mean == 3.0 and single.n == 1 and math.isnan(single.lo)
    assert mean_interval([]).n == 0 and math.isnan(mean_interval([]).mean)


def summary(policy: str, quality: float, goodput: float, quality_n: int = 100) -> Summary:
    values = {f.name: 0 for f in fields(Summary)}
    values.update(policy=policy, effective_quality=quality, goodput_qpm=goodput)
    values.update(quality_n=quality_n)
    return Summary(**values)


def test_paired_difference_and_the_share_of_the_oracle_gap():
    rows = []
    qualities = {
        "argus": [19.0, 19.4, 19.2],
        "pac": [18.0, 18.5, 18.1],
        "argus-oracle": [19.5, 19.9, 19.6],
    }
    for policy, values in qualities.items():
        for seed, value in enumerate(values):
            rows.append(RunRow(0.9, None, 90.0, seed, policy, summary(policy, value, 80.0), 0.1))
    [comparison] = paired(rows)
    diffs = np.subtract(qualities["argus"], qualities["pac"])
    assert comparison.quality_diff.mean == pytest.approx(diffs.mean())
    low, high = stats.t.interval(0.95, 2, loc=diffs.mean(), scale=stats.sem(diffs))
    assert (comparison.quality_diff.lo, comparison.quality_diff.hi) == pytest.approx((low, high))
    expected = (np.mean(qualities["argus"]) - np.mean(qualities["pac"])) / (
        np.mean(qualities["argus-oracle"]) - np.mean(qualities["pac"])
    )
    assert comparison.gap_closed == pytest.approx(expected)
    assert comparison.goodput_diff.mean == 0.0
    assert comparison.oracle_diff.mean == pytest.approx(1.4666667)
    # no share where the oracle does not beat PAC beyond the noise
    flat = [r for r in rows if r.policy != "argus-oracle"] + [
        RunRow(0.9, None, 90.0, seed, "argus-oracle", summary("argus-oracle", q, 80.0), 0.1)
        for seed, q in enumerate([18.3, 18.2, 18.2])
    ]
    [no_gap] = paired(flat)
    assert no_gap.oracle_diff.lo < 0.0 < no_gap.oracle_diff.mean and math.isnan(no_gap.gap_closed)
    # a run where nothing met the SLO has no quality: left out of the quality mean
    rows.append(RunRow(0.9, None, 90.0, 3, "argus", summary("argus", 0.0, 0.0, 0), 0.1))
    by_policy = {a.policy: a for a in aggregate(rows)}
    assert by_policy["argus"].metrics["effective_quality"].n == 3
    assert by_policy["argus"].metrics["goodput_qpm"].n == 4


def test_bad_settings_are_named():
    with pytest.raises(EvaluationError, match="argus-oracle"):
        EvaluationConfig(policies=("argus", "argus-oracle"))
    with pytest.raises(EvaluationError, match="seeds"):
        EvaluationConfig(seeds=0)
    with pytest.raises(EvaluationError, match="peak must be >= the mean"):
        LoadPoint(1.0, 0.5)
    assert EvaluationConfig(policies=("argus", "pac")).run_names()[-1] == "argus-oracle"
    assert "argus-oracle" not in EvaluationConfig(policies=("argus", "nirvana")).run_names()


# -- the command -------------------------------------------------------------------------------


def evaluate_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["evaluate", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_evaluate_end_to_end(capsys, tmp_path):
    code, out, err = evaluate_cli(
        capsys,
        *("--loads", "0.5,1.3", "--seeds", "2", "--duration", "2", "--gpus", "2"),
        *("--policies", "argus,pac,clipper-ht", "--classifier", "noisy-oracle@0.6"),
        *("--adapters", "none", "--out", str(tmp_path)),
    )
    assert code == 0, err
    runs = read_csv(tmp_path / "runs.csv")
    assert len(runs) == 2 * 4 * 2  # loads x (policies + argus-oracle) x seeds
    summary_keys = [f.name for f in fields(Summary)]
    assert set(summary_keys) | {"load", "peak", "target_qpm", "seed", "wall_s"} == set(runs[0])
    assert {r["policy"] for r in runs} == {"argus", "pac", "clipper-ht", "argus-oracle"}
    capacity = 2 * PROFILES.profile("a100", "ac-k25").throughput_qpm
    for row in runs:
        assert int(row["requests"]) == int(row["admitted"]) + int(row["refused"])
        assert float(row["target_qpm"]) == pytest.approx(float(row["load"]) * capacity, rel=1e-3)
        assert float(row["offered_qpm"]) == pytest.approx(float(row["target_qpm"]), abs=0.5)
    with (tmp_path / "aggregate.csv").open() as handle:
        assert next(csv.reader(handle)) == aggregate_columns()
    aggregated = read_csv(tmp_path / "aggregate.csv")
    assert len(aggregated) == 2 * 4 and all(row["seeds"] == "2" for row in aggregated)
    with (tmp_path / "paired.csv").open() as handle:
        assert tuple(next(csv.reader(handle))) == PAIRED_COLUMNS
    assert len(read_csv(tmp_path / "paired.csv")) == 2
    document = json.loads((tmp_path / "summary.json").read_text())
    assert document["capacity_qpm"] == pytest.approx(capacity)
    assert "SYNTHETIC" in document["quality"] and document["seeds"] == 2
    for name in ("quality_vs_load", "goodput_vs_load", "slo_violations_vs_load"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "argus-oracle" in out and "SYNTHETIC" in out and "gap closed" in out
    assert "16 runs (2 loads × 4 policies × 2 seeds" in out


def test_evaluate_target_load_with_a_peak(capsys, tmp_path):
    code, _, err = evaluate_cli(
        capsys,
        *("--trace", "bursty", "--target-load", "0.8:1.2", "--seeds", "1"),
        *("--duration", "20", "--gpus", "1", "--policies", "clipper-ht"),
        *("--adapters", "none", "--out", str(tmp_path / "out")),
    )
    assert code == 0, err
    [row] = read_csv(tmp_path / "out" / "runs.csv")
    capacity = PROFILES.profile("a100", "ac-k25").throughput_qpm
    assert row["peak"] == "1.2"
    assert float(row["offered_qpm"]) == pytest.approx(0.8 * capacity, abs=0.1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--loads", "0.5,x"], "--loads: 'x' is not a number"),
        (["--loads", "0.5", "--target-load", "1"], "not both"),
        (["--policies", "argus,argus-oracle"], "argus-oracle"),
        (["--policies", "fastest"], "unknown policy 'fastest'"),
        (["--gpus", "v100=2"], "unknown GPU class 'v100'"),
        (["--target-load", "0.5:9", "--trace", "bursty", "--duration", "20"], "largest peak"),
        (["--trace", "nonexistent.csv"], "nonexistent.csv"),
        (["--seeds", "0"], "seeds"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, args, needle):
    code, _, err = evaluate_cli(
        capsys, "--duration", "1", "--classifier", "oracle", "--out", str(tmp_path), *args
    )
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_worker_processes_give_the_same_runs(capsys, tmp_path):
    args = ("--loads", "0.6", "--seeds", "2", "--duration", "2", "--gpus", "2")
    args += ("--policies", "argus,clipper-ha", "--classifier", "oracle", "--adapters", "none")
    for jobs in ("1", "2"):
        code, _, err = evaluate_cli(capsys, *args, "--jobs", jobs, "--out", str(tmp_path / jobs))
        assert code == 0, err
    one, two = read_csv(tmp_path / "1" / "runs.csv"), read_csv(tmp_path / "2" / "runs.csv")
    for row in one + two:
        del row["wall_s"]
    assert one == two and len(one) == 4
