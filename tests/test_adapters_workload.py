"""Adapters on replayed requests: Katz's statistics, seeded sampling, and their latency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from argus.cli.main import main
from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.adapters import (
    CONTROLNET,
    CONTROLNET_NAMES,
    KATZ_SERVICE_A,
    KATZ_SERVICE_B,
    LORA,
    AdapterModel,
    adapter_cost,
    adapter_model_by_name,
    check_mix,
    draw_adapters,
    invocation_shares,
    popularity,
    with_adapter_costs,
    zipf_weights,
)
from argus.sim.arrivals import poisson
from argus.sim.cluster import SimConfig, Simulation
from argus.sim.policies import make_policy
from argus.sim.report import summarise
from argus.types import Strategy
from tests.package_helpers import sample_adapters

pytestmark = pytest.mark.unit


SAMPLE = 100_000


@pytest.fixture(scope="module")
def service_a():
    return check_mix(KATZ_SERVICE_A, SAMPLE, seed=1)


# -- the statistics --------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [KATZ_SERVICE_A, KATZ_SERVICE_B], ids=lambda m: m.name)
def test_counts_per_request_follow_table_1(mix) -> None:
    got = check_mix(mix, SAMPLE, seed=1)
    np.testing.assert_allclose(got.controlnet_counts, mix.controlnet_counts, atol=0.005)
    np.testing.assert_allclose(got.lora_counts, mix.lora_counts, atol=0.005)


def test_top_five_controlnets_take_98_percent(service_a) -> None:
    fit = popularity(KATZ_SERVICE_A).controlnets
    assert fit.shares[:5].sum() == pytest.approx(0.98, abs=1e-6)  # the fit, exactly
    assert service_a.controlnet_top_share == pytest.approx(0.98, abs=0.003)  # a sample of it
    # the tail is there but thin: rank 47 has about 1 invocation in a million
    assert 40 <= service_a.controlnets_used <= 47


def test_service_b_top_eight_take_95_percent() -> None:
    got = check_mix(KATZ_SERVICE_B, SAMPLE, seed=1)
    assert got.controlnet_top_share == pytest.approx(0.95, abs=0.005)


def test_loras_have_a_long_tail_of_thousands(service_a) -> None:
    shares = popularity(KATZ_SERVICE_A).loras.shares
    assert int((shares >= 0.01).sum()) == 12  # §3.2: 6,968 of 6,980 under 1%
    assert 10 <= service_a.loras_popular <= 14  # a finite sample straddles the 1% line
    assert service_a.loras_used > 0.9 * KATZ_SERVICE_A.lora_population
    assert service_a.lora_tail_share > 0.5  # most invocations go to the unpopular ones
    b = popularity(KATZ_SERVICE_B).loras.shares
    assert int((b >= 0.01).sum()) == 14


def test_invocation_shares_account_for_distinct_draws() -> None:
    weights = zipf_weights(10, 3.0)
    one = invocation_shares(weights, (0.0, 1.0))
    np.testing.assert_allclose(one, weights)
    two = invocation_shares(weights, (0.0, 0.0, 1.0))
    assert two[0] <= 0.5 + 1e-12  # in at most every request, i.e. half of two invocations
    assert two.sum() == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    draws = draw_adapters(50_000, rng, KATZ_SERVICE_B)  # up to three ControlNets
    ranks = draws.controlnets[draws.controlnets >= 0]
    sampled = np.bincount(ranks, minlength=94) / ranks.size
    exact = popularity(KATZ_SERVICE_B).controlnets.shares
    np.testing.assert_allclose(sampled[:5], exact[:5], atol=0.01)
    assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in draws.controlnets)


# -- sampling --------------------------------------------------------------------------------


def test_same_seed_same_adapters() -> None:
    first = draw_adapters(1000, np.random.default_rng(5))
    again = draw_adapters(1000, np.random.default_rng(5))
    other = draw_adapters(1000, np.random.default_rng(6))
    assert np.array_equal(first.controlnets, again.controlnets)
    assert np.array_equal(first.loras, again.loras)
    assert not np.array_equal(first.loras, other.loras)
    a = [sample_adapters(np.random.default_rng(9)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_sample_adapters_gives_kind_name_scale() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        adapters = sample_adapters(rng)
        kinds = [kind for kind, _, _ in adapters]
        assert kinds == sorted(kinds)  # ControlNets first
        assert 1 <= kinds.count(CONTROLNET) <= 2 and kinds.count(LORA) <= 2
        names = [name for _, name, _ in adapters]
        assert len(set(names)) == len(names)
        assert all(scale == 1.0 for _, _, scale in adapters)
        assert all(name.startswith("lora-") for kind, name, _ in adapters if kind == LORA)


def test_names_match_the_tiny_controlnet_catalogs() -> None:
    from argus.worker.adapters.controlnet.models import TINY_NAMES

    both = set(TINY_NAMES["sd15"]) & set(TINY_NAMES["sdxl"])
    assert set(CONTROLNET_NAMES[:8]) <= both  # the popular ones run on either family
    assert set(CONTROLNET_NAMES) <= set(TINY_NAMES["sd15"]) | set(TINY_NAMES["sdxl"])
    catalog = TINY_NAMES["sdxl"]
    rng = np.random.default_rng(0)
    seen = {
        name
        for _ in range(500)
        for kind, name, _ in sample_adapters(rng, controlnets=catalog)
        if kind == CONTROLNET
    }
    assert seen <= set(catalog) and "canny" in seen


def test_the_sampler_does_not_import_torch() -> None:
    code = "import sys, argus.sim.adapters, argus.sim.cluster; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- latency ---------------------------------------------------------------------------------


def test_costs_katz_below_sequential_and_ac_exposes_lora_fetch() -> None:
    draws = draw_adapters(2000, np.random.default_rng(0))
    katz = AdapterModel("katz")
    naive = AdapterModel("sequential")
    k0 = adapter_cost(katz, draws, 4.2, 0).seconds()
    k25 = adapter_cost(katz, draws, 2.15, 25)
    assert np.all(adapter_cost(naive, draws, 4.2, 0).seconds() > k0)
    assert np.all(k0 > 0)  # every request has a ControlNet
    # resuming at K = 25 leaves no steps before BAL's bound: the LoRA fetch is exposed ...
    some = draws.lora_count > 0
    assert np.all(k25.seconds()[some] >= katz.costs.lora_fetch_s)
    # ... while at K = 0 the first 10 steps (0.84 s of 4.2 s) hide it
    assert np.all(adapter_cost(katz, draws, 4.2, 0).hideable_s == 0)
    # ... unless the request waited in the queue long enough
    np.testing.assert_allclose(k25.seconds(wait_s=5.0), k25.fixed_s)


def test_policies_plan_with_adapter_inclusive_profiles() -> None:
    profiles = default_profiles()
    model = AdapterModel("katz")
    draws = draw_adapters(5000, np.random.default_rng(0))
    planned = with_adapter_costs(profiles, model, draws)
    for level in profiles.levels:
        base = profiles.profile("a100", level.name)
        plan = planned.profile("a100", level.name)
        added = adapter_cost(model, draws, base.latency_s, level.skip_steps).seconds().mean()
        assert plan.latency_s == pytest.approx(base.latency_s + added)
        assert plan.throughput_qpm * plan.latency_s == pytest.approx(60.0)
    k0, k10 = planned.profile("a100", "ac-k0"), planned.profile("a100", "ac-k10")
    assert k10.latency_s < k0.latency_s  # skipping still pays, less than without LoRAs


def _simulate(adapters, *, qpm: float = 40.0):
    workload = poisson(mean_qpm=qpm, duration_min=4, seed=1)
    profiles = default_profiles()
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [lv.name for lv in profiles.levels_for(s)])
        for s in Strategy
    }
    # admission off: this measures what adapters add to latency, not what admission refuses
    config = SimConfig(gpus=8, adapters=adapters, admission=False)
    result = Simulation(profiles, quality, workload, config).run(make_policy("clipper-ha"))
    return result, (result.finish_s - result.arrivals_s).mean()


def test_replay_with_adapters_is_slower_and_katz_beats_sequential() -> None:
    plain, plain_latency = _simulate(None)
    katz, katz_latency = _simulate(AdapterModel("katz"))
    naive, naive_latency = _simulate(AdapterModel("sequential"))
    assert plain.adapter_s == 0.0 and summarise(plain).adapter_s_mean == 0.0
    assert plain_latency < katz_latency < naive_latency
    assert 0.0 < summarise(katz).adapter_s_mean < summarise(naive).adapter_s_mean
    # Katz Eq. 2 keeps adapters a modest share of SDXL's 4.2 s; Eq. 1 more than doubles it
    assert summarise(katz).adapter_s_mean < 0.25 * 4.2 < 2.0 * 4.2 < naive_latency


def test_replay_cli_names_the_adapter_model(capsys, tmp_path: Path) -> None:
    base = ["replay", "--quiet", "--trace", "poisson", "--duration", "2", "--policies", "argus"]
    base += ["--classifier", "oracle"]
    assert main([*base, "--out", str(tmp_path / "katz")]) == 0  # katz is the default
    out, _ = capsys.readouterr()
    assert "adapters: katz" in out
    summary = json.loads((tmp_path / "katz" / "summary.json").read_text())
    assert summary["description"]["adapters"].startswith("katz: Katz katz-a mix")
    assert summary["policies"]["argus"]["adapter_s_mean"] > 0
    assert main([*base, "--adapters", "none", "--out", str(tmp_path / "none")]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "none" / "summary.json").read_text())
    assert summary["description"]["adapters"] == "none"
    assert summary["policies"]["argus"]["adapter_s_mean"] == 0
    assert main([*base, "--adapters", "lots", "--out", str(tmp_path / "bad")]) == 2
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "--adapters" in err


def test_unknown_adapter_model_is_refused() -> None:
    assert adapter_model_by_name("none") is None
    with pytest.raises(ValueError, match="'nope'"):
        adapter_model_by_name("nope")
    with pytest.raises(ValueError, match="workflow"):
        AdapterModel("parallel")
