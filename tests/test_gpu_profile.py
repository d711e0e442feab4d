"""benchmarks/gpu_profile.py on the tiny variants, on the CPU: the code that runs on a GPU stays
correct without one, and what it writes is a profile the planner reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_profile

from argus.profiles import load_profiles
from argus.types import Strategy
from tests.worker_factories import torch_threads

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One run on the tiny variants. One torch thread: the suite runs two test processes on
    two cores, and with a thread per core each the tiny models' operators wait for each
    other's threads (a run once took 17 minutes for its AC levels). The time budget is
    unbounded: a budget spent skips sections, and the tests check every section ran."""
    out = tmp_path_factory.mktemp("gpu")
    with torch_threads(1):
        data = gpu_profile.main(
            [
                "--tiny",
                "--models", "sdxl,sd-1.5,tiny-sd",
                "--steps", "30",
                "--batches", "1,2",
                "--repeats", "1",
                "--budget-s", "1e9",
                "--out", str(out),
                "--write-profile", str(out / "cpu-measured.toml"),
                "--write-markdown", str(out / "gpu.md"),
            ]
        )  # fmt: skip
    return data, out


def test_every_model_is_measured(measured: tuple[dict, Path]) -> None:
    data, out = measured
    assert json.loads((out / "gpu_profile.json").read_text())["models"].keys() == {
        "sdxl",
        "sd-1.5",
        "tiny-sd",
    }
    for name, entry in data["models"].items():
        assert entry["image"]["latency_s"] > 0, name
        assert entry["load_s"] > 0, name
        for batch in ("1", "2"):
            assert entry["batches"][batch]["unet_step_ms"] > 0, (name, batch)
            assert entry["batches"][batch]["vae_decode_ms"] > 0, (name, batch)
    # the sdxl stand-in's UNet is the largest of the three
    params = {name: entry["params_m"]["unet"] for name, entry in data["models"].items()}
    assert params["sdxl"] > params["sd-1.5"] > params["tiny-sd"]


def test_resuming_at_k_runs_fewer_steps(measured: tuple[dict, Path]) -> None:
    cache = measured[0]["cache"]
    ks = sorted(int(k) for k in cache if k != "fetch")
    assert ks == [0, 5, 10, 15, 20, 25]
    assert cache["25"]["paper_ratio"] == pytest.approx(5 / 30)
    # each level resumed where it should: N - K steps run (their times are too noisy to
    # compare on a CPU that the other test worker loads: 0.85 of K = 0 was seen at K = 25)
    assert [cache[str(k)]["steps_run"] for k in ks] == [30 - k for k in ks]
    assert cache["25"]["latency_s"] > 0
    assert cache["fetch"]["latent_kib"] > 0


def test_the_profile_written_is_one_the_planner_reads(measured: tuple[dict, Path]) -> None:
    data, out = measured
    profiles = load_profiles(out / "cpu-measured.toml")
    assert profiles.worker_classes == ("cpu",)
    assert {lv.name for lv in profiles.levels} == {
        lv.name for lv in gpu_profile.default_profiles().levels
    }
    # AC levels: the line through the resumed runs, fixed + per step x (N - K), + the fetch
    fit = gpu_profile.ac_fit(data["cache"], 30)
    assert fit is not None
    fetch_s = data["cache"]["fetch"]["to_device_ms"] / 1e3
    k25 = profiles.profile("cpu", "ac-k25").latency_s
    assert k25 == pytest.approx(fit[0] + fit[1] * 5 + fetch_s, abs=2e-3)
    # a step's cost is measured, so noise can flatten it, but the line never tilts below zero
    assert fit[1] >= 0
    tiny = profiles.profile("cpu", "sm-tiny-sd").latency_s
    assert tiny == pytest.approx(data["models"]["tiny-sd"]["image"]["latency_s"], abs=2e-3)
    # a model not measured keeps the paper's A100 figure, and says so
    text = (out / "cpu-measured.toml").read_text()
    assert "[paper]" in text
    assert profiles.profile("cpu", "sm-small-sd").latency_s == pytest.approx(2.75)
    # the default's order, which the classifiers' labels follow, and slowest first
    assert [lv.name for lv in profiles.levels_for(Strategy.AC)] == [
        lv.name for lv in gpu_profile.default_profiles().levels_for(Strategy.AC)
    ]
    ac = [profiles.profile("cpu", lv.name).latency_s for lv in profiles.levels_for(Strategy.AC)]
    assert ac == sorted(ac, reverse=True)


def test_markdown_sets_measured_beside_paper(measured: tuple[dict, Path]) -> None:
    text = (measured[1] / "gpu.md").read_text()
    assert "| sdxl | 64 |" in text
    assert "(N-K)/N" in text
    assert "| 25 |" in text


def test_the_ac_fit_recovers_a_line() -> None:
    cache = {str(k): {"latency_s": 0.3 + 0.04 * (50 - k)} for k in (0, 10, 25)}
    fixed, per_step = gpu_profile.ac_fit(cache, 50) or (0.0, 0.0)
    assert fixed == pytest.approx(0.3)
    assert per_step == pytest.approx(0.04)
    assert gpu_profile.ac_fit({"0": {"latency_s": 1.0}}, 50) is None
    # noise that tilts a free line below the origin: the fit keeps every level's time positive
    noisy = {"0": {"latency_s": 1.0}, "20": {"latency_s": 0.3}, "25": {"latency_s": 0.1}}
    fixed, per_step = gpu_profile.ac_fit(noisy, 50) or (1.0, 0.0)
    assert fixed == 0.0
    assert per_step > 0


def test_worker_class_is_named_after_the_gpu() -> None:
    assert gpu_profile.worker_class({"gpu": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert gpu_profile.worker_class({"gpu": "NVIDIA H200"}) == "h200"
    assert gpu_profile.worker_class({"gpu": "NVIDIA A100-SXM4-80GB"}) == "a100"
    assert gpu_profile.worker_class({"gpu": "none (CPU: x86_64)"}) == "cpu"


def test_bad_model_name_is_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_profile.parse_args(["--models", "sdxl,sd-9"])
