"""Edits on the router's side, without a worker (issue 32, items 1 and 4): what the core makes
of an edit (its size is its image's; a retried id must carry the same image), how the policy
prices it, and what :func:`~argus.request_limits.check_edit` accepts."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from argus.contracts.router_api import RouterRequest
from argus.profiles import default_profiles
from argus.request_limits import (
    ImageLimits,
    InvalidRequestError,
    check_edit,
    img2img_steps,
)
from argus.router.config import RouterServiceConfig
from argus.router.core import check_request, fingerprint
from argus.router.policy import RouterPolicy
from argus.router.values import Refusal, RouterError
from tests.editing_factories import encode, mask_png, region_of, template_rgb, with_alpha

pytestmark = pytest.mark.unit

LIMITS = ImageLimits()
RGB = template_rgb(32)
REGION = region_of(0.25, 32)


def test_an_edit_is_served_at_its_images_size() -> None:
    edit = RouterRequest(prompt="a fox", image=encode(RGB), mask=mask_png(REGION))
    served, _ = check_request(edit)
    assert (served.width, served.height) == (32, 32)
    plain = RouterRequest(prompt="a fox")
    assert check_request(plain) == (plain, None)


def test_a_retried_id_with_another_image_is_another_request() -> None:
    first = RouterRequest(prompt="a fox", request_id="r", image=encode(RGB), strength=0.5)
    other = RouterRequest(prompt="a fox", request_id="r", image=encode(RGB[::-1].copy()))
    assert fingerprint(first) != fingerprint(other)
    assert fingerprint(first) != fingerprint(RouterRequest(prompt="a fox", request_id="r"))


def test_an_edit_costs_a_generation_of_its_size_and_img2img_its_share_of_the_steps() -> None:
    policy = RouterPolicy(default_profiles(), RouterServiceConfig(default_steps=50))
    plain = policy.price(RouterRequest(prompt="x", width=32, height=32, steps=20))
    inpaint = policy.price(
        check_request(RouterRequest(prompt="x", steps=20, image=with_alpha(RGB, REGION)))[0]
    )
    img2img = policy.price(
        check_request(RouterRequest(prompt="x", steps=20, image=encode(RGB), strength=0.3))[0]
    )
    defaulted = policy.price(
        RouterRequest(prompt="x", width=32, height=32, image=b"i", strength=0.5)
    )
    assert isinstance(plain, float) and inpaint == plain
    assert img2img == pytest.approx(plain * 6 / 20)
    assert defaulted == pytest.approx(plain * 50 / 20 * 0.5)  # the default 50 steps, 25 run


def test_an_edit_above_the_cost_cap_is_refused_naming_its_size() -> None:
    config = RouterServiceConfig(max_cost=1e-4)  # a 32×32 image of 50 steps costs about 1e-3
    refused = RouterPolicy(default_profiles(), config).price(
        check_request(RouterRequest(prompt="x", steps=50, image=with_alpha(RGB, REGION)))[0]
    )
    assert not isinstance(refused, float)
    assert refused.error().kind is Refusal.INVALID


@pytest.mark.parametrize(
    ("steps", "strength", "run"),
    [(10, 1.0, 10), (10, 0.5, 5), (10, 0.29, 2), (10, 0.01, 1), (50, 0.7, 35), (1, 0.3, 1)],
)
def test_img2img_runs_floor_of_steps_times_strength_and_at_least_one(
    steps: int, strength: float, run: int
) -> None:
    assert img2img_steps(steps, strength) == run


def test_a_palette_png_with_a_transparent_entry_is_its_own_mask() -> None:
    palette = Image.fromarray(np.where(REGION, 0, 1).astype(np.uint8), mode="P")
    palette.putpalette([0, 0, 0, 255, 255, 255])
    out = io.BytesIO()
    palette.save(out, format="PNG", transparency=0)
    edit = check_edit(out.getvalue(), b"", None, LIMITS)
    assert edit is not None and edit.region is not None
    assert np.array_equal(edit.region, REGION) and edit.mask_ratio == pytest.approx(0.125)


def test_a_webp_template_with_alpha_is_accepted() -> None:
    rgba = np.dstack([RGB, np.where(REGION, 0, 255).astype(np.uint8)])
    out = io.BytesIO()
    Image.fromarray(rgba, mode="RGBA").save(out, format="WEBP", lossless=True)
    edit = check_edit(out.getvalue(), b"", None, LIMITS)
    assert edit is not None and edit.region is not None
    assert np.array_equal(edit.region, REGION)
    assert np.array_equal(edit.rgb[~REGION], RGB[~REGION])  # lossless; hidden pixels dropped


def test_a_truncated_png_is_a_damaged_image() -> None:
    whole = encode(RGB)
    with pytest.raises(InvalidRequestError) as refused:
        check_edit(whole[: len(whole) // 2], b"", 0.5, LIMITS)
    assert refused.value.field == "image" and "damaged" in str(refused.value)


def test_a_header_declaring_too_many_pixels_is_refused_unread() -> None:
    small = ImageLimits(max_side=64, max_pixels=64 * 64)
    with pytest.raises(InvalidRequestError) as refused:
        check_edit(encode(template_rgb(72)), b"", 0.5, small)
    assert refused.value.field == "image" and "exceeds" in str(refused.value)


def test_the_cores_refusal_names_the_field() -> None:
    with pytest.raises(RouterError) as refused:
        check_request(RouterRequest(prompt="x", image=encode(RGB), mask=encode(RGB)))
    assert refused.value.kind is Refusal.INVALID
    assert refused.value.details.startswith("mask: no alpha channel")
