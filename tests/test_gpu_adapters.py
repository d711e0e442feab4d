"""benchmarks/_gpu_adapters.py on the tiny SDXL variant, on the CPU: the adapter costs
gpu_profile.py measures on a GPU come back complete and finite, and the LoRA patch it times
really rewrites the UNet's weights and the unpatch really puts them back."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _gpu_adapters
from _fullsize import build_pipeline

from argus.worker.adapters.lora.patch import merge
from tests.worker_factories import torch_threads

pytestmark = pytest.mark.unit

LORA_KEYS = {
    "lora_rank",
    "lora_mib",
    "lora_modules",
    "lora_params_m",
    "lora_patched_params_m",
    "lora_read_ms",
    "lora_read_warm_ms",
    "lora_h2d_ms",
    "lora_patch_ms",
    "lora_unpatch_ms",
    "lora_patch_from_host_ms",
    "lora_patch_rel_change",
    "lora_repeats",
}
LORA_NONNEGATIVE = {"lora_read_cold"}  # 1.0 where the page cache could be dropped, else 0.0
CONTROLNET_KEYS = {
    "unet_step_ms",
    "controlnet_step_ms",
    "controlnet_added_ms_per_step",
    "unet_image_ms",
    "controlnet_image_ms",
    "controlnet_added_ms_per_image",
    "controlnet_open_ms",
    "controlnet_wait_ms_per_step",
    "controlnet_params_m",
    "controlnet_mib",
    "controlnet_latent_change",
    "controlnet_size_px",
    "controlnet_steps",
    "controlnet_repeats",
}


@pytest.fixture(scope="module")
def pipe() -> Iterator[Any]:
    # one intra-op thread: on a small CPU that other work also loads, torch's threads wait
    # for each other at every operator and step times swing by more than a ControlNet adds
    with torch_threads(1):
        yield build_pipeline("sdxl", device="cpu", dtype=torch.float32, tiny=True)


def unet_state(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.unet.state_dict().items()}


def check_figures(figures: dict[str, float], positive: set[str], nonnegative: set[str]) -> None:
    assert set(figures) == positive | nonnegative
    for key, value in figures.items():
        assert isinstance(value, float), key
        assert math.isfinite(value), key
        assert value > 0 if key in positive else value >= 0, (key, value)


def test_lora_cost_patches_and_restores(
    pipe: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = unet_state(pipe)
    changed: list[int] = []

    def spying_merge(unet: torch.nn.Module, lora: Any, scale: float, backup: Any) -> int:
        modules = merge(unet, lora, scale, backup)
        after = unet.state_dict()
        changed.append(sum(not torch.equal(after[k], v) for k, v in before.items()))
        return modules

    monkeypatch.setattr(_gpu_adapters, "merge", spying_merge)
    figures = _gpu_adapters.lora_cost(
        pipe, device="cpu", dtype=torch.float32, rank=8, repeats=2, workdir=tmp_path
    )
    check_figures(figures, LORA_KEYS, LORA_NONNEGATIVE)
    # every merge (warm-up + 2 repeats, device-resident and from the host copy) rewrote the
    # weight of every module the LoRA names: q, k, v, out of each attention layer
    assert len(changed) == 2 * 3
    assert changed == [int(figures["lora_modules"])] * 6
    assert figures["lora_modules"] > 0 and figures["lora_modules"] % 4 == 0
    assert 0.05 < figures["lora_patch_rel_change"] < 1.0  # the writer aims at 0.3
    assert figures["lora_rank"] == 8.0
    assert (tmp_path / "lora-r8.safetensors").stat().st_size / 2**20 == figures["lora_mib"]
    after = pipe.unet.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "unpatch left changes"


def test_controlnet_cost(pipe: Any) -> None:
    before = unet_state(pipe)
    hooks = sum(len(m._forward_pre_hooks) for m in pipe.unet.modules())
    figures = _gpu_adapters.controlnet_cost(
        pipe, device="cpu", dtype=torch.float32, size=64, steps=6, repeats=3
    )
    check_figures(figures, CONTROLNET_KEYS, set())
    assert figures["controlnet_added_ms_per_step"] == pytest.approx(
        figures["controlnet_step_ms"] - figures["unet_step_ms"]
    )
    assert figures["controlnet_steps"] == 6.0 and figures["controlnet_size_px"] == 64.0
    # the ControlNet is the UNet's encoder half: fewer parameters than the UNet, not none
    unet_m = sum(p.numel() for p in pipe.unet.parameters()) / 1e6
    assert 0.1 * unet_m < figures["controlnet_params_m"] < unet_m
    # the pipeline comes back as it was: same weights, no checkpoint hooks left behind
    after = pipe.unet.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert sum(len(m._forward_pre_hooks) for m in pipe.unet.modules()) == hooks
