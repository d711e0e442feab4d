"""Readers for the real traces shipped in the repository's ``traces/`` directory.

* ``azure_llm_inference_2023_conv.csv``: request arrival times of a production inference service
  (Azure LLM inference trace 2023, Microsoft, CC-BY 4.0). Only the ``TIMESTAMP`` column is used:
  it serves as a real, bursty arrival process.
* ``parti_prompts.tsv``: the PartiPrompts benchmark (Google Research, Apache-2.0), one prompt per
  row with its category and challenge.

See ``traces/README.md`` for the licences and attribution. Nothing is downloaded at run time.
"""

from __future__ import annotations

import calendar
import csv
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The package lives at <repo>/argus, so the traces are at <repo>/traces.
TRACES_DIR = Path(__file__).resolve().parent.parent / "traces"

AZURE_CONV_TRACE = "azure_llm_inference_2023_conv.csv"
PARTI_PROMPTS = "parti_prompts.tsv"

_TIMESTAMP_COLUMN = "TIMESTAMP"
_PROMPT_COLUMNS = ("Prompt", "Category", "Challenge")


@dataclass(frozen=True)
class PromptRecord:
    """One row of the PartiPrompts file."""

    prompt: str  # the text given to the diffusion model
    category: str  # PartiPrompts category, e.g. "Animals"
    challenge: str  # PartiPrompts challenge aspect, e.g. "Basic" or "Fine-grained Detail"


def _trace_file(name: str) -> Path:
    path = TRACES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {name!r} not found in {TRACES_DIR}: the traces ship with the source "
            "repository, not with an installed wheel"
        )
    return path


def default_arrival_trace() -> Path:
    """Path of the repository's Azure arrival trace."""
    return _trace_file(AZURE_CONV_TRACE)


def default_prompt_trace() -> Path:
    """Path of the repository's PartiPrompts file."""
    return _trace_file(PARTI_PROMPTS)


def _parse_timestamp(text: str) -> tuple[int, float]:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` (UTC assumed) → (whole epoch seconds, fraction).

    The fraction is kept apart so that differences between timestamps keep the trace's 100 ns
    resolution instead of the ~0.2 µs that one float of epoch seconds would give.
    """
    whole, dot, fraction = text.strip().partition(".")
    parsed = time.strptime(whole, "%Y-%m-%d %H:%M:%S")  # ValueError when malformed
    if dot:
        if not fraction.isdigit() or not fraction.isascii():
            raise ValueError(f"bad fractional seconds {fraction!r}")
        frac = int(fraction) / 10 ** len(fraction)
    else:
        frac = 0.0
    return calendar.timegm(parsed), frac


def _dict_rows(
    path: Path, *, tsv: bool, required: Iterable[str]
) -> Iterable[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file, or of a TSV file read without quoting."""
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = (
            csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            if tsv
            else csv.DictReader(handle)
        )
        header = reader.fieldnames or []
        missing = [column for column in required if column not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; header is {header}")
        for row in reader:
            yield reader.line_num, row


def load_arrivals(path: str | Path) -> list[float]:
    """Arrival times in seconds since the first arrival, sorted, from the ``TIMESTAMP`` column.

    Raises ``ValueError`` naming the file and line of a malformed timestamp.
    """
    path = Path(path)
    stamps: list[tuple[int, float]] = []
    for line, row in _dict_rows(path, tsv=False, required=(_TIMESTAMP_COLUMN,)):
        value = row.get(_TIMESTAMP_COLUMN) or ""
        try:
            stamps.append(_parse_timestamp(value))
        except ValueError as error:
            raise ValueError(
                f"{path}:{line}: malformed {_TIMESTAMP_COLUMN} {value!r} "
                f"(expected YYYY-MM-DD HH:MM:SS[.fraction]): {error}"
            ) from None
    if not stamps:
        return []
    stamps.sort()
    first_whole, first_frac = stamps[0]
    return [(whole - first_whole) + (frac - first_frac) for whole, frac in stamps]


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """PartiPrompts rows in file order (columns Prompt, Category, Challenge; others ignored).

    The file is plain TSV: quote characters are part of the prompt text, not CSV quoting.
    """
    path = Path(path)
    records: list[PromptRecord] = []
    for line, row in _dict_rows(path, tsv=True, required=_PROMPT_COLUMNS):
        values = [row.get(column) for column in _PROMPT_COLUMNS]
        if any(value is None for value in values):
            raise ValueError(f"{path}:{line}: expected columns {', '.join(_PROMPT_COLUMNS)}")
        prompt, category, challenge = (str(value).strip() for value in values)
        if not prompt:
            raise ValueError(f"{path}:{line}: empty prompt")
        records.append(PromptRecord(prompt=prompt, category=category, challenge=challenge))
    return records
