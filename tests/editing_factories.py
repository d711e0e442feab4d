"""Images, masks and checks for the editing tests (tests/test_editing*.py): small seeded
templates, masks of a given region, and the pixels an answer must keep."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from argus.request_limits import ImageLimits, check_edit
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

SIZE = 64  # the tiny models' side; a latent of 8×8
STEPS = 4  # few steps: CI stays fast
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data)
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def short_png(size: int = SIZE, rows: int = 10) -> bytes:
    """A well-formed RGBA PNG of ``size``×``size`` whose pixel data (a complete zlib stream,
    CRCs right) covers only its first ``rows`` rows, half of it transparent: a file cut
    short and re-compressed, which PIL decodes without an error, the rest black."""
    row = b"\x00" + bytes([200, 10, 10, 0, 200, 10, 10, 255] * (size // 2))
    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)
    idat = zlib.compress(row * rows)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def declaring_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width``×``height`` (one row of pixel data): what a
    decompression bomb looks like before it is decoded."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (width + 1))
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


BLOCK_SIZE = 128  # the tiny UNets' blocks see 8×8 tokens: masks with edges inside the grid
BLOCK_PROMPT = "a red boat on a lake"


def block_edit_spec(ratio: float, seed: int, template_seed: int = 7) -> GenerationSpec:
    """An inpainting edit of ``ratio`` of a :data:`BLOCK_SIZE` template, :data:`STEPS` steps
    (the activation cache's block-level tests)."""
    edit = check_edit(
        encode(template_rgb(BLOCK_SIZE, template_seed)),
        mask_png(region_of(ratio, BLOCK_SIZE)),
        None,
        ImageLimits(),
    )
    return GenerationSpec(
        BLOCK_PROMPT, seed=seed, steps=STEPS, height=BLOCK_SIZE, width=BLOCK_SIZE, edit=edit
    )


def latent_region(model: DiffusionModel, spec: GenerationSpec) -> torch.Tensor:
    """The latent-space region of ``spec``'s edit on ``model``."""
    with model.lock, torch.inference_mode():
        region = model.start_edit(spec).region
    assert region is not None
    return region
