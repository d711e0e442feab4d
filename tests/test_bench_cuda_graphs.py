"""``benchmarks/bench_cuda_graphs.py --tiny``: the GPU benchmark's cases run end to end on the
CPU through the graphs' eager stand-in, so the script a GPU session runs does not rot. Its
times mean nothing here; the cases must replay and give the eager latents to the bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_modules import benchmark_module
from tests.worker_factories import torch_threads

pytestmark = pytest.mark.integration


def test_every_case_replays_and_matches_eager(tmp_path: Path) -> None:
    out = tmp_path / "graphs.json"
    with benchmark_module("bench_cuda_graphs") as bench, torch_threads(1):
        cases = ("--cases", "lora,controlnet,batch")
        bench.main(["--tiny", "--steps", "2", "--repeats", "1", *cases, "--json", str(out)])
    rows = {row["case"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"lora", "controlnet", "batch"}
    assert rows["lora"]["replays_per_run"] == 2  # one UNet graph a step
    assert rows["controlnet"]["replays_per_run"] == 2  # ControlNet and UNet: one graph a step
    assert rows["batch"]["replays_per_run"] == 2  # one batched step a step
    for row in rows.values():
        assert row["max_latent_diff"] == 0, row["case"]
        assert row["floor_ms_per_step"] > 0
