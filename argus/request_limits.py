"""The limits of one generation request, checked in the same words by the router and the worker.

The router checks a request before it classifies or routes it, the worker again before it
runs it (a worker can be called directly); both raise :class:`InvalidRequestError` naming the
field, which their servicers turn into INVALID_ARGUMENT. Absent fields (``None``) are the
serving side's defaults and are not checked here. Numbers that arrive as text (the HTTP API's
``size``) are read by :func:`parse_int` and :func:`parse_size`, which take ASCII digits only.

An edit's image and mask are decoded by :func:`check_edit` on both sides too (the router to
refuse bad input before routing it and to price it by the image's size, the worker to run
it), into an :class:`EditInput`: the template's RGB pixels and the region to edit.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import zlib
from collections.abc import Sized
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from argus import defaults

MAX_PROMPT_CHARS = 64 * 1024  # the tokenizer keeps 77 tokens; more text is only a burden
MAX_STEPS = 1000
MAX_GUIDANCE = 50.0
MAX_ADAPTERS = 16
"""Adapters (LoRAs and ControlNets together) one request may carry. Katz's production traces
(:mod:`argus.sim.adapters`, Table 1) show one or two ControlNets and at most two LoRAs per
request, so 16 is several times what real requests use; each adapter costs a LoRA load and
merge or a ControlNet run at every step, so the bound keeps one request from buying many
requests' worth of work (or a 10,000-entry list from being walked at all)."""
MAX_PREVIEWS = MAX_STEPS  # latent previews one stream may ask for: one a step at most
MAX_LEVEL_INDEX = 2**31 - 1
"""The largest ``max_level_index`` (int32's largest). The plan's strategy, and so how many
levels there are, changes with each plan, and an index past the last level is any level (the
policy clamps it), so a fixed bound keeps a request valid across plans."""
MAX_INT_DIGITS = 9  # text numbers: sizes and counts are far below 10^9, so more is not one
MAX_EDIT_IMAGE_BYTES = 3 * 1024 * 1024
"""An edit's image, and its mask, each at most this many bytes encoded: both together with the
prompts fit the 8 MiB a router's gRPC and HTTP endpoints take in one request. Their pixels are
bounded as a generation's size is (:class:`ImageLimits`), checked on the header before the
pixels are decoded, so a small file that declares a huge image is refused unread."""
EDIT_FORMATS = ("PNG", "JPEG", "WEBP")  # the image's; the mask is a PNG (OpenAI's formats)
LATENT_FACTOR = 8
"""An edit's sides must be multiples of this: the SD and SDXL VAEs (and the tiny ones) encode
8×8 pixels into one latent pixel, and an image that does not divide would be cropped."""


class InvalidRequestError(ValueError):
    """A request that will not be served; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ImageLimits:
    """Largest image a deployment serves (the router's and the workers' default alike)."""

    max_side: int = defaults.MAX_IMAGE_SIDE
    max_pixels: int = defaults.MAX_IMAGE_PIXELS


def check_prompts(prompt: object, negative_prompt: object) -> None:
    """Both prompts are text of at most ``MAX_PROMPT_CHARS`` characters, and the prompt says
    something: an empty or blank prompt is refused (the classifier has nothing to read and
    the image nothing to follow; the negative prompt may be empty)."""
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if not isinstance(text, str):
            raise InvalidRequestError(name, "must be text")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(name, f"{len(text)} characters; at most {MAX_PROMPT_CHARS}")
        if name == "prompt" and not text.strip():
            raise InvalidRequestError(name, "empty; describe the image")


def check_adapters(adapters: Sized) -> None:
    """At most :data:`MAX_ADAPTERS` adapters (LoRAs and ControlNets together)."""
    if len(adapters) > MAX_ADAPTERS:
        raise InvalidRequestError(
            "adapters", f"{len(adapters)} adapters; at most {MAX_ADAPTERS} per request"
        )


def check_image(width: int | None, height: int | None, limits: ImageLimits) -> None:
    """Each given side is positive, a multiple of 8 and within ``limits``."""
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        if value <= 0:
            raise InvalidRequestError(name, f"{value} must be positive")
        if value % 8:
            raise InvalidRequestError(name, f"{value} is not a multiple of 8")
        if value > limits.max_side:
            raise InvalidRequestError(name, f"{value} exceeds the maximum {limits.max_side}")
    if width is not None and height is not None and width * height > limits.max_pixels:
        raise InvalidRequestError("width", f"{width}×{height} exceeds {limits.max_pixels} pixels")


def check_range(field: str, value: int | None, low: int, high: int) -> None:
    """A given integer ``value`` in ``low..high``: the words both APIs refuse one in."""
    if value is not None and not low <= value <= high:
        raise InvalidRequestError(field, f"{value} outside {low}..{high}")


def check_sampling(steps: int | None, guidance_scale: float | None, seed: int) -> None:
    """Steps in 1..MAX_STEPS, guidance in [0, MAX_GUIDANCE], a 64-bit unsigned seed."""
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise InvalidRequestError("steps", f"{steps} outside 1..{MAX_STEPS}")
    if guidance_scale is not None and not (
        math.isfinite(guidance_scale) and 0.0 <= guidance_scale <= MAX_GUIDANCE
    ):
        raise InvalidRequestError(
            "guidance_scale", f"{guidance_scale} outside [0, {MAX_GUIDANCE:g}]"
        )
    if not 0 <= seed < 2**64:
        raise InvalidRequestError("seed", "must fit in 64 bits unsigned")


def parse_int(text: str, field: str) -> int:
    """``text`` as a non-negative int: ASCII digits only, at most :data:`MAX_INT_DIGITS` of
    them. ``int()`` alone also takes signs, spaces, underscores and any Unicode digit
    ("５１２", "٥١٢"), and ``str.isdigit`` takes "²", which ``int()`` then refuses."""
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequestError(field, f"{text[:32]!r} is not a number (ASCII digits 0-9)")
    if len(text) > MAX_INT_DIGITS:
        raise InvalidRequestError(field, f"{text[:32]!r} has more than {MAX_INT_DIGITS} digits")
    return int(text)


def parse_size(text: str, field: str = "size") -> tuple[int, int]:
    """``WIDTHxHEIGHT`` (OpenAI's ``size``, e.g. "1024x1024") as (width, height), each side
    read by :func:`parse_int`; the sides' limits are :func:`check_image`'s."""
    width, sep, height = text.partition("x")
    if not sep:
        raise InvalidRequestError(field, f"{text[:32]!r}: expected WIDTHxHEIGHT, e.g. 1024x1024")
    return parse_int(width, field), parse_int(height, field)


# -- edits ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class EditInput:
    """A checked edit (:func:`check_edit`): what the worker's denoising loop starts from.

    ``rgb`` is the template's pixels (height × width × 3, uint8; an alpha channel dropped);
    ``region`` is True where the image is edited (inpainting), None for img2img, which
    changes the whole image by ``strength``. Compared by identity (it holds arrays)."""

    rgb: npt.NDArray[np.uint8]
    region: npt.NDArray[np.bool_] | None
    strength: float  # 1 for inpainting: its region starts from the seed's noise

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    @property
    def mask_ratio(self) -> float:
        """The share of pixels edited (1 for img2img)."""
        return 1.0 if self.region is None else float(self.region.mean())

    @cached_property
    def template_digest(self) -> str:
        """SHA-256 of the template's pixels and shape: what names the template (its noise
        outside the region, its recorded activations) whatever file format carried it."""
        digest = hashlib.sha256(repr(self.rgb.shape).encode())
        digest.update(np.ascontiguousarray(self.rgb).tobytes())
        return digest.hexdigest()

    @property
    def template_seed(self) -> int:
        """The seed of the template's own noise: inpainting noises the unmasked region with
        it, so every edit of one template sees the same latents there at every step (what
        lets the mask-aware activation cache reuse them), whatever the request's seed."""
        return int(self.template_digest[:15], 16)

    def start_step(self, steps: int) -> int:
        """The step an edit of ``steps`` starts at: img2img denoises the last
        :func:`img2img_steps`, inpainting all of them (its strength is 1)."""
        return steps - img2img_steps(steps, self.strength)


def img2img_steps(steps: int, strength: float) -> int:
    """The steps an img2img edit of ``steps`` at ``strength`` runs: ``floor(steps ×
    strength)`` as diffusers counts them, at least one (a strength too small for one step
    still asks for a change), all of them at strength 1."""
    return max(1, min(steps, int(steps * strength)))


def check_strength(strength: float | None, has_mask: bool) -> None:
    """``strength`` (img2img) in (0, 1], and never with a mask: an edit with a mask
    (inpainting) regenerates its region in full and keeps the rest exactly."""
    if strength is None:
        return
    if has_mask:
        raise InvalidRequestError(
            "strength", "img2img only: an edit with a mask regenerates the masked region in full"
        )
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise InvalidRequestError("strength", f"{strength} outside (0, 1]")


def check_edit(
    image: bytes, mask: bytes, strength: float | None, limits: ImageLimits
) -> EditInput | None:
    """The edit a request asks for, checked; None for a generation (no image). Raises
    :class:`InvalidRequestError` naming ``image``, ``mask`` or ``strength``.

    The region to edit is the mask's fully transparent pixels; without a mask, the image's own
    (unless ``strength`` asks for img2img). A mask or strength without an image, an image
    that is not a PNG, JPEG or WebP (or a mask that is not a PNG) of at most
    :data:`MAX_EDIT_IMAGE_BYTES`, sides not multiples of :data:`LATENT_FACTOR` or beyond
    ``limits``, a mask of another size, without an alpha channel, or with no fully
    transparent pixel (nothing to edit: OpenAI's edits have no meaning without a region, so
    the request is refused rather than answered with its template) are refused."""
    if not image:
        if mask:
            raise InvalidRequestError("image", "required with a mask")
        if strength is not None:
            raise InvalidRequestError("image", "required with a strength")
        return None
    check_strength(strength, bool(mask))
    template = _open("image", image, EDIT_FORMATS, limits)
    rgb = np.asarray(template.convert("RGB"), dtype=np.uint8)
    if strength is not None:
        return EditInput(rgb, None, strength)
    if mask:
        shape = _open("mask", mask, ("PNG",), limits)
        if shape.size != template.size:
            raise InvalidRequestError(
                "mask", f"{_dims(shape.size)} differs from the image's {_dims(template.size)}"
            )
        region = _transparent("mask", shape)
    else:
        region = _transparent("image", template)
    return EditInput(rgb, region, 1.0)


def check_edit_size(edit: EditInput, width: int | None, height: int | None) -> None:
    """An edit's image sets its size: a width or height given beside it must be the image's
    (an edit is not resized: its unmasked pixels come back exactly as sent)."""
    for name, given, own in (("width", width, edit.width), ("height", height, edit.height)):
        if given is not None and given != own:
            raise InvalidRequestError(
                name,
                f"{given} differs from the image's {edit.width}×{edit.height}; "
                "an edit keeps its image's size",
            )


def _open(field: str, data: bytes, formats: tuple[str, ...], limits: ImageLimits) -> Any:
    """``data`` decoded as an image of one of ``formats`` within ``limits``; the size is
    checked on the header, before the pixels are decoded, and pixel data that stops short
    of the size (a truncated or damaged file) is refused rather than filled in."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_EDIT_IMAGE_BYTES:
        raise InvalidRequestError(field, f"{len(data)} bytes; at most {MAX_EDIT_IMAGE_BYTES}")
    wanted = " or ".join(formats)
    try:
        opened: Any = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError:
        # PIL refuses a header declaring over twice its own pixel bound without saying the
        # size; this deployment's bound is far lower, so the header is read by the format's
        # parser alone, to refuse the size in this deployment's words below
        opened = _header_of(data, formats)
    except (UnidentifiedImageError, OSError, ValueError):
        opened = None
    if opened is None:
        raise InvalidRequestError(field, f"not an image ({wanted} expected)")
    width, height = opened.size
    if width % LATENT_FACTOR or height % LATENT_FACTOR:
        raise InvalidRequestError(
            field, f"{_dims(opened.size)}: each side must be a multiple of {LATENT_FACTOR}"
        )
    if max(width, height) > limits.max_side or width * height > limits.max_pixels:
        raise InvalidRequestError(
            field,
            f"{_dims(opened.size)} exceeds this deployment's {limits.max_side} pixels a side "
            f"or {limits.max_pixels} pixels",
        )
    try:  # raises on a cut file as long as PIL's LOAD_TRUNCATED_IMAGES stays False
        opened.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InvalidRequestError(field, f"a damaged {opened.format} image") from None
    if opened.format == "PNG":
        _check_png_data(field, data)
    return opened


def _header_of(data: bytes, formats: tuple[str, ...]) -> Any:
    """``data`` opened by the parser of the first of ``formats`` that takes it, without
    PIL's decompression-bomb check (the caller checks the size); None if none takes it."""
    from PIL import Image

    for name in formats:
        factory, accept = Image.OPEN[name]
        if accept is not None and not accept(data[:16]):
            continue
        try:
            return factory(io.BytesIO(data), "")
        except (SyntaxError, OSError, ValueError, struct.error):
            continue
    return None


_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type → samples a pixel
# Adam7's passes: first column and row, and the steps between the pixels each takes
_ADAM7: tuple[tuple[int, int, int, int], ...] = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)


def _check_png_data(field: str, data: bytes) -> None:
    """Refuse a PNG whose pixel data inflates to fewer bytes than its header's rows take.
    PIL's decoder ends quietly where a complete zlib stream ends, leaving the rows after it
    black, so a file cut and re-compressed (or damaged that way) decodes without an error;
    ``data`` was opened and loaded by PIL, so its header is sound."""
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    bits = depth * _PNG_SAMPLES.get(colour, 4)
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    expected = 0
    for x0, y0, dx, dy in passes:
        cols, rows = max(0, -(-(width - x0) // dx)), max(0, -(-(height - y0) // dy))
        expected += rows * (1 + (cols * bits + 7) // 8) if cols else 0
    inflate = zlib.decompressobj()
    inflated = 0
    try:
        for chunk in _png_idat(data):
            while chunk and inflated < expected:
                inflated += len(inflate.decompress(chunk, 1 << 20))
                chunk = inflate.unconsumed_tail
    except zlib.error:
        raise InvalidRequestError(field, "a damaged PNG image (its pixel data)") from None
    if inflated < expected:
        raise InvalidRequestError(
            field,
            f"a damaged PNG image: its pixel data stops short of its {width}×{height} pixels "
            f"({inflated} of {expected} bytes)",
        )


def _png_idat(data: bytes) -> Any:
    """The IDAT chunks' payloads of a PNG, in order."""
    pos = 8  # past the signature
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IEND":
            return
        if kind == b"IDAT":
            yield data[pos + 8 : pos + 8 + length]
        pos += 12 + length  # length and type, the payload, its CRC


def _transparent(field: str, image: Any) -> npt.NDArray[np.bool_]:
    """Where ``image``'s alpha is 0 (a palette's transparent entry included); refused when it
    has no alpha channel or no such pixel."""
    if image.mode not in ("RGBA", "LA", "PA") and "transparency" not in image.info:
        raise InvalidRequestError(
            field,
            f"no alpha channel ({image.mode}); fully transparent pixels mark the region to "
            "edit (send a mask, or a strength for img2img)",
        )
    alpha = np.asarray(image.convert("RGBA"), dtype=np.uint8)[:, :, 3]
    region: npt.NDArray[np.bool_] = alpha == 0
    if not region.any():
        raise InvalidRequestError(field, "no fully transparent pixel: nothing to edit")
    return region


def _dims(size: tuple[int, int]) -> str:
    return f"{size[0]}×{size[1]}"
