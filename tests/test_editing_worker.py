"""Edits on the worker's denoising loop (issue 32, item 2): inpainting and img2img on tiny real
pipelines, on every level's model (the AC base and the SM variants), with the progress,
cancellation and cache behaviour of a generation.

Acceptance: a mask of ratio 1 gives the very image a generation from the same seed gives (the
inpainting path over the whole image adds nothing to it); the pixels outside the mask come
back exactly as sent; img2img at strength 1 equals a generation from noise with the same
seed; an edit never uses the approximate cache, on a level that would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from argus.contracts.generate import CacheOutcome, GenerateCall, Progress, Stage
from argus.embedding import PromptEmbedder
from argus.profiles import default_profiles
from argus.request_limits import EditInput, ImageLimits, InvalidRequestError, check_edit
from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore
from argus.worker.engine import Worker
from argus.worker.models.pipelines import Cancelled, CancelToken, GenerationSpec, paste_unmasked
from tests.editing_factories import (
    SIZE,
    STEPS,
    encode,
    mask_png,
    pixels,
    region_of,
    template_rgb,
    with_alpha,
)
from tests.worker_factories import make_worker, tiny_model

pytestmark = pytest.mark.integration

PROMPT = "a red boat on a lake"
LIMITS = ImageLimits()
LEVELS = default_profiles().levels
# one level per model: the AC base (sdxl) and every SM variant
ONE_LEVEL_PER_MODEL = [
    next(lv.name for lv in LEVELS if lv.model == model)
    for model in dict.fromkeys(lv.model for lv in LEVELS)
]


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    made = make_worker(default_steps=STEPS)
    yield made
    made.close()


def edit(**fields: Any) -> GenerateCall:
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("seed", 11)
    fields.setdefault("steps", STEPS)
    return GenerateCall(**fields)


def generation(**fields: Any) -> GenerateCall:
    return edit(width=SIZE, height=SIZE, **fields)


def test_a_mask_over_everything_gives_the_generation_of_the_same_seed(worker: Worker) -> None:
    rgb = template_rgb()
    whole = worker.generate(edit(image=encode(rgb), mask=mask_png(region_of(1.0))))
    plain = worker.generate(generation())
    assert whole.png == plain.png
    assert (whole.cache, whole.start_step, whole.steps_run) == (CacheOutcome.NOT_USED, 0, STEPS)


@pytest.mark.parametrize("level", ONE_LEVEL_PER_MODEL)
def test_inpainting_keeps_every_unmasked_pixel_on_every_model(worker: Worker, level: str) -> None:
    worker.configure(level=level, wait=True)  # loads the level's model
    rgb = template_rgb(seed=len(level))
    region = region_of(0.25)
    result = worker.generate(edit(image=encode(rgb), mask=mask_png(region), level=level))
    out = pixels(result.png)
    assert result.level == level and not result.substituted
    assert np.array_equal(out[~region], rgb[~region])
    assert (out[region] != rgb[region]).mean() > 0.9  # the region was generated anew


def test_every_step_puts_the_templates_noised_latent_back_outside_the_region() -> None:
    model = tiny_model("sd-1.5")
    region = region_of(0.5)
    spec = GenerationSpec(
        PROMPT,
        seed=2,
        steps=STEPS,
        edit=check_edit(encode(template_rgb()), mask_png(region), None, LIMITS),
    )
    seen: dict[int, torch.Tensor] = {}
    result = model.denoise(spec, hooks=[lambda step, latents: seen.setdefault(step, latents)])
    with model.lock, torch.inference_mode():
        start = model.start_edit(spec)
    assert start.region is not None
    keep = start.region == 0
    assert keep.any() and (~keep).any()
    for step in range(1, STEPS):  # outside the region: the template at the next step's noise
        t = start.scheduler.timesteps[step : step + 1]
        known = start.scheduler.add_noise(start.template, start.noise, t)
        assert torch.equal(seen[step][keep.expand_as(known)], known[keep.expand_as(known)])
    final = result.latents
    assert torch.equal(final[keep.expand_as(final)], start.template[keep.expand_as(final)])
    plain = model.denoise(replace(spec, edit=None)).latents  # inside: not the generation's
    assert not torch.equal(final[~keep.expand_as(final)], plain[~keep.expand_as(final)])


def test_every_edit_of_a_template_sees_the_same_unmasked_latents_whatever_its_seed() -> None:
    """The unmasked region is noised with the template's own seed, the region with the
    request's: two seeds agree outside the region at every step (from the first step's
    input on) and differ inside it, which is what lets edits share recorded activations."""
    model = tiny_model("sd-1.5")
    edit_input = check_edit(encode(template_rgb()), mask_png(region_of(0.5)), None, LIMITS)
    inputs: dict[int, list[torch.Tensor]] = {3: [], 4: []}
    for seed, seen in inputs.items():
        spec = GenerationSpec(PROMPT, seed=seed, steps=STEPS, edit=edit_input)

        def predictor(
            latents: torch.Tensor,
            t: Any,
            cond: Any,
            scheduler: Any,
            step: int,
            seen: list[torch.Tensor] = seen,
        ) -> Any:
            seen.append(latents.clone())
            return model.predict_noise(latents, t, cond, scheduler, step)

        model.denoise(spec, predictor=predictor)
    with model.lock, torch.inference_mode():
        start = model.start_edit(GenerationSpec(PROMPT, seed=3, steps=STEPS, edit=edit_input))
    assert start.region is not None
    keep = (start.region == 0).expand_as(inputs[3][0])
    assert len(inputs[3]) == len(inputs[4]) == STEPS
    for one, other in zip(inputs[3], inputs[4], strict=True):
        assert torch.equal(one[keep], other[keep])
        assert not torch.equal(one[~keep], other[~keep])


def test_a_mask_over_nothing_gives_the_template_back() -> None:
    """Mask ratio 0 (the API refuses it as nothing to edit; the model path still holds): every
    step puts the template back, so the last latent is the template's and the answer its
    pixels."""
    model = tiny_model("sd-1.5")
    edit_input = EditInput(template_rgb(), np.zeros((SIZE, SIZE), dtype=bool), 1.0)
    spec = GenerationSpec(PROMPT, seed=2, steps=STEPS, edit=edit_input)
    result = model.denoise(spec)
    with model.lock, torch.inference_mode():
        start = model.start_edit(spec)
    assert torch.equal(result.latents, start.template)
    image = paste_unmasked(model.decode(result.latents), edit_input)
    assert np.array_equal(np.asarray(image.convert("RGB")), template_rgb())


def test_the_images_own_alpha_is_the_mask_when_none_is_sent(worker: Worker) -> None:
    rgb, region = template_rgb(seed=3), region_of(0.5)
    own = worker.generate(edit(image=with_alpha(rgb, region)))
    sent = worker.generate(edit(image=encode(rgb), mask=mask_png(region)))
    assert own.png == sent.png
    assert np.array_equal(pixels(own.png)[~region], rgb[~region])


def test_img2img_at_strength_one_is_the_generation_of_the_same_seed(worker: Worker) -> None:
    made = worker.generate(edit(image=encode(template_rgb()), strength=1.0))
    assert made.png == worker.generate(generation()).png
    assert (made.start_step, made.steps_run) == (0, STEPS)


def test_img2img_runs_the_last_strength_of_the_steps_from_the_image(worker: Worker) -> None:
    rgb = template_rgb(seed=5)
    events: list[Progress] = []
    half = worker.generate(edit(image=encode(rgb), strength=0.5, steps=8), progress=events.append)
    assert (half.start_step, half.steps_run, half.cache) == (4, 4, CacheOutcome.NOT_USED)
    running = [e for e in events if e.stage is Stage.RUNNING]
    assert [(e.step, e.total_steps) for e in running] == [(4, 8)]
    assert [e.step for e in events if e.stage is Stage.STEP] == [5, 6, 7, 8]
    # the image is where it starts: another template, the same seed, another image
    other = worker.generate(edit(image=encode(template_rgb(seed=6)), strength=0.5, steps=8))
    assert other.png != half.png


def test_an_edit_neither_uses_nor_feeds_the_cache(tmp_path: Path) -> None:
    encoder = PromptEmbedder()
    cache = ApproximateCache(
        EdgeVectorIndex(tmp_path / "edge", encoder.dim, optimize_after=None),
        LatentStore(tmp_path / "latents", fsync=False),
        max_entries=100,
        max_bytes=None,
        registry=CollectorRegistry(),
    )
    cached = make_worker(cache=cache, encoder=encoder)
    try:
        call = edit(image=encode(template_rgb()), mask=mask_png(region_of(0.5)), steps=10)
        cached.generate(replace(call, level="ac-k0"))  # a full run on the AC base
        cached.flush()
        assert cache.stats().entries == 0  # an edit's latents carry its template: not stored
        cached.generate(generation(steps=10, level="ac-k0"))  # the same prompt, from noise
        cached.flush()
        assert cache.stats().entries == 1
        resumed = cached.generate(generation(steps=10, level="ac-k5"))
        edited = cached.generate(replace(call, level="ac-k5"))
        assert resumed.cache is CacheOutcome.HIT  # a generation of the prompt would resume
        assert (edited.cache, edited.start_step) == (CacheOutcome.NOT_USED, 0)
        assert np.array_equal(pixels(edited.png)[~region_of(0.5)], template_rgb()[~region_of(0.5)])
    finally:
        cached.close()


def test_a_cancelled_edit_stops_within_a_step(worker: Worker) -> None:
    token = CancelToken()
    done: list[int] = []

    def cancel_after_two(event: Progress) -> None:
        if event.stage is Stage.STEP:
            done.append(event.step)
            if event.step == 2:
                token.cancel()

    call = edit(image=encode(template_rgb()), mask=mask_png(region_of(0.5)), steps=8)
    with pytest.raises(Cancelled) as stopped:
        worker.generate(call, cancel=token, progress=cancel_after_two)
    assert stopped.value.reason == "cancelled" and done == [1, 2]


def test_an_edit_whose_deadline_passed_is_not_run(worker: Worker) -> None:
    before = worker.stats().denoise_steps
    expired = CancelToken(deadline=0.0)  # long past on the monotonic clock
    with pytest.raises(Cancelled) as stopped:
        worker.generate(edit(image=encode(template_rgb()), strength=0.5), cancel=expired)
    assert stopped.value.reason == "expired"
    assert worker.stats().denoise_steps == before


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"mask": mask_png(region_of(0.5))}, "image"),  # a mask without an image
        ({"image": b"not an image"}, "image"),
        ({"image": encode(template_rgb(56)), "mask": mask_png(region_of(0.5))}, "mask"),
        ({"image": encode(template_rgb()), "strength": 0.5, "width": 128}, "width"),
        ({"image": encode(template_rgb()), "strength": 1.5}, "strength"),
    ],
)
def test_the_worker_refuses_bad_edits_naming_the_field(
    worker: Worker, fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        worker.generate(edit(**fields))
    assert refused.value.field == field
