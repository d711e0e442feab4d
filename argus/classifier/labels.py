"""Training labels from a quality table: each prompt's optimal level under the δ rule.

A prompt's optimal level is the fastest level whose score is ``>= δ ×`` the best score the
prompt gets at any level of the strategy (Argus §3, δ = 0.9); :meth:`QualityTable.optimal_levels`
implements the rule and this module only packages its result with the prompts for training.
Prompts are cleaned exactly as serving cleans them (:func:`argus.classifier.prompts.clean_prompt`),
so a model never trains on text it would not see; prompts that clean to nothing (empty or
whitespace-only) are left out, since serving answers them without the model.

Each prompt keeps the table's own text as its *split key*: the fixed split of
:mod:`argus.prompt_split` hashes the text as the prompt files hold it, and replays select
their evaluation prompts by that text, so training must too. Several rows that clean to the
same text keep the first row; if their split keys fall in different sets the prompt is left
out altogether, since using it for one purpose would use its twin for another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.classifier.prompts import clean_prompt
from argus.contracts.quality import DEFAULT_DELTA, QualityTable
from argus.prompt_split import PromptSet, prompt_set
from argus.types import Strategy

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class LabelledPrompts:
    """Prompts with their optimal level index (levels slowest first, as in the table)."""

    strategy: Strategy
    levels: tuple[str, ...]  # level names, slowest first; label i means levels[i]
    prompts: tuple[str, ...]  # cleaned prompt texts, no duplicates, none empty
    labels: IntArray  # optimal level index per prompt
    scores: FloatArray | None  # [prompts, levels] quality scores, when known (evaluation)
    source: str  # where the labels come from, e.g. the quality table's "synthetic: ..."
    delta: float  # the δ of the rule that made the labels
    split_keys: tuple[str, ...] | None = None  # text argus.prompt_split hashes, per prompt;
    # None: the prompts themselves

    def __post_init__(self) -> None:
        if self.split_keys is not None and len(self.split_keys) != len(self.prompts):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.split_keys)} split keys")
        labels = np.asarray(self.labels, dtype=np.int64)
        if labels.shape != (len(self.prompts),):
            raise ValueError(f"{len(self.prompts)} prompts but labels of shape {labels.shape}")
        if labels.size and not (labels.min() >= 0 and labels.max() < len(self.levels)):
            raise ValueError(f"labels must be level indices in [0, {len(self.levels)})")
        object.__setattr__(self, "labels", labels)
        if self.scores is not None:
            scores = np.asarray(self.scores, dtype=np.float64)
            if scores.shape != (len(self.prompts), len(self.levels)):
                raise ValueError(f"scores have shape {scores.shape}, expected prompts × levels")
            object.__setattr__(self, "scores", scores)

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_sets(self) -> tuple[PromptSet, ...]:
        """The set of :mod:`argus.prompt_split` each prompt belongs to."""
        return tuple(prompt_set(key) for key in (self.split_keys or self.prompts))

    @property
    def synthetic(self) -> bool:
        """True when the labels come from the synthetic quality model, not from images."""
        return self.source.startswith("synthetic")

    def subset(self, indices: Sequence[int] | IntArray) -> LabelledPrompts:
        """The rows ``indices``, in that order."""
        rows = np.asarray(indices, dtype=np.int64)
        return LabelledPrompts(
            strategy=self.strategy,
            levels=self.levels,
            prompts=tuple(self.prompts[i] for i in rows.tolist()),
            labels=self.labels[rows],
            scores=None if self.scores is None else self.scores[rows],
            source=self.source,
            delta=self.delta,
            split_keys=None
            if self.split_keys is None
            else tuple(self.split_keys[i] for i in rows.tolist()),
        )


def labels_from_table(
    table: QualityTable, delta: float = DEFAULT_DELTA, *, max_chars: int | None = None
) -> LabelledPrompts:
    """Every usable prompt of ``table`` with its optimal level under the δ rule.

    ``max_chars`` cuts prompts as serving does (see :func:`clean_prompt`); ``None`` keeps them
    whole. Raises ``ValueError`` when no prompt is left.
    """
    optimal = table.optimal_levels(delta)
    first: dict[str, int] = {}  # cleaned text -> its first row
    sets: dict[str, set[PromptSet]] = {}  # cleaned text -> the sets of its rows' texts
    for row, text in enumerate(table.prompts):
        cleaned = clean_prompt(text, max_chars=max_chars)
        if cleaned is None:
            continue
        first.setdefault(cleaned, row)
        sets.setdefault(cleaned, set()).add(prompt_set(text))
    prompts = [cleaned for cleaned in first if len(sets[cleaned]) == 1]
    keep = [first[cleaned] for cleaned in prompts]
    if not keep:
        raise ValueError(f"the {table.strategy} quality table has no non-empty prompt")
    return LabelledPrompts(
        strategy=table.strategy,
        levels=table.levels,
        prompts=tuple(prompts),
        labels=optimal[keep],
        scores=table.scores[keep],
        source=table.source,
        delta=delta,
        split_keys=tuple(table.prompts[row] for row in keep),
    )
