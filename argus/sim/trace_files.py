"""Trace files: workloads read from CSV files and written to them.

The format (read by :func:`load_workload`, written by :func:`save_workload`)::

    # name: my-trace
    # source: where the arrivals came from
    # horizon_s: 3600.0
    arrival_s,prompt,category,challenge
    0.0,"a red bicycle leaning on a wall",Vehicles,Basic
    0.73,"two cats on a sofa",Animals,Basic

* Optional leading ``# key: value`` lines carry metadata: ``name``, ``source`` and
  ``horizon_s`` (the length of the run, at least the last arrival) are understood; other keys
  are ignored.
* Then a CSV header. ``arrival_s`` is required: seconds from the start, a finite float,
  ``>= 0``, rows in non-decreasing order.
* ``prompt`` is optional; when present every row needs one and request ``i`` gets row ``i``'s
  prompt. ``category`` and ``challenge`` are optional labels for it. Other columns are ignored;
  column names are matched without regard to case.

:func:`load_workload` also reads other CSV files of arrivals. It takes the first of these
columns it finds, names matched without regard to case:

* ``arrival_s``: seconds from the start of the run, as above;
* ``timestamp``, then ``time``: the time of each arrival on the file's own clock, either as
  numbers of seconds (Unix time, or seconds from any origin) or as date-times
  (``YYYY-MM-DD HH:MM:SS[.fraction]`` or ISO 8601, UTC when no zone is given; the Azure trace's
  ``TIMESTAMP``), as the column's first value is. Rows are sorted by time (their prompts with
  them) and converted to seconds since the first one, as :func:`argus.traces.load_arrivals`
  does.

A file with none of them is refused with a message naming the columns looked for and the
header found. Errors are :class:`~argus.sim.workloads.WorkloadError` naming the file and line.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from argus.sim.workloads import (
    AZURE_ATTRIBUTION,
    FloatArray,
    PromptsLike,
    Workload,
    WorkloadError,
    default_prompts,
    resolve_prompts,
)
from argus.traces import AZURE_CONV_TRACE, PromptRecord, _parse_timestamp

_ARRIVAL_COLUMN = "arrival_s"
# arrival time columns load_workload looks for, in this order, any case
_ARRIVAL_COLUMNS = (_ARRIVAL_COLUMN, "timestamp", "time")
_PROMPT_COLUMNS = ("prompt", "category", "challenge")


def _timestamp_seconds(text: str) -> tuple[int, float]:
    """(whole epoch seconds, fraction) of ``YYYY-MM-DD HH:MM:SS[.f]`` or ISO 8601 text."""
    try:
        return _parse_timestamp(text)
    except ValueError:
        parsed = datetime.fromisoformat(text.strip())  # ValueError when malformed
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        whole = math.floor(parsed.timestamp())
        return whole, parsed.microsecond / 1e6


def _csv_rows(
    path: Path, handle: Iterable[str]
) -> tuple[dict[str, str], list[str], Iterator[tuple[int, list[str]]]]:
    """Metadata, header and (line number, row) of a trace file, comments and blanks skipped."""
    lines = iter(handle)
    meta: dict[str, str] = {}
    skipped = 0
    first: str | None = None
    for raw in lines:
        if raw.startswith("#"):
            key, colon, value = raw[1:].partition(":")
            if colon:
                meta[key.strip().lower()] = value.strip()
            skipped += 1
        elif not raw.strip():
            skipped += 1
        else:
            first = raw
            break
    if first is None:
        raise WorkloadError(f"{path}: empty trace (no header and no arrivals)")
    reader = csv.reader(itertools.chain([first], lines))
    header = [name.strip() for name in next(reader)]

    def rows() -> Iterator[tuple[int, list[str]]]:
        for row in reader:
            if any(cell.strip() for cell in row):
                yield skipped + reader.line_num, row

    return meta, header, rows()


def _cell(row: list[str], column: int | None) -> str:
    if column is None or column >= len(row):
        return ""
    return row[column].strip()


def _arrival_column(path: Path, header: list[str]) -> int:
    """Index of the arrival time column: the first of :data:`_ARRIVAL_COLUMNS` (any case)."""
    lowered = [name.lower() for name in header]
    for name in _ARRIVAL_COLUMNS:
        if name in lowered:
            return lowered.index(name)
    looked = ", ".join(_ARRIVAL_COLUMNS)
    raise WorkloadError(
        f"{path}: no arrival time column (looked for {looked}, any case); "
        f"header is {','.join(header)}"
    )


def _offsets(path: Path, name: str, cells: list[tuple[int, str]]) -> FloatArray:
    """``arrival_s`` cells: seconds from the start of the run, finite, >= 0, non-decreasing."""
    values: list[float] = []
    previous = 0.0
    for line, cell in cells:
        try:
            value = float(cell)
        except ValueError:
            raise WorkloadError(f"{path}: line {line}: {name} {cell!r} is not a number") from None
        if not math.isfinite(value):
            raise WorkloadError(f"{path}: line {line}: {name} {value!r} is not finite")
        if value < 0.0:
            raise WorkloadError(f"{path}: line {line}: {name} {value!r} is negative")
        if values and value < previous:
            raise WorkloadError(
                f"{path}: line {line}: {name} {value!r} is before the previous {previous!r}"
            )
        values.append(value)
        previous = value
    return np.asarray(values, dtype=np.float64)


def _clock_seconds(path: Path, name: str, cells: list[tuple[int, str]]) -> FloatArray:
    """``timestamp`` / ``time`` cells of numbers: seconds on the file's own clock (such as
    Unix time), in any order; the caller sorts them and measures from the first."""
    first = cells[0][1] if cells else ""
    values: list[float] = []
    for line, cell in cells:
        try:
            value = float(cell)
        except ValueError:
            raise WorkloadError(
                f"{path}: line {line}: {name} {cell!r} is not a number (the column's first "
                f"value {first!r} is, so it is read as seconds)"
            ) from None
        if not math.isfinite(value):
            raise WorkloadError(f"{path}: line {line}: {name} {value!r} is not finite")
        values.append(value)
    return np.asarray(values, dtype=np.float64)


def _datetimes(
    path: Path, name: str, cells: list[tuple[int, str]]
) -> tuple[npt.NDArray[np.int64], FloatArray]:
    """Date-time cells as (whole epoch seconds, fractions), in file order."""
    wholes: list[int] = []
    fractions: list[float] = []
    for line, cell in cells:
        try:
            whole, fraction = _timestamp_seconds(cell)
        except ValueError:
            raise WorkloadError(
                f"{path}: line {line}: malformed {name} {cell!r} "
                "(expected seconds, YYYY-MM-DD HH:MM:SS[.fraction] or ISO 8601)"
            ) from None
        wholes.append(whole)
        fractions.append(fraction)
    return np.asarray(wholes, dtype=np.int64), np.asarray(fractions, dtype=np.float64)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _from_first(
    path: Path, name: str, cells: list[tuple[int, str]]
) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    """Clock times (seconds or date-times, as the first cell is) -> (seconds since the first
    arrival, sorted; the order of the rows that sorts them)."""
    if cells and _is_number(cells[0][1]):
        values = _clock_seconds(path, name, cells)
        order = np.argsort(values, kind="stable").astype(np.int64)
        values = values[order]
        return (values - values[0] if values.size else values), order
    wholes, fractions = _datetimes(path, name, cells)
    order = np.lexsort((fractions, wholes)).astype(np.int64)
    wholes, fractions = wholes[order], fractions[order]
    if not wholes.size:
        return np.zeros(0, dtype=np.float64), order
    return (wholes - wholes[0]).astype(np.float64) + (fractions - fractions[0]), order


def load_workload(path: str | Path, prompts: PromptsLike = None) -> Workload:
    """A workload from a trace file in our format or any CSV with an arrival time column:
    ``arrival_s`` (seconds from the start), else ``timestamp``, else ``time`` (any case;
    seconds on any clock, or date-times), as the module docstring describes.

    Prompts: ``prompts`` when given (records, or the path of a prompts file), else the file's
    ``prompt`` column when it has one, else PartiPrompts.
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    with path.open(newline="", encoding="utf-8-sig") as handle:
        meta, header, rows = _csv_rows(path, handle)
        lowered = [name.lower() for name in header]

        def column(name: str) -> int | None:
            return lowered.index(name) if name in lowered else None

        time_col = _arrival_column(path, header)
        time_name = header[time_col]
        prompt_col, category_col, challenge_col = (column(name) for name in _PROMPT_COLUMNS)
        texts: list[PromptRecord] = []
        cells: list[tuple[int, str]] = []
        for line, row in rows:
            if prompt_col is not None:
                text = _cell(row, prompt_col)
                if not text:
                    raise WorkloadError(f"{path}: line {line}: empty prompt")
                texts.append(
                    PromptRecord(text, _cell(row, category_col), _cell(row, challenge_col))
                )
            cells.append((line, _cell(row, time_col)))
    if time_name.lower() == _ARRIVAL_COLUMN:
        arrivals = _offsets(path, time_name, cells)
        source = f"trace file {path}"
    else:
        arrivals, order = _from_first(path, time_name, cells)
        texts = [texts[i] for i in order] if texts else texts
        label = AZURE_ATTRIBUTION if path.name == AZURE_CONV_TRACE else "timestamps"
        source = f"{label} ({path})"
    if arrivals.size == 0:
        raise WorkloadError(f"{path}: empty trace (no arrivals after the header)")
    horizon: float | None = None
    if "horizon_s" in meta:
        try:
            horizon = float(meta["horizon_s"])
        except ValueError:
            raise WorkloadError(
                f"{path}: horizon_s {meta['horizon_s']!r} is not a number"
            ) from None
        if not math.isfinite(horizon) or horizon < float(arrivals[-1]):
            raise WorkloadError(
                f"{path}: horizon_s {horizon!r} is before the last arrival {float(arrivals[-1])!r}"
            )
    if prompts is not None:
        records = resolve_prompts(prompts)
    elif texts:
        records = tuple(texts)
    else:
        records = default_prompts()
    return Workload(
        name=meta.get("name") or path.stem,
        arrivals_s=arrivals,
        prompts=records,
        source=meta.get("source") or source,
        horizon_s=horizon,
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def save_workload(workload: Workload, path: str | Path, *, with_prompts: bool = True) -> None:
    """Write ``workload`` in the trace file format (see the module docstring).

    With ``with_prompts`` every row carries its request's prompt, so the file alone gives the
    same workload back; without, only arrival times are written.
    """
    path = Path(path)
    try:
        with path.open("w", newline="", encoding="utf-8") as handle:
            handle.write(f"# name: {_one_line(workload.name)}\n")
            handle.write(f"# source: {_one_line(workload.source)}\n")
            if workload.horizon_s is not None:
                handle.write(f"# horizon_s: {workload.horizon_s!r}\n")
            writer = csv.writer(handle, lineterminator="\n")
            times = workload.arrivals_s.tolist()
            if with_prompts:
                writer.writerow([_ARRIVAL_COLUMN, *_PROMPT_COLUMNS])
                prompts = workload.prompts
                count = len(prompts)
                for i, t in enumerate(times):
                    record = prompts[i % count]
                    writer.writerow((repr(t), record.prompt, record.category, record.challenge))
            else:
                writer.writerow([_ARRIVAL_COLUMN])
                writer.writerows((repr(t),) for t in times)
    except OSError as error:
        raise WorkloadError(f"{path}: cannot write the trace: {error.strerror}") from None
