"""The worker's denoising loop on tiny real diffusers pipelines: fidelity to diffusers, resume
at step K, capture, determinism, model sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from argus.worker.models.pipelines import DiffusionModel
from argus.worker.models.sources import (
    ModelSourceError,
    build_tiny_pipeline,
    check_pipeline_dir,
    estimate_bytes,
    load_pipeline_dir,
)
from tests.worker_factories import STEPS, spec, tiny_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_full_run_matches_the_diffusers_pipeline(variant: str) -> None:
    model = tiny_model(variant)
    ours = model.denoise(spec(seed=7)).latents
    reference = model.pipeline(
        prompt="a red bus in the snow",
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=model.default_guidance,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.parametrize(("variant", "scheduler"), [("sd-1.5", "euler"), ("sdxl", "ddim")])
def test_resume_at_k_reproduces_the_full_run(variant: str, scheduler: str) -> None:
    model = tiny_model(variant, scheduler)
    full = model.denoise(spec(seed=3), capture=(5, 7))
    assert sorted(full.captured) == [5, 7]
    exact = model.denoise(spec(seed=3), start_latents=full.captured[5], start_step=5)
    assert exact.steps_run == STEPS - 5
    torch.testing.assert_close(exact.latents, full.latents, rtol=0, atol=0)
    # the cache stores fp16: the resumed run stays within fp16 rounding of the original
    stored = full.captured[7].half().float()
    resumed = model.denoise(spec(seed=3), start_latents=stored, start_step=7)
    scale = full.latents.abs().max().item()
    assert (resumed.latents - full.latents).abs().max().item() <= 1e-3 * scale


def test_resume_differs_from_a_fresh_run_of_another_seed() -> None:
    model = tiny_model()
    a = model.denoise(spec(seed=1), capture=(5,))
    b = model.denoise(spec(seed=2))
    resumed = model.denoise(spec(seed=2), start_latents=a.captured[5], start_step=5)
    # resuming from seed 1's latent follows seed 1's trajectory, not seed 2's
    assert (resumed.latents - b.latents).abs().max() > 1e-2
    torch.testing.assert_close(resumed.latents, a.latents, rtol=0, atol=0)


def test_seed_determines_the_image() -> None:
    model = tiny_model()
    a1 = model.denoise(spec(seed=11)).latents
    a2 = model.denoise(spec(seed=11)).latents
    b = model.denoise(spec(seed=12)).latents
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)
    assert not torch.equal(a1, b)


def test_capture_ignores_steps_outside_the_run() -> None:
    model = tiny_model()
    run = model.denoise(spec(), capture=(0, 5, STEPS, 25))
    assert sorted(run.captured) == [5]


def test_bad_resume_arguments_raise() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="start_step"):
        model.denoise(spec(), start_step=STEPS)
    with pytest.raises(ValueError, match="start_latents"):
        model.denoise(spec(), start_step=3)


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_decode_gives_an_image_of_the_requested_size(variant: str) -> None:
    model = tiny_model(variant)
    run = model.denoise(spec(height=32, width=48, steps=2))
    image = model.decode(run.latents)
    assert image.size == (48, 32)
    assert image.mode == "RGB"


def test_tiny_variants_shrink_down_the_profile() -> None:
    sizes = [
        estimate_bytes(f"tiny:{v}", torch.float32)
        for v in ("sdxl", "sd-1.5", "small-sd", "tiny-sd")
    ]
    assert sizes == sorted(sizes, reverse=True)
    assert estimate_bytes("tiny:sd-1.5", torch.float32) == tiny_model().parameter_bytes()
    assert estimate_bytes("tiny:sd-1.5", torch.float16) * 2 == sizes[1]


def test_unknown_tiny_variant_is_refused() -> None:
    with pytest.raises(ModelSourceError, match="unknown tiny variant"):
        estimate_bytes("tiny:sd-9", torch.float32)


def test_a_saved_directory_loads_to_the_same_model(tmp_path: Path) -> None:
    pipeline = build_tiny_pipeline("tiny:small-sd")
    pipeline.save_pretrained(tmp_path, safe_serialization=True)
    assert estimate_bytes(str(tmp_path), torch.float32) == estimate_bytes(
        "tiny:small-sd", torch.float32
    )
    loaded = DiffusionModel(
        "small-sd", load_pipeline_dir(tmp_path, torch.float32), device="cpu", source=str(tmp_path)
    )
    original = DiffusionModel("small-sd", pipeline, device="cpu", source="tiny:small-sd")
    torch.testing.assert_close(
        loaded.denoise(spec(steps=3)).latents, original.denoise(spec(steps=3)).latents
    )


def test_directories_without_safetensors_or_with_pickles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="not a directory"):
        check_pipeline_dir(tmp_path / "absent")
    with pytest.raises(ModelSourceError, match=r"model_index\.json"):
        check_pipeline_dir(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X"}))
    with pytest.raises(ModelSourceError, match=r"no \.safetensors"):
        check_pipeline_dir(tmp_path)
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelSourceError, match=r"pickled weights .*unet/diffusion_pytorch_model"):
        check_pipeline_dir(tmp_path)


def test_adapter_seams_run_in_step_order_and_replace_the_predictor() -> None:
    model = tiny_model("sd-1.5")
    events: list[tuple[str, int]] = []

    def predictor(latents: torch.Tensor, t: torch.Tensor, cond, scheduler, step: int):  # type: ignore[no-untyped-def]
        events.append(("predict", step))
        return model.predict_noise(latents, t, cond, scheduler, step)

    def start(step: int) -> None:
        events.append(("start", step))

    def after(done: int, latents: torch.Tensor) -> None:
        events.append(("after", done))

    run = model.denoise(
        spec(seed=5, steps=3), before_step=[start], hooks=[after], predictor=predictor
    )
    assert events == [
        (kind, step + (kind == "after"))
        for step in range(3)
        for kind in ("start", "predict", "after")
    ]
    # the default predictor through the seam changes nothing
    torch.testing.assert_close(
        run.latents, model.denoise(spec(seed=5, steps=3)).latents, rtol=0, atol=0
    )

    def zero(latents: torch.Tensor, t: torch.Tensor, cond, scheduler, step: int):  # type: ignore[no-untyped-def]
        return torch.zeros_like(latents)

    assert not torch.equal(
        model.denoise(spec(seed=5, steps=3), predictor=zero).latents, run.latents
    )
