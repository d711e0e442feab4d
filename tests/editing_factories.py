"""Images, masks and checks for the editing tests (tests/test_editing*.py): small seeded
templates, masks of a given region, and the pixels an answer must keep."""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
from PIL import Image

SIZE = 64  # the tiny models' side; a latent of 8×8
STEPS = 4  # few steps: CI stays fast


def template_rgb(size: int = SIZE, seed: int = 7) -> npt.NDArray[np.uint8]:
    """A seeded noisy image (no two pixels alike by chance: a paste-back that slips shows)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def encode(pixels: npt.NDArray[np.uint8], format: str = "PNG") -> bytes:
    """``pixels`` (H×W×3 RGB or H×W×4 RGBA) in ``format``."""
    mode = "RGBA" if pixels.shape[2] == 4 else "RGB"
    out = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(out, format=format)
    return out.getvalue()


def region_of(ratio: float, size: int = SIZE) -> npt.NDArray[np.bool_]:
    """The top-left rectangle covering about ``ratio`` of the image (full rows first), True
    where edited; ratio 1: everything, 0: nothing."""
    region = np.zeros((size, size), dtype=bool)
    rows = round(size * ratio)
    region[:rows, :] = True
    if 0 < ratio < 1:
        region[:rows, size // 2 :] = False  # a rectangle, not whole rows: edges on both axes
    return region


def mask_png(region: npt.NDArray[np.bool_]) -> bytes:
    """A mask PNG: fully transparent where ``region`` is True, opaque white elsewhere."""
    rgba = np.full((*region.shape, 4), 255, dtype=np.uint8)
    rgba[region, 3] = 0
    return encode(rgba)


def with_alpha(rgb: npt.NDArray[np.uint8], region: npt.NDArray[np.bool_]) -> bytes:
    """The template as an RGBA PNG whose own alpha marks ``region`` (0 there)."""
    rgba = np.dstack([rgb, np.where(region, 0, 255).astype(np.uint8)])
    return encode(rgba)


def pixels(png: bytes) -> npt.NDArray[np.uint8]:
    """An answer's RGB pixels (the PNG must be one)."""
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"), dtype=np.uint8)
