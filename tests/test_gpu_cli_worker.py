"""The worker's default path through ``argus worker`` processes and gRPC
(benchmarks/_gpu_cli_worker.py, ``gpu_profile.py --worker-via cli``) on the tiny variants on
the CPU; the summary that opens docs/gpu.md and its reader; the profile built from the CLI
path's timings."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_profile
from _gpu_cli_worker import TIMING, edit_region

from argus.profiles import load_profiles
from tests.worker_factories import torch_threads

STEPS = 6  # ac-k5 is the one AC level with 0 < K < N


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One run of the CLI path through gpu_profile.main: the tiny SDXL and one SM variant,
    one timed request a case, the JSON, the profile and the markdown written."""
    out = tmp_path_factory.mktemp("gpu-cli")
    with torch_threads(1):
        data = gpu_profile.main(
            [
                "--tiny", "--models", "", "--no-load", "--steps", str(STEPS),
                "--worker", "--worker-via", "cli", "--worker-steps", str(STEPS),
                "--worker-repeats", "1", "--worker-sm-models", "sd-1.5", "--budget-s", "1e9",
                "--out", str(out),
                "--write-profile", str(out / "cpu-measured.toml"),
                "--write-markdown", str(out / "gpu.md"),
            ]
        )  # fmt: skip
    return data, out


@pytest.mark.integration
def test_every_case_runs_through_the_cli_worker(cli_run: tuple[dict[str, Any], Path]) -> None:
    data, out = cli_run
    assert data["skipped"] == []  # the CLI path's section ran to its end
    report = json.loads((out / "gpu_profile.json").read_text())["worker_cli"]
    assert report == data["worker_cli"]
    assert report["skipped"] == {}
    cases = report["cases"]
    assert set(cases) == {"plain", "edit-record", "edit-replay", "edit-full", "lora",
                          "controlnet", "plain-short", "hit-k5", "sm-sd-1.5"}  # fmt: skip
    for name, row in cases.items():
        assert row["wall_ms"] > 0 and row["step_ms"] > 0, name
        assert row["timing"]["denoise_ms"] > 0 and row["timing"]["total_ms"] > 0, name
        assert row["wall_ms"] >= row["timing"]["denoise_ms"], name
        assert not row["substituted"], name
    assert cases["plain"]["steps_run"] == STEPS and cases["plain"]["model"] == "sdxl"
    assert cases["plain-short"]["steps_run"] == 2
    assert cases["hit-k5"]["cache"] == "hit" and cases["hit-k5"]["start_step"] == 5
    assert cases["lora"]["adapter_path"] == "plain"
    assert cases["controlnet"]["adapter_path"] == "controlnet"
    assert cases["controlnet"]["timing"]["controlnet_wait_ms"] > 0
    assert cases["sm-sd-1.5"]["model"] == "sd-1.5"
    # the cache recorded the first edit, replayed the second; the other worker has it off
    assert cases["edit-record"]["edit_cache"] == {"miss": 1.0}
    assert cases["edit-replay"]["edit_cache"] == {"hit": 1.0}
    assert cases["edit-full"]["edit_cache"] == {}
    assert "--edit-cache-bytes" in report["workers"]["b"]["argv"]
    # both workers were started by the real CLI, and stopped by their pid (SIGTERM: exit 0)
    for worker in report["workers"].values():
        assert worker["argv"][1:4] == ["-m", "argus", "worker"]
        assert worker["exit"] == 0, (worker["stop_s"], worker["log_tail"])
        assert worker["ready_s"] > 0
    assert report["models"]["sdxl"]["load_s"] > 0


@pytest.mark.integration
def test_the_cli_run_writes_the_profile_and_the_summary(
    cli_run: tuple[dict[str, Any], Path],
) -> None:
    data, out = cli_run
    fixed, per_step = gpu_profile.cli_line(data) or (0.0, 0.0)
    profiles = load_profiles(out / "cpu-measured.toml")
    assert profiles.profile("cpu", "ac-k0").latency_s == pytest.approx(
        fixed + per_step * STEPS, abs=2e-3
    )
    sm = data["worker_cli"]["cases"]["sm-sd-1.5"]["wall_ms"] / 1e3
    assert profiles.profile("cpu", "sm-sd-1.5").latency_s == pytest.approx(sm, abs=2e-3)
    assert "argus worker" in (out / "cpu-measured.toml").read_text()
    text = (out / "gpu.md").read_text()
    assert "| edit-replay | ac-k0 | 64 | hit 1 |" in text
    # no floor in this run: the edit's line has its figure, the step's says it is missing
    got = gpu_profile.read_summary(out / "gpu.md")
    assert got["sdxl_step_x_floor"] is None
    assert text.splitlines()[0] == "default path, SDXL step: not measured"
    assert got["edit_m"] == 0.2 and got["edit_x_full"] is not None and got["edit_x_full"] > 0


def measured(cli: bool = True) -> dict[str, Any]:
    """A hand-made run's JSON: the floor, in-process figures of SDXL and SD-1.5 and (``cli``)
    the CLI path's cases."""
    image = {"latency_s": 9.0, "encode_ms": 1.0, "peak_gib": 1.0}
    data: dict[str, Any] = {
        "env": {"date": "2026-01-01 00:00 UTC", "torch": "2", "diffusers": "0",
                "gpu": "NVIDIA H200", "cuda": "13.0"},
        "settings": {"dtype": "fp16", "steps": 50, "batches": [1], "repeats": 3, "tiny": False},
        "models": {
            "sdxl": {"size": 1024, "params_m": {"unet": 2567.0}, "weights_gib": 6.5,
                     "image": image, "load_s": 2.0,
                     "cuda_graph": {"eager_ms": 60.0, "cuda_graph_ms": 40.0, "speedup": 1.5},
                     "controlnet_graph": {"eager_ms": 90.0, "cuda_graph_ms": 56.0}},
            "sd-1.5": {"size": 512, "params_m": {"unet": 860.0}, "weights_gib": 2.0,
                       "image": {**image, "latency_s": 7.0}, "load_s": 0.6},
        },
        "skipped": [],
    }  # fmt: skip
    if not cli:
        return data

    def row(steps: int, wall_ms: float, step_ms: float, model: str = "sdxl", k: int = 0) -> Any:
        return {"model": model, "level": "", "size": 1024, "cache": "", "start_step": k,
                "steps_run": steps, "adapter_path": "", "substituted": False, "requests": 3,
                "wall_ms": wall_ms, "first_wall_ms": wall_ms, "step_ms": step_ms,
                "fixed_ms": wall_ms - step_ms * steps,
                "timing": dict.fromkeys(TIMING, 1.0) | {"denoise_ms": step_ms * steps}}  # fmt: skip

    data["worker_cli"] = {
        "steps": 30, "sm_steps": 50, "repeats": 3, "edit_ratio": 0.2, "edit_mask_ratio": 0.198,
        "worker_args": [], "commit": "abc", "skipped": {},
        "models": {"sdxl": {"load_s": 3.0, "bytes": 7 * 2**30}},
        "cases": {
            "plain": row(30, 300 + 30 * 48, 48.0),
            "plain-short": row(10, 300 + 10 * 48, 48.0),
            "hit-k20": row(10, 300 + 10 * 48, 48.0, k=20),
            "lora": row(30, 2000, 54.0),
            "controlnet": row(30, 3000, 70.0),
            "edit-replay": row(30, 2500, 60.0),
            "edit-full": row(30, 3200, 90.0),
            "sm-sd-1.5": row(50, 800, 14.0, model="sd-1.5"),
        },
    }  # fmt: skip
    return data


@pytest.mark.unit
def test_summary_lines_read_exactly_and_read_back(tmp_path: Path) -> None:
    data = measured()
    lines = gpu_profile.summary_lines(data)
    assert lines[:4] == [
        "default path, SDXL step: 1.20 x the CUDA-graph floor",
        "SDXL edit at m = 0.2: 1.50 x faster than in full",
        "default path, SDXL step with a rank-64 LoRA: 1.35 x the CUDA-graph floor",
        "default path, SDXL step with one ControlNet: 1.25 x the CUDA-graph floor",
    ]  # 70 ms over the ControlNet step's own floor, 56 ms, not the plain one
    data["edit_share"] = {"s": 0.8, "source": "bench"}
    got = gpu_profile.summary(data)
    assert got["edit_bound"] == pytest.approx(1 / (1 - 0.8 * (1 - 0.198)))
    assert got["edit_of_bound"] == pytest.approx(1.5 / got["edit_bound"])
    assert got["wall_step_ms"] == pytest.approx(48.0)
    text = gpu_profile.markdown(data)
    assert text.splitlines()[:3] == [lines[0], "", lines[1]]  # the file opens with them
    path = tmp_path / "gpu.md"
    path.write_text("# Argus on a real GPU\n\n" + text)
    assert gpu_profile.read_summary(path) == {
        "sdxl_step_x_floor": 1.2,
        "lora_step_x_floor": 1.35,
        "controlnet_step_x_floor": 1.25,
        "edit_m": 0.2,
        "edit_x_full": 1.5,
    }
    del data["models"]["sdxl"]["controlnet_graph"]  # no floor of its own: no line, no guess
    assert not [line for line in gpu_profile.summary_lines(data) if "ControlNet" in line]
    bare = measured(cli=False)
    path.write_text(gpu_profile.markdown(bare))
    assert gpu_profile.summary_lines(bare)[:2] == [
        "default path, SDXL step: not measured",
        "SDXL edit at m = 0.2: not measured",
    ]
    assert set(gpu_profile.read_summary(path).values()) == {None}


@pytest.mark.unit
def test_write_profile_takes_the_cli_timings_when_present(tmp_path: Path) -> None:
    data = measured()
    for name, run in (("cli", data), ("process", measured(cli=False))):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
        gpu_profile.main(["--from-json", str(tmp_path / f"{name}.json"),
                          "--write-profile", str(tmp_path / f"{name}.toml")])  # fmt: skip
    cli = load_profiles(tmp_path / "cli.toml")
    # the line through the SDXL requests: 0.3 s + 48 ms a step, at the profile's N = 50
    assert cli.profile("h200", "ac-k0").latency_s == pytest.approx(0.3 + 0.048 * 50, abs=1e-3)
    assert cli.profile("h200", "ac-k20").latency_s == pytest.approx(0.3 + 0.048 * 30, abs=1e-3)
    assert cli.profile("h200", "sm-sd-xl").latency_s == pytest.approx(2.7, abs=1e-3)
    assert cli.profile("h200", "sm-sd-1.5").latency_s == pytest.approx(0.8, abs=1e-3)
    assert cli.profile("h200", "ac-k0").load_time_s == pytest.approx(3.0, abs=0.01)
    assert cli.profile("h200", "ac-k0").gpu_memory_gib == pytest.approx(7.0, abs=0.01)
    assert cli.profile("h200", "sm-sd-1.5").load_time_s == pytest.approx(0.6, abs=0.01)
    # without the CLI path: the in-process figures, as before
    process = load_profiles(tmp_path / "process.toml")
    assert process.profile("h200", "sm-sd-xl").latency_s == pytest.approx(9.0)
    assert process.profile("h200", "sm-sd-1.5").latency_s == pytest.approx(7.0)
    # an SM variant run at other than N steps: fixed + its step time x N
    other = copy.deepcopy(data)
    other["worker_cli"]["cases"]["sm-sd-1.5"] = {
        **data["worker_cli"]["cases"]["sm-sd-1.5"],
        "steps_run": 30,
        "fixed_ms": 100.0,
    }
    figures = gpu_profile.cli_figures(other)
    assert figures["sm-sd-1.5"]["latency_s"] == pytest.approx((100 + 14 * 50) / 1e3)


@pytest.mark.unit
def test_the_edit_region_covers_its_ratio() -> None:
    for side, ratio in ((1024, 0.2), (64, 0.2), (512, 0.1)):
        top, left, height, width = edit_region(side, ratio)
        assert all(v % 8 == 0 for v in (top, left, height, width))
        assert top + height <= side and left + width <= side
        assert height * width / side**2 == pytest.approx(ratio, abs=0.02 if side > 64 else 0.07)


@pytest.mark.unit
def test_the_floor_only_run_measures_the_controlnet_steps_floor_too(tmp_path: Path) -> None:
    """``--floor-only`` on the tiny SDXL on this CPU: the eager step and the eager step with
    one ControlNet stand in for the floors, and each is named as eager."""
    gpu_profile.main(["--tiny", "--device", "cpu", "--models", "sdxl", "--floor-only",
                      "--no-load", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    data = json.loads((tmp_path / "gpu_profile.json").read_text())
    entry = data["models"]["sdxl"]
    assert (
        entry["controlnet_graph"]["eager_ms"] > 0
        and "cuda_graph_ms" not in entry["controlnet_graph"]
    )
    plain, what = gpu_profile.cuda_graph_floor(data)
    controlnet, controlnet_what = gpu_profile.cuda_graph_floor(data, "controlnet")
    assert controlnet == entry["controlnet_graph"]["eager_ms"] and plain is not None
    assert "eager" in what and "ControlNet" in controlnet_what and "eager" in controlnet_what


@pytest.mark.unit
def test_the_cli_path_reads_each_cases_graph_captures_and_failures() -> None:
    from _gpu_cli_worker import _graph_cell, changed, parse_metrics

    page = "\n".join([
        "# TYPE argus_worker_cuda_graph_captures_total counter",
        'argus_worker_cuda_graph_captures_total{model="sdxl",work="unet"} 1.0',
        'argus_worker_cuda_graph_captures_total{model="sdxl",work="controlnet-step"} 2.0',
        'argus_worker_cuda_graph_captures_total{model="sd-1.5",work="unet"} 1.0',
        'argus_worker_cuda_graph_failures_total{model="sdxl",work="edit-replay"} 1.0',
        'argus_worker_edit_cache_requests_total{outcome="hit"} 3.0',
    ])  # fmt: skip
    after = parse_metrics(page)
    assert after["graphs:unet"] == 2.0 and after["requests:hit"] == 3.0
    before = {"graphs:unet": 2.0}
    row = {
        "graphs": changed(before, after, "graphs:"),
        "graph_failures": changed(before, after, "graph_failures:"),
    }
    assert row["graphs"] == {"controlnet-step": 2.0}
    assert _graph_cell(row) == "controlnet-step 2, edit-replay 0 (1)"
    assert _graph_cell({"graphs": {}, "graph_failures": {}}) == "none"
