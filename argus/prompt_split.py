"""The fixed split of prompts into training, calibration and evaluation sets.

Every part of Argus that learns from prompts or is judged on them uses this one split, so the
three sets never overlap anywhere:

* ``train``: the classifier's weights (and its internal model selection) see only these;
* ``calibration``: temperature scaling of the classifier's probabilities, the edges of its
  classes and the per-class quality table Q(v | c) the joint planner uses are measured here;
* ``eval``: trace replays and ``argus evaluate`` draw their prompts from here.

A prompt's set depends only on its text (a keyed BLAKE2b hash of the UTF-8 bytes), not on the
file it came from or its position, so adding prompts never moves an existing one to another set.
The shares are 60 / 20 / 20.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class PromptSet(enum.StrEnum):
    TRAIN = "train"
    CALIBRATION = "calibration"
    EVAL = "eval"


# Cumulative upper bounds of each set on [0, 1): 60 % train, 20 % calibration, 20 % eval.
_BOUNDS: tuple[tuple[float, PromptSet], ...] = (
    (0.6, PromptSet.TRAIN),
    (0.8, PromptSet.CALIBRATION),
    (1.0, PromptSet.EVAL),
)
_KEY = b"argus-prompt-split-v1"


def prompt_set(text: str) -> PromptSet:
    """The set ``text`` belongs to (stable across runs, machines and prompt files)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=_KEY).digest()
    position = int.from_bytes(digest, "little") / 2.0**64
    for bound, name in _BOUNDS:
        if position < bound:
            return name
    return PromptSet.EVAL


class _HasPrompt(Protocol):
    @property
    def prompt(self) -> str: ...


P = TypeVar("P", bound=_HasPrompt)


def select(records: Iterable[P], which: PromptSet | str) -> tuple[P, ...]:
    """The records whose prompt text is in set ``which``, in their original order."""
    wanted = PromptSet(which)
    return tuple(record for record in records if prompt_set(record.prompt) is wanted)


def indices(texts: Sequence[str], which: PromptSet | str) -> list[int]:
    """Positions of the texts in set ``which``."""
    wanted = PromptSet(which)
    return [i for i, text in enumerate(texts) if prompt_set(text) is wanted]
