"""Workloads for ``argus replay`` and ``argus evaluate``: when requests arrive, and which
prompt each one carries.

A :class:`Workload` is a sorted array of arrival times (seconds from the start of the run) plus
a list of prompts; request ``i`` carries ``prompts[i % len(prompts)]``, so with the default list
the requests walk through PartiPrompts in a fixed shuffled order and start over at the end.

Workloads are made in three places beside this one:

* :mod:`argus.sim.arrivals`: arrival processes (Poisson, bursty, ramp, Gamma renewal), the
  Azure trace's arrivals, and rescaling in rate and time;
* :mod:`argus.sim.trace_files`: the trace file format, read and written;
* :mod:`argus.sim.named_workloads`: the workload ``argus replay --trace NAME`` replays, with
  the defaults of each name.

This module holds what they share: the value and its checks, the prompts (PartiPrompts by
default, or a prompts file read by :func:`load_prompt_file`), and the checks of numeric
arguments. Bad input raises :class:`WorkloadError` (a ``ValueError``) with a one-line message
that names the file and line, or the argument and its value.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from argus.traces import PromptRecord, default_prompt_trace, load_prompts

FloatArray = npt.NDArray[np.float64]
SeedLike = int | np.random.Generator
PromptsLike = Sequence[PromptRecord] | str | Path | None

AZURE_ATTRIBUTION = "Azure LLM inference trace 2023, Microsoft, CC-BY 4.0"


class WorkloadError(ValueError):
    """A bad trace file, prompts file or workload argument; the message is one line."""


@dataclass(frozen=True, eq=False)
class Workload:
    """Arrival times and the prompts the requests carry.

    ``arrivals_s`` is stored as a read-only float64 copy; it must be one-dimensional, finite,
    ``>= 0`` and sorted. ``horizon_s`` is the length of the run when it is known to extend past
    the last arrival (generated workloads set it to their duration).
    """

    name: str
    arrivals_s: FloatArray
    prompts: tuple[PromptRecord, ...]
    source: str
    horizon_s: float | None = None

    def __post_init__(self) -> None:
        arrivals = np.array(self.arrivals_s, dtype=np.float64)
        if arrivals.ndim != 1:
            raise WorkloadError(
                f"workload {self.name!r}: arrivals_s must be one-dimensional, "
                f"got shape {arrivals.shape}"
            )
        _check_arrivals(arrivals, f"workload {self.name!r}")
        arrivals.setflags(write=False)
        object.__setattr__(self, "arrivals_s", arrivals)
        prompts = tuple(self.prompts)
        if not prompts:
            raise WorkloadError(f"workload {self.name!r}: no prompts")
        object.__setattr__(self, "prompts", prompts)
        if self.horizon_s is not None:
            horizon = float(self.horizon_s)
            last = float(arrivals[-1]) if arrivals.size else 0.0
            if not math.isfinite(horizon) or horizon < last:
                raise WorkloadError(
                    f"workload {self.name!r}: horizon_s {horizon!r} is before the last "
                    f"arrival {last!r}"
                )
            object.__setattr__(self, "horizon_s", horizon)

    @property
    def duration_s(self) -> float:
        """``horizon_s`` when set, else the last arrival time (0 for no arrivals)."""
        if self.horizon_s is not None:
            return self.horizon_s
        return float(self.arrivals_s[-1]) if self.arrivals_s.size else 0.0

    def __len__(self) -> int:
        return int(self.arrivals_s.size)

    def prompt(self, i: int) -> PromptRecord:
        """The prompt of request ``i``: ``prompts[i % len(prompts)]``."""
        return self.prompts[i % len(self.prompts)]

    def mean_qpm(self) -> float:
        """Requests per minute over the whole duration (0 when the duration is 0)."""
        minutes = self.duration_s / 60.0
        return len(self) / minutes if minutes > 0 else 0.0

    def rate_per_minute(self) -> FloatArray:
        """Offered load in QPM for each whole minute ``[60 m, 60 m + 60)`` of the run.

        The last entry covers a partial minute when the duration is not a whole number of
        minutes; its count is not extrapolated.
        """
        minutes = math.ceil(self.duration_s / 60.0)
        if self.arrivals_s.size == 0:
            return np.zeros(minutes, dtype=np.float64)
        minutes = max(minutes, 1)
        # an arrival exactly at the end of the last minute counts in that minute
        index = np.minimum(np.floor_divide(self.arrivals_s, 60.0).astype(np.int64), minutes - 1)
        return np.bincount(index, minlength=minutes).astype(np.float64)


# --------------------------------------------------------------------------- validation helpers


def number_argument(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise WorkloadError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise WorkloadError(f"{name} must be a finite number, got {value!r}")
    return number


def positive_argument(name: str, value: object) -> float:
    number = number_argument(name, value)
    if number <= 0.0:
        raise WorkloadError(f"{name} must be positive, got {value!r}")
    return number


def non_negative_argument(name: str, value: object) -> float:
    number = number_argument(name, value)
    if number < 0.0:
        raise WorkloadError(f"{name} must be zero or positive, got {value!r}")
    return number


def _check_arrivals(arrivals: FloatArray, where: str) -> None:
    """Finite, non-negative, sorted; the message names the first offending index."""
    bad = np.flatnonzero(~np.isfinite(arrivals))
    if bad.size:
        i = int(bad[0])
        raise WorkloadError(f"{where}: arrival {i} is {float(arrivals[i])!r}, not a finite number")
    bad = np.flatnonzero(arrivals < 0.0)
    if bad.size:
        i = int(bad[0])
        raise WorkloadError(f"{where}: arrival {i} at {float(arrivals[i])!r} s is negative")
    bad = np.flatnonzero(np.diff(arrivals) < 0.0)
    if bad.size:
        i = int(bad[0]) + 1
        raise WorkloadError(
            f"{where}: arrival {i} at {float(arrivals[i])!r} s is before the previous "
            f"{float(arrivals[i - 1])!r} s"
        )


# --------------------------------------------------------------------------------------- prompts


DEFAULT_PROMPT_ORDER_SEED = 20220622  # PartiPrompts' release date; any fixed seed would do


@functools.lru_cache(maxsize=1)
def default_prompts() -> tuple[PromptRecord, ...]:
    """PartiPrompts in one fixed shuffled order.

    The file is a benchmark sorted by category, not a log of traffic: walked in file order,
    the first minutes of a replay carry only abstract one-word prompts and the mix of prompt
    difficulty drifts for the whole run, which real traffic does not do. A prompt file given
    by the user keeps its order (it may be a log)."""
    try:
        path = default_prompt_trace()
    except FileNotFoundError as error:
        raise WorkloadError(str(error)) from None
    records = load_prompt_file(path)
    order = np.random.default_rng(DEFAULT_PROMPT_ORDER_SEED).permutation(len(records))
    return tuple(records[i] for i in order)


def load_prompt_file(path: str | Path) -> tuple[PromptRecord, ...]:
    """Prompts of a tab-separated file with a ``Prompt`` column, in file order.

    Files with ``Prompt``, ``Category`` and ``Challenge`` columns (PartiPrompts) are read by
    :func:`argus.traces.load_prompts`; a file with only a ``Prompt`` column gets empty labels.
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"prompts file {path} does not exist")
    with path.open(newline="", encoding="utf-8-sig") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [name.strip() for name in next(rows, [])]
        records: list[PromptRecord] = []
        if {"Prompt", "Category", "Challenge"} <= set(header):
            pass  # read below by the shared PartiPrompts reader
        elif "prompt" in (lowered := [name.lower() for name in header]):
            column = lowered.index("prompt")
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                text = row[column].strip() if column < len(row) else ""
                if not text:
                    raise WorkloadError(f"prompts file {path}: line {rows.line_num}: empty prompt")
                records.append(PromptRecord(prompt=text, category="", challenge=""))
        elif header:
            raise WorkloadError(f"prompts file {path}: no Prompt column; header is {header}")
    if {"Prompt", "Category", "Challenge"} <= set(header):
        try:
            records = load_prompts(path)
        except ValueError as error:
            raise WorkloadError(f"prompts file {error}") from None
    if not records:
        raise WorkloadError(f"prompts file {path} has no prompts")
    return tuple(records)


def resolve_prompts(prompts: PromptsLike) -> tuple[PromptRecord, ...]:
    if prompts is None:
        return default_prompts()
    if isinstance(prompts, str | Path):
        return load_prompt_file(prompts)
    records = tuple(prompts)
    if not records:
        raise WorkloadError("no prompts given (the prompt list is empty)")
    return records
