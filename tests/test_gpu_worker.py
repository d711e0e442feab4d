"""The worker's own path, timed per stage (benchmarks/_gpu_worker.py), on the CPU: the tiny
variants, and the full-size code path (diffusers directories, a ControlNet catalog on disk)
with the architectures shrunk so that it runs in seconds."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _fullsize
from benchmarks._gpu_worker import STAGES, table, worker_path

pytestmark = pytest.mark.integration

STEPS = 8  # the cache keeps steps 5, 10, …: ac-k5 is the one level with K < N


def check_report(report: dict[str, Any]) -> None:
    kinds = report["kinds"]
    assert {"miss-k5", "miss", "hit-k5", "sm-sd-1.5", "lora", "controlnet"} <= set(kinds)
    assert set(report["skipped"]) == {"hit-k10", "hit-k15", "hit-k20", "hit-k25"}
    cold = kinds["miss-k5"]
    assert cold["cache"] == "miss" and cold["steps_run"] == STEPS and cold["requests"] == 1
    assert cold["stages"]["embed_ms"] > 0 and cold["stages"]["search_ms"] > 0
    miss, hit = kinds["miss"], kinds["hit-k5"]
    assert miss["steps_run"] == STEPS and miss["start_step"] == 0
    assert hit["cache"] == "hit" and hit["start_step"] == 5
    assert hit["steps_run"] == STEPS - 5 < miss["steps_run"]
    assert hit["stages"]["embed_ms"] > 0 and hit["stages"]["search_ms"] > 0
    assert hit["stages"]["fetch_ms"] > 0
    assert kinds["sm-sd-1.5"]["model"] == "sd-1.5" and not kinds["sm-sd-1.5"]["substituted"]
    assert kinds["lora"]["adapter_path"] == "plain"
    assert kinds["controlnet"]["adapter_path"] == "controlnet"
    assert kinds["controlnet"]["stages"]["controlnet_wait_ms"] > 0
    for kind, row in kinds.items():
        stages = row["stages"]
        assert set(stages) == set(STAGES)
        for stage in ("encode_ms", "denoise_ms", "vae_ms", "png_ms", "decode_ms", "total_ms"):
            assert stages[stage] > 0, (kind, stage)
        # medians of each stage: their sum may pass the median decode by a little
        assert stages["vae_ms"] + stages["png_ms"] <= 1.05 * stages["decode_ms"]
        assert row["wall_ms"] >= stages["denoise_ms"]
    assert "| hit-k5 | ac-k5 |" in table(report)


def test_tiny_worker_path(tmp_path: Path) -> None:
    report = worker_path(device="cpu", dtype_name="fp32", tiny=True, workdir=tmp_path, steps=STEPS,
                         repeats=1)  # fmt: skip
    check_report(report)
    assert report["sizes"] == {"sdxl": 64, "sd-1.5": 64}


TINY_UNET: dict[str, Any] = {
    "block_out_channels": (32, 64),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
TOWER = (32, 2, 4, 32, "gelu")


def test_full_size_code_path_with_shrunk_architectures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xl = _fullsize.ARCHS["sdxl"]
    sd = _fullsize.ARCHS["sd-1.5"]
    xl_unet = {**xl.unet, **TINY_UNET, "attention_head_dim": 4, "cross_attention_dim": 64,
               "transformer_layers_per_block": 1, "sample_size": 8,
               "projection_class_embeddings_input_dim": 6 * 256 + 32}  # fmt: skip
    sd_unet = {**TINY_UNET, "attention_head_dim": 4, "cross_attention_dim": 32, "sample_size": 8}
    monkeypatch.setitem(
        _fullsize.ARCHS, "sdxl", dataclasses.replace(xl, unet=xl_unet, text=(TOWER, TOWER), size=64)
    )
    monkeypatch.setitem(
        _fullsize.ARCHS, "sd-1.5", dataclasses.replace(sd, unet=sd_unet, text=(TOWER,), size=64)
    )
    report = worker_path(device="cpu", dtype_name="fp32", tiny=False, workdir=tmp_path,
                         steps=STEPS, repeats=1)  # fmt: skip
    check_report(report)
    assert (tmp_path / "models" / "sdxl" / "model_index.json").is_file()
    assert (tmp_path / "controlnets" / "sdxl" / "canny" / "config.json").is_file()
