"""User values in messages, cut short: an error that echoes a 100,000-character prompt or flag
buries its own point and floods logs and terminals.

Used wherever a value that came from a user (a flag, a prompt, a request field) is quoted into
an error message or an output line; the marker keeps the original length visible.
"""

from __future__ import annotations

LIMIT = 80
"""Characters of a value kept in a message."""


def shorten(text: str, limit: int = LIMIT) -> str:
    """``text``, or its first ``limit`` characters and a marker with its full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text):,} characters]"


def quoted(value: object, limit: int = LIMIT) -> str:
    """``repr(value)`` for a message, shortened like :func:`shorten`."""
    return shorten(repr(value), limit)
