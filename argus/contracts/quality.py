"""Per-prompt quality tables and the δ rule: the score of every prompt at every level.

Definitions (Argus §3): for one prompt, an image is of *optimal quality* when its score is at
least ``delta`` times the best score the prompt gets at any level of the strategy (the paper uses
``delta = 0.9``); the prompt's *optimal level* is the fastest level that gives an optimal-quality
image. Levels are ordered slowest first (see :mod:`argus.types`), so the optimal level is the
highest index whose score passes the threshold.

A :class:`QualityTable` covers one strategy. Real tables come from ``argus profile`` (every
prompt generated at every level and scored with PickScore); the simulator's
:func:`argus.profiles.synthetic_quality.synthetic_quality_table` makes SYNTHETIC tables of the
same shape and format. The profiler writes them, the classifier's training and calibration read
them, and live replay and the simulator score what they served with them: one definition for
all.

File format (``save_quality_table`` / ``load_quality_table``), UTF-8 CSV as written by Python's
``csv`` module (RFC 4180 quoting, so prompts may hold commas, quotes and newlines)::

    # argus-quality-table v1
    # strategy: AC
    # source: pickscore: yuvalkirstain/PickScore_v1
    prompt,ac-k0,ac-k5,ac-k10,ac-k15,ac-k20,ac-k25
    a red bus,21.37,21.2,20.91,15.8,15.12,14.9
    "a cat, a dog and a bird",20.1,19.0,16.4,15.9,15.2,15.0

* The first line is exactly ``# argus-quality-table v1``.
* Further leading lines starting with ``#`` are ``# key: value`` metadata; ``strategy`` (``AC``
  or ``SM``) and ``source`` are required, each once; unknown keys are ignored, so a writer may
  add its own (``# delta: 0.9``, ``# generated: …``).
* Then a header row: ``prompt`` followed by the level names of the strategy, slowest first,
  no duplicates. Then one row per prompt: the prompt text and one score per level (blank
  lines are skipped).
* Scores are finite positive numbers, written with ``repr`` (the shortest text that reads back
  to the same float), so a save/load round trip is bit-exact.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from argus import defaults
from argus.types import Strategy

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

FORMAT_MAGIC = "# argus-quality-table v1"
PROMPT_COLUMN = "prompt"
DEFAULT_DELTA = defaults.DELTA  # Argus §3: within 90% of the best image (argus.defaults)


@dataclass(frozen=True, eq=False)
class QualityTable:
    """Scores of ``prompts`` at the ``levels`` of one ``strategy``.

    ``scores[i, j]`` is the (PickScore-like) score of prompt ``i`` served at level ``j``; levels
    are slowest first. The array is copied to float64 and made read-only. Tables compare by
    identity (``eq=False``).
    """

    strategy: Strategy
    levels: tuple[str, ...]
    prompts: tuple[str, ...]
    scores: FloatArray
    source: str  # "synthetic: <model>" or "pickscore: <checkpoint>"
    _level_index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.levels:
            raise ValueError("a quality table needs at least one level")
        duplicates = sorted({name for name in self.levels if self.levels.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate level name(s) {', '.join(map(repr, duplicates))}")
        if not self.prompts:
            raise ValueError("a quality table needs at least one prompt")
        scores = np.array(self.scores, dtype=np.float64)  # a copy, never a view of the input
        expected = (len(self.prompts), len(self.levels))
        if scores.shape != expected:
            raise ValueError(
                f"scores have shape {scores.shape}, expected {expected} (prompts × levels)"
            )
        if not np.all(np.isfinite(scores)) or not np.all(scores > 0.0):
            raise ValueError("scores must be finite and > 0 (the δ rule compares ratios)")
        scores.setflags(write=False)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "_level_index", {n: i for i, n in enumerate(self.levels)})

    def __len__(self) -> int:
        return len(self.prompts)

    def level_index(self, name: str) -> int:
        """Column of level ``name``; ``KeyError`` lists the table's levels when unknown."""
        try:
            return self._level_index[name]
        except KeyError:
            raise KeyError(
                f"level {name!r} not in the {self.strategy} quality table: {', '.join(self.levels)}"
            ) from None

    def score(self, prompt_index: int, level_index: int) -> float:
        """Score of one prompt at one level (indices as in ``prompts`` and ``levels``)."""
        return float(self.scores[prompt_index, level_index])

    def optimal_levels(self, delta: float = DEFAULT_DELTA) -> IntArray:
        """Per prompt, the fastest level whose score is ``>= delta ×`` the prompt's best score."""
        _check_delta(delta)
        threshold = delta * self.scores.max(axis=1, keepdims=True)
        passes = self.scores >= threshold  # every row passes at its maximum (delta <= 1)
        fastest_first = np.argmax(passes[:, ::-1], axis=1)
        result: IntArray = (len(self.levels) - 1 - fastest_first).astype(np.int64)
        return result

    def optimal_histogram(self, delta: float = DEFAULT_DELTA) -> FloatArray:
        """Fraction of prompts whose optimal level is each level (the affinity H, Argus §4.2)."""
        counts = np.bincount(self.optimal_levels(delta), minlength=len(self.levels))
        return counts.astype(np.float64) / len(self.prompts)

    def mean_optimal(self, delta: float = DEFAULT_DELTA) -> float:
        """Mean score when every prompt is served at its optimal level."""
        best = self.optimal_levels(delta)
        return float(self.scores[np.arange(len(self.prompts)), best].mean())

    def mean_random(self) -> float:
        """Expected mean score when every prompt is served at a uniformly random level."""
        return float(self.scores.mean())

    def mean_at_level(self, level_index: int) -> float:
        """Mean score when every prompt is served at one level."""
        return float(self.scores[:, level_index].mean())

    def mean_at_level_where_optimal(self, level_index: int, delta: float = DEFAULT_DELTA) -> float:
        """Mean score at one level over the prompts whose optimal level it is (NaN if none)."""
        chosen = self.optimal_levels(delta) == level_index
        if not chosen.any():
            return math.nan
        return float(self.scores[chosen, level_index].mean())


def _check_delta(delta: float) -> None:
    if not 0.0 < delta <= 1.0:
        raise ValueError(f"delta must be in (0, 1], got {delta!r}")


# ---------------------------------------------------------------------------------------------
# File format


def save_quality_table(table: QualityTable, path: str | Path) -> None:
    """Write ``table`` in the v1 CSV format of the module docstring."""
    if any(ch in table.source for ch in "\r\n"):
        raise ValueError(f"source must be one line, got {table.source!r}")
    buffer = io.StringIO()
    buffer.write(f"{FORMAT_MAGIC}\n# strategy: {table.strategy.value}\n# source: {table.source}\n")
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([PROMPT_COLUMN, *table.levels])
    for prompt, row in zip(table.prompts, table.scores.tolist(), strict=True):
        writer.writerow([prompt, *(repr(float(value)) for value in row)])
    Path(path).write_text(buffer.getvalue(), encoding="utf-8", newline="")


def load_quality_table(path: str | Path) -> QualityTable:
    """Read a v1 quality table; ``ValueError`` names the file, line and field of bad input."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle_in:  # keep \r\n in prompts
            text = handle_in.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read quality table: {exc}") from None
    handle = io.StringIO(text, newline="")
    meta: dict[str, str] = {}
    line_no = 0
    position = 0
    while True:
        position = handle.tell()
        line = handle.readline()
        if not line.startswith("#"):
            break
        line_no += 1
        content = line.rstrip("\r\n")
        if line_no == 1:
            if content.strip() != FORMAT_MAGIC:
                raise ValueError(
                    f"{path}:1: expected {FORMAT_MAGIC!r} as the first line, got {content!r}"
                )
            continue
        key, colon, value = content[1:].partition(":")
        key = key.strip().lower()
        if not colon or not key:
            raise ValueError(f"{path}:{line_no}: expected '# key: value', got {content!r}")
        if key in meta:
            raise ValueError(f"{path}:{line_no}: duplicate header key {key!r}")
        meta[key] = value.strip()
    if line_no == 0:
        first = line.rstrip("\r\n")
        raise ValueError(f"{path}:1: missing header {FORMAT_MAGIC!r} (first line is {first!r})")
    for key in ("strategy", "source"):
        if key not in meta:
            raise ValueError(f"{path}: missing header line '# {key}: ...'")
    try:
        strategy = Strategy.parse(meta["strategy"])
    except ValueError as exc:
        raise ValueError(f"{path}: header 'strategy': {exc}") from None

    handle.seek(position)
    reader = csv.reader(handle, strict=True)
    offset = line_no  # reader.line_num counts the physical lines it has read itself
    try:
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}:{offset + 1}: missing column header row")
        where = f"{path}:{offset + reader.line_num}"
        if not header or header[0] != PROMPT_COLUMN:
            raise ValueError(f"{where}: the column header must start with {PROMPT_COLUMN!r}")
        levels = tuple(header[1:])
        if not levels:
            raise ValueError(f"{where}: no level columns after {PROMPT_COLUMN!r}")
        seen: set[str] = set()
        for name in levels:
            if not name.strip():
                raise ValueError(f"{where}: empty level name in the column header")
            if name in seen:
                raise ValueError(f"{where}: duplicate level name {name!r}")
            seen.add(name)
        prompts: list[str] = []
        rows: list[list[float]] = []
        for record in reader:
            where = f"{path}:{offset + reader.line_num}"
            if not record:
                continue  # a blank line
            if len(record) != len(levels) + 1:
                raise ValueError(
                    f"{where}: expected {len(levels) + 1} columns (prompt and "
                    f"{len(levels)} levels), got {len(record)}"
                )
            values: list[float] = []
            for name, cell in zip(levels, record[1:], strict=True):
                try:
                    number = float(cell)
                except ValueError:
                    raise ValueError(
                        f"{where}: level {name!r}: score {cell!r} is not a number"
                    ) from None
                if not math.isfinite(number) or number <= 0.0:
                    raise ValueError(
                        f"{where}: level {name!r}: score {cell!r} must be finite and > 0"
                    )
                values.append(number)
            prompts.append(record[0])
            rows.append(values)
    except csv.Error as exc:
        raise ValueError(f"{path}:{offset + reader.line_num}: malformed CSV: {exc}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompt rows after the column header")
    return QualityTable(
        strategy=strategy,
        levels=levels,
        prompts=tuple(prompts),
        scores=np.array(rows, dtype=np.float64),
        source=meta["source"],
    )
