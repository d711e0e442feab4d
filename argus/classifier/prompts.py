"""What the classifier accepts as a prompt, and what it does with bad ones.

The rules, applied in this order by :func:`prepare_prompt` (serving) and
:func:`clean_prompt` (training and serving alike):

1. **Bytes** are decoded as UTF-8, strictly. Bytes that do not decode raise
   :class:`InvalidPromptError` naming the offset and the byte; a ``str`` holding a lone
   surrogate (what ``surrogateescape`` makes of such bytes) raises it too. Anything else than
   ``str`` or ``bytes`` raises ``TypeError``. A router answers these with INVALID_ARGUMENT.
2. Leading and trailing whitespace is removed. An **empty or whitespace-only** prompt is not
   an error (a diffusion model generates from it) but carries nothing to classify: it gets
   :data:`EMPTY_PROMPT_LEVEL`, the slowest and best level, which can lose no quality (or
   :data:`EMPTY_PROMPT_CLASS`, the least tolerant class, from a calibrated classifier).
3. A **long** prompt (say 1 MB) is cut to ``max_chars`` characters before tokenising, then the
   tokenizer truncates it to the encoder's token limit (256 tokens for all-MiniLM-L6-v2). The
   character cut only bounds the tokenizer's work (1 MB takes the BERT tokenizer about a
   second); it is :data:`CHARS_PER_TOKEN` characters per token of the limit, far beyond what
   the limit's tokens span in ordinary text, so the tokens the model sees are the same.
"""

from __future__ import annotations

EMPTY_PROMPT_LEVEL = 0
"""Level index given to empty and whitespace-only prompts: the slowest, best level."""

EMPTY_PROMPT_CLASS = 0
"""Class given to empty and whitespace-only prompts by a calibrated classifier: the least
tolerant class (nothing in the prompt says it tolerates approximation)."""

CHARS_PER_TOKEN = 16
"""Characters kept per token of the encoder's limit before tokenising (see rule 3)."""


class InvalidPromptError(ValueError):
    """The prompt is not text: bytes that are not UTF-8, or a lone surrogate."""


def decode_prompt(prompt: str | bytes) -> str:
    """The prompt as text; raises :class:`InvalidPromptError` or ``TypeError`` (rule 1)."""
    if isinstance(prompt, bytes | bytearray | memoryview):
        data = bytes(prompt)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidPromptError(
                f"prompt is not valid UTF-8: byte 0x{data[exc.start]:02x} at offset "
                f"{exc.start} ({exc.reason})"
            ) from None
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be str or bytes, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPromptError(
            f"prompt is not valid Unicode text: lone surrogate "
            f"U+{ord(prompt[exc.start]):04X} at character {exc.start}"
        ) from None
    return prompt


def clean_prompt(text: str, *, max_chars: int | None = None) -> str | None:
    """Stripped text cut to ``max_chars``; ``None`` when nothing is left (rules 2 and 3)."""
    stripped = text.strip()
    if not stripped:
        return None
    if max_chars is not None and len(stripped) > max_chars:
        stripped = stripped[:max_chars]
    return stripped


def prepare_prompt(prompt: str | bytes, *, max_chars: int | None = None) -> str | None:
    """Rules 1–3: the text to classify, or ``None`` for :data:`EMPTY_PROMPT_LEVEL`."""
    return clean_prompt(decode_prompt(prompt), max_chars=max_chars)


def max_chars_for(max_tokens: int) -> int:
    """The character cut of rule 3 for an encoder limit of ``max_tokens`` tokens."""
    return CHARS_PER_TOKEN * max_tokens
