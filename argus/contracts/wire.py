"""What every reader of an ``argus.v1`` message checks, and the enums both sides map.

A reader turns a message into a contract value or raises :class:`FieldError`, whose message
starts with the field's path (``"retrieval.samples_s[3]: must be ..."``); the allocator's
servicer answers it with INVALID_ARGUMENT. Readers never fix input up. The limits bound what
one message may make a process hold.

A Python enum meets its protobuf enum through :func:`pb_numbers`, which looks each member up
by name in the generated code: a member added on one side only fails at import, naming it,
instead of going out under another member's number (as a hand-copied table let it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, TypeVar

from argus import defaults
from argus.plumbing import rpc
from argus.types import ProfileSet, Strategy

allocator_pb2: Any = rpc.load("allocator_pb2")
common_pb2: Any = rpc.load("common_pb2")

_E = TypeVar("_E", bound=enum.Enum)

MAX_ID_CHARS = defaults.MAX_WIRE_ID_CHARS
MAX_ARRIVALS = 100_000  # per router report: 1 s of 100k requests/s
MAX_CLASSIFIED = 100_000  # level names per strategy per router report
MAX_SAMPLES = 4096  # retrieval samples per heartbeat
MAX_COUNT = 100_000  # retrievals (summarised or failed) per heartbeat


def pb_numbers(
    members: type[_E], pb_enum: Any, pb_name: Callable[[_E], str] = lambda m: m.name
) -> dict[_E, int]:
    """Each member of ``members`` → the number of the value ``pb_name(member)`` (by default
    the member's name) of the generated enum ``pb_enum`` (``common_pb2.Strategy``,
    ``worker_pb2.Progress.Stage``, ...). Raises ValueError at import when a member has no
    value of that name, or two members share one."""
    numbers = {member: int(pb_enum.Value(pb_name(member))) for member in members}
    if len(set(numbers.values())) != len(numbers):
        raise ValueError(f"{members.__name__}: two members map to one protobuf value")
    return numbers


STRATEGY_TO_PB = pb_numbers(Strategy, common_pb2.Strategy)  # 0 (unspecified) is no strategy
STRATEGY_FROM_PB = {v: k for k, v in STRATEGY_TO_PB.items()}


class FieldError(ValueError):
    """Bad input; the message starts with the field's path."""


def identifier(value: str, where: str) -> str:
    """A non-empty id of at most :data:`MAX_ID_CHARS` characters."""
    if not value.strip():
        raise FieldError(f"{where}: must not be empty")
    return at_most_chars(value, where)


def at_most_chars(value: str, where: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise FieldError(f"{where}: at most {MAX_ID_CHARS} characters, got {len(value)}")
    return value


def address(value: str, where: str) -> str:
    """``HOST:PORT`` with a port in 1..65535."""
    host, sep, port = identifier(value, where).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FieldError(f"{where}: expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


def seconds(value: float, where: str) -> float:
    if not (math.isfinite(value) and value >= 0.0):
        raise FieldError(f"{where}: must be a finite number >= 0, got {value}")
    return float(value)


def at_most(value: int, limit: int, where: str) -> int:
    if value > limit:
        raise FieldError(f"{where}: at most {limit}, got {value}")
    return int(value)


def strategy_from_pb(value: int, where: str) -> Strategy:
    """The strategy an ``argus.v1.Strategy`` names; unspecified or unknown is an error."""
    try:
        return STRATEGY_FROM_PB[value]
    except KeyError:
        raise FieldError(f"{where}: expected AC or SM, got {value}") from None


def optional_strategy_from_pb(value: int, where: str) -> Strategy | None:
    """As :func:`strategy_from_pb`, but unspecified (0) is None: nothing served yet."""
    return None if value == 0 else strategy_from_pb(value, where)


def level_name(value: str, profiles: ProfileSet, where: str) -> str:
    """A level name of ``profiles``."""
    if all(level.name != value for level in profiles.levels):
        names = ", ".join(level.name for level in profiles.levels)
        raise FieldError(f"{where}: {value!r} is not a level of the profile ({names})")
    return value
