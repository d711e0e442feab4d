"""ControlNet parallelism: the UNet split, synchronous runs equal to diffusers' sequential
ControlNet pipelines (in process and through the gRPC service), and the pipelined
asynchronous mode."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from argus.contracts.controlnet import ControlUnit
from argus.worker.adapters.controlnet.client import RemoteControlNetExecutor
from argus.worker.adapters.controlnet.errors import InvalidControlNetRequest
from argus.worker.adapters.controlnet.executor import ControlNetExecutor, LocalControlNetExecutor
from argus.worker.adapters.controlnet.models import ControlNetCatalog, build_controlnet
from argus.worker.adapters.controlnet.predictor import ControlNetMode, ControlNetPredictor
from argus.worker.adapters.controlnet.service import create_server
from argus.worker.adapters.controlnet.unet_split import (
    Residuals,
    SplitUNet,
    UnsupportedUNetError,
    sum_residuals,
)
from argus.worker.models.pipelines import DiffusionModel
from argus.worker.models.sources import make_scheduler
from tests.worker_factories import spec, tiny_model

pytestmark = pytest.mark.integration


STEPS = 4
FAMILY = {"sd-1.5": "sd15", "sdxl": "sdxl"}


def png(seed: int, size: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# scales exactly representable in float32, so proto floats and Python floats agree
UNITS = (ControlUnit("canny", 1.0, png(1)), ControlUnit("depth", 0.5, png(2, size=48)))


@pytest.fixture(scope="module")
def local() -> Iterator[LocalControlNetExecutor]:
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteControlNetExecutor]:
    server, port, _ = create_server(
        LocalControlNetExecutor(ControlNetCatalog.tiny()), "127.0.0.1:0", threads=4
    )
    server.start()
    executor = RemoteControlNetExecutor(f"127.0.0.1:{port}", timeout_s=60)
    executor.wait_ready(30)
    yield executor
    executor.close()
    server.stop(grace=None)


def diffusers_reference(
    model: DiffusionModel, units: Sequence[ControlUnit], seed: int, guidance: float = 0.0
) -> Any:
    """Latents from diffusers' own (sequential) ControlNet pipeline on the same components."""
    from diffusers import StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    family = "sdxl" if model.xl else "sd15"
    nets = [build_controlnet(u.name, base=family) for u in units]
    components = {
        k: v
        for k, v in model.pipeline.components.items()
        if k not in ("image_encoder", "feature_extractor", "safety_checker")
    }
    components["scheduler"] = make_scheduler("euler", model.scheduler_config)
    controlnet = nets[0] if len(nets) == 1 else MultiControlNetModel(nets)
    if model.xl:
        pipe = StableDiffusionXLControlNetPipeline(
            **components, controlnet=controlnet, force_zeros_for_empty_prompt=False
        )
    else:
        pipe = StableDiffusionControlNetPipeline(
            **components,
            controlnet=controlnet,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.set_progress_bar_config(disable=True)
    images = [Image.open(io.BytesIO(u.image)) for u in units]
    return pipe(
        prompt=spec().prompt,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=guidance or model.default_guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        image=images[0] if len(images) == 1 else images,
        controlnet_conditioning_scale=(
            units[0].scale if len(units) == 1 else [u.scale for u in units]
        ),
    ).images


def run(
    model: DiffusionModel,
    executor: ControlNetExecutor,
    units: Sequence[ControlUnit],
    *,
    mode: ControlNetMode = ControlNetMode.SYNC,
    seed: int = 7,
    capture: Sequence[int] = (),
    guidance: float = 0.0,
) -> Any:
    predictor = ControlNetPredictor(model, executor, units, mode=mode)
    request = spec(seed=seed, steps=STEPS, guidance_scale=guidance)
    result = model.denoise(request, capture=capture, predictor=predictor)
    assert predictor.stats.steps == STEPS
    return result


# -- the split -----------------------------------------------------------------------------


def random_residuals(split: SplitUNet, *args: Any) -> Residuals:
    encoded = split.encode(*args)
    generator = torch.Generator().manual_seed(0)
    down = tuple(torch.randn(s.shape, generator=generator) for s in encoded.skips)
    return Residuals(down, torch.randn(encoded.sample.shape, generator=generator))


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
@pytest.mark.parametrize("pixels", [64, 40])  # 40 px: an odd latent side forwards upsample sizes
def test_split_unet_equals_the_diffusers_forward(variant: str, pixels: int) -> None:
    model = tiny_model(variant)
    unet = model.pipeline.unet
    split = SplitUNet(unet)
    cond = model.encode(spec(height=pixels, width=pixels))
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn((2, 4, pixels // 8, pixels // 8), generator=generator)
    t = torch.tensor(801.0)
    args = (sample, t, cond.embeds, cond.added)
    with torch.inference_mode():
        plain = unet(*args[:3], added_cond_kwargs=cond.added, return_dict=False)[0]
        torch.testing.assert_close(split.forward(*args), plain, rtol=0, atol=0)
        residuals = random_residuals(split, *args)
        steered = unet(
            *args[:3],
            added_cond_kwargs=cond.added,
            down_block_additional_residuals=residuals.down,
            mid_block_additional_residual=residuals.mid,
            return_dict=False,
        )[0]
        torch.testing.assert_close(
            split.forward(*args, residuals=residuals), steered, rtol=0, atol=0
        )
    assert not torch.equal(plain, steered)


def test_residuals_that_do_not_fit_the_unet_are_refused() -> None:
    model = tiny_model("sd-1.5")
    split = SplitUNet(model.pipeline.unet)
    cond = model.encode(spec())
    sample = torch.zeros(2, 4, 8, 8)
    with torch.inference_mode():
        encoded = split.encode(sample, torch.tensor(1.0), cond.embeds, cond.added)
        good = random_residuals(split, sample, torch.tensor(1.0), cond.embeds, cond.added)
        with pytest.raises(
            InvalidControlNetRequest, match=r"^controlnets: the ControlNets return 2"
        ):
            split.decode(encoded, Residuals(good.down[:2], good.mid))
        wide = Residuals(good.down, torch.zeros(2, 7, 4, 4))
        with pytest.raises(
            InvalidControlNetRequest, match=r"residual mid has shape \(2, 7, 4, 4\)"
        ):
            split.decode(encoded, wide)


def test_unsupported_unet_features_are_refused() -> None:
    from diffusers import UNet2DConditionModel

    base = tiny_model("sd-1.5").pipeline.unet.config
    # keys such as _use_default_values would make from_config drop the values they list
    config = {**{k: v for k, v in base.items() if not k.startswith("_")}, "time_cond_proj_dim": 8}
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    with pytest.raises(UnsupportedUNetError, match="time_cond_proj_dim"):
        SplitUNet(unet)


def test_residuals_sum_in_request_order() -> None:
    a = Residuals((torch.ones(2),), torch.ones(1))
    b = Residuals((torch.full((2,), 2.0),), torch.full((1,), 3.0))
    total = sum_residuals([a, b])
    assert total.down[0].tolist() == [3.0, 3.0]
    assert total.mid.tolist() == [4.0]
    with pytest.raises(ValueError):
        sum_residuals([])


# -- synchronous == diffusers ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
@pytest.mark.parametrize("count", [1, 2])
def test_sync_equals_sequential_diffusers(
    local: LocalControlNetExecutor, variant: str, count: int
) -> None:
    model = tiny_model(variant)
    units = UNITS[:count]
    ours = run(model, local, units).latents
    reference = diffusers_reference(model, units, seed=7)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    # and the ControlNets did steer the image
    plain = model.denoise(spec(seed=7, steps=STEPS)).latents
    assert (plain - ours).abs().max() > 0.1 * ours.abs().max()


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
@pytest.mark.parametrize("count", [1, 2])
def test_sync_through_the_service_equals_sequential_diffusers(
    remote: RemoteControlNetExecutor, variant: str, count: int
) -> None:
    model = tiny_model(variant)
    units = UNITS[:count]
    ours = run(model, remote, units).latents
    reference = diffusers_reference(model, units, seed=7)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_without_cfg_the_controlnets_see_one_branch(local: LocalControlNetExecutor) -> None:
    model = tiny_model("sd-1.5")
    ours = run(model, local, UNITS[:1], guidance=1.0).latents
    reference = diffusers_reference(model, UNITS[:1], seed=7, guidance=1.0)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_executor_for_a_worker_setting(tmp_path: Any) -> None:
    from argus.worker.adapters.controlnet.client import executor_for
    from tests.package_helpers import export_tiny_catalog

    assert isinstance(executor_for("local"), LocalControlNetExecutor)
    export_tiny_catalog(tmp_path, {"sd15": ["canny"]})
    from_dir = executor_for(f"local:{tmp_path}", max_models=1)
    assert isinstance(from_dir, LocalControlNetExecutor)
    assert from_dir.catalog.names("sd15") == ("canny",)
    remote = executor_for("127.0.0.1:9")
    assert isinstance(remote, RemoteControlNetExecutor)
    remote.close()
    with pytest.raises(ValueError, match="'nowhere'"):
        executor_for("nowhere")


# -- asynchronous ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sd-1.5", "sdxl"])
def test_async_equals_sync_at_the_first_step_then_stays_close(
    local: LocalControlNetExecutor, variant: str
) -> None:
    model = tiny_model(variant)
    sync = run(model, local, UNITS, capture=(1, 2))
    pipelined = run(model, local, UNITS, mode=ControlNetMode.ASYNC, capture=(1, 2))
    # step 0 is synchronous: the latents after it are the same
    torch.testing.assert_close(pipelined.captured[1], sync.captured[1], rtol=0, atol=0)
    # step 1 used step 0's residuals: from here on the runs differ …
    assert not torch.equal(pipelined.captured[2], sync.captured[2])
    assert not torch.equal(pipelined.latents, sync.latents)
    # … but stay close (Katz: adjacent steps' residuals are nearly identical)
    a, b = pipelined.latents.flatten(), sync.latents.flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert (a - b).norm() < 0.1 * b.norm()


def test_async_through_the_service_equals_async_in_process(
    local: LocalControlNetExecutor, remote: RemoteControlNetExecutor
) -> None:
    model = tiny_model("sdxl")
    here = run(model, local, UNITS, mode=ControlNetMode.ASYNC).latents
    there = run(model, remote, UNITS, mode=ControlNetMode.ASYNC).latents
    torch.testing.assert_close(there, here, rtol=0, atol=0)


def test_async_counts_stale_steps_and_skips_the_last_run() -> None:
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    model = tiny_model("sd-1.5")
    predictor = ControlNetPredictor(model, executor, UNITS[:1], mode=ControlNetMode.ASYNC)
    model.denoise(spec(steps=STEPS), predictor=predictor)
    assert predictor.stats.stale_steps == STEPS - 1
    stats = executor.stats()
    # step 0 once, then steps 1 … N−2 for their successors; the last step starts nothing
    assert stats.steps_total == STEPS - 1
    assert (stats.sessions_open, stats.sessions_total) == (0, 1)


def test_a_resumed_run_starts_synchronously_at_step_k(local: LocalControlNetExecutor) -> None:
    model = tiny_model("sd-1.5")
    full = run(model, local, UNITS, capture=(2,))
    predictor = ControlNetPredictor(model, local, UNITS)
    resumed = model.denoise(
        spec(seed=7, steps=STEPS), start_latents=full.captured[2], start_step=2, predictor=predictor
    )
    torch.testing.assert_close(resumed.latents, full.latents, rtol=0, atol=0)
    assert predictor.stats.steps == STEPS - 2


# -- sessions end ----------------------------------------------------------------------------


def test_sessions_close_after_the_run_and_after_a_failure() -> None:
    executor = LocalControlNetExecutor(ControlNetCatalog.tiny())
    run(tiny_model("sd-1.5"), executor, UNITS)
    assert executor.stats().sessions_open == 0
    assert executor.cache.stats().leased == 0
    # tiny sd-2.0 is wider than the SD-1.5 ControlNets: the first step fails, the session ends
    misfit = tiny_model("sd-2.0")
    with pytest.raises(InvalidControlNetRequest, match="another base model"):
        run(misfit, executor, UNITS)
    assert executor.stats().sessions_open == 0
    assert executor.cache.stats().leased == 0
    with pytest.raises(InvalidControlNetRequest, match=r"^controlnets: no ControlNet"):
        ControlNetPredictor(misfit, executor, ())
