"""The limits of one generation request, checked in the same words by the router and the worker.

The router checks a request before it classifies or routes it, the worker again before it
runs it (a worker can be called directly); both raise :class:`InvalidRequestError` naming the
field, which their servicers turn into INVALID_ARGUMENT. Absent fields (``None``) are the
serving side's defaults and are not checked here. Numbers that arrive as text (the HTTP API's
``size``) are read by :func:`parse_int` and :func:`parse_size`, which take ASCII digits only.
"""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass

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
MAX_INT_DIGITS = 9  # text numbers: sizes and counts are far below 10^9, so more is not one


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
