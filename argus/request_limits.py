"""The limits of one generation request, checked in the same words by the router and the worker.

The router checks a request before it classifies or routes it, the worker again before it
runs it (a worker can be called directly); both raise :class:`InvalidRequestError` naming the
field, which their servicers turn into INVALID_ARGUMENT. Absent fields (``None``) are the
serving side's defaults and are not checked here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PROMPT_CHARS = 64 * 1024  # the tokenizer keeps 77 tokens; more text is only a burden
MAX_STEPS = 1000
MAX_GUIDANCE = 50.0


class InvalidRequestError(ValueError):
    """A request that will not be served; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ImageLimits:
    """Largest image a deployment serves."""

    max_side: int = 2048
    max_pixels: int = 2048 * 2048


def check_prompts(prompt: object, negative_prompt: object) -> None:
    """Both prompts are text of at most ``MAX_PROMPT_CHARS`` characters."""
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if not isinstance(text, str):
            raise InvalidRequestError(name, "must be text")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(name, f"{len(text)} characters; at most {MAX_PROMPT_CHARS}")


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
