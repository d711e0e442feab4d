"""How much load an evaluation offers: the cluster's capacity, and a trace brought to a
multiple of it.

Capacity (:func:`cluster_capacity_qpm`): the sum over the workers of the throughput of the
fastest level of the default strategy (AC) on each worker's GPU class, in the profiles the
policies plan with (so with adapters on, each level's throughput includes the mean seconds
the adapters add; the mean is taken over :data:`CAPACITY_DRAWS` requests drawn with seed 0,
and each run's own draws differ from it by sampling noise only). Above 1.0 × capacity no
policy can serve every request, even at the fastest level.

Workloads (:func:`argus.sim.evaluate.seeded_workload`): for load point ``L`` the target mean is
``L × capacity`` QPM. The trace (``poisson`` by default; any ``argus replay --trace``) is
first generated or fitted to ``duration_min`` minutes — the synthetic shapes (poisson, gamma,
bursty, ramp) at the rate scale that puts their nominal mean at the target, so their
randomness is that of the target rate — and then rescaled exactly by
:func:`rescale_to_load`:

1. the per-minute rates ``r_m`` of the trace are mapped to target rates: with a mean only,
   ``r'_m = r_m × M / r̄`` (the trace's shape, relative burstiness kept); with
   ``--target-load MEAN:PEAK``, the affine map ``r'_m = M + (r_m − r̄)(P − M)/(max r − r̄)``,
   which gives mean ``M`` and busiest minute ``P`` exactly (an error names the largest
   feasible peak when the quietest minute would need a negative rate);
2. each minute gets a whole number of arrivals: the target counts rounded on their running
   sum, so every minute is within one request of its target and the total is exact;
3. each minute is thinned or filled to its count, seeded: a minute with more arrivals than
   wanted keeps a uniformly random subset of them (bursts within the minute stay); one with
   fewer keeps all and adds copies of randomly chosen arrivals, each placed uniformly between
   its original and the next arrival of the minute (an empty minute is filled uniformly).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from argus.sim.workloads import Workload
from argus.types import ProfileSet, Strategy

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

CAPACITY_DRAWS = 100_000  # requests drawn (seed 0) for the adapters' mean seconds in capacity


class EvaluationError(ValueError):
    """Bad evaluation settings; the message is one line."""


def planning_profiles(
    profiles: ProfileSet, adapters: str, *, draws: int = CAPACITY_DRAWS, seed: int = 0
) -> ProfileSet:
    """The profiles policies plan with: ``profiles`` with the mean seconds of the adapter
    model's adapters added (``draws`` requests drawn with ``seed``); unchanged without."""
    from argus.sim.adapters import adapter_model_by_name, draw_adapters, with_adapter_costs

    model = adapter_model_by_name(adapters)
    if model is None:
        return profiles
    sample = draw_adapters(draws, np.random.default_rng(seed), model.mix)
    return with_adapter_costs(profiles, model, sample)


def cluster_capacity_qpm(
    plan_profiles: ProfileSet,
    gpu_counts: Iterable[tuple[str, int]],
    strategy: Strategy = Strategy.AC,
) -> float:
    """QPM the cluster serves with every worker at the fastest level of ``strategy``: the sum
    over workers of that level's throughput on the worker's class."""
    levels = plan_profiles.levels_for(strategy)
    if not levels:
        raise EvaluationError(f"the profiles have no {strategy} level")
    total = 0.0
    for worker_class, count in gpu_counts:
        fastest = max(plan_profiles.profile(worker_class, lv.name).throughput_qpm for lv in levels)
        total += count * fastest
    return total


# -- rescaling a trace to a load ----------------------------------------------------------------


def minute_lengths(duration_s: float) -> FloatArray:
    """Seconds in each minute of a run of ``duration_s`` (the last may be partial)."""
    minutes = max(1, math.ceil(duration_s / 60.0 - 1e-9))
    lengths = np.full(minutes, 60.0)
    lengths[-1] = duration_s - 60.0 * (minutes - 1) if duration_s > 0 else 60.0
    return lengths


def target_rates(
    rates_qpm: FloatArray, lengths_s: FloatArray, mean_qpm: float, peak_qpm: float | None = None
) -> FloatArray:
    """Per-minute target rates with length-weighted mean ``mean_qpm`` and, when ``peak_qpm``
    is given, maximum ``peak_qpm`` (see the module docstring for the two maps)."""
    weights = lengths_s / lengths_s.sum()
    average = float(np.dot(rates_qpm, weights))
    if average <= 0.0:
        raise EvaluationError("the trace has no arrivals to rescale")
    if peak_qpm is None:
        scaled: FloatArray = rates_qpm * (mean_qpm / average)
        return scaled
    if peak_qpm < mean_qpm:
        raise EvaluationError(f"peak {peak_qpm:g} QPM is below the mean {mean_qpm:g} QPM")
    top = float(rates_qpm.max())
    if top - average <= 1e-9 * average:
        if peak_qpm - mean_qpm <= 1e-9 * mean_qpm:
            return np.full_like(rates_qpm, mean_qpm)
        raise EvaluationError(
            "every minute of the trace has the same rate: it has no busiest minute to scale "
            f"to a peak of {peak_qpm:g} QPM"
        )
    mapped: FloatArray = mean_qpm + (rates_qpm - average) * (
        (peak_qpm - mean_qpm) / (top - average)
    )
    low = float(mapped.min())
    if low < -1e-9:
        quietest = float(rates_qpm.min())
        largest = mean_qpm + (top - average) * mean_qpm / (average - quietest)
        raise EvaluationError(
            f"a peak of {peak_qpm:g} QPM over a mean of {mean_qpm:g} QPM would need "
            f"{low:.1f} QPM in the trace's quietest minute; the largest peak this trace "
            f"allows at that mean is {largest:.1f} QPM"
        )
    clipped: FloatArray = np.maximum(mapped, 0.0)
    return clipped


def whole_counts(expected: FloatArray) -> IntArray:
    """Whole arrivals per minute: ``expected`` rounded on its running sum (each minute within
    one of its expectation, the total the rounded total)."""
    running = np.floor(np.cumsum(expected) + 0.5)
    counts: IntArray = np.diff(running, prepend=0.0).astype(np.int64)
    return counts


def _fill_minute(
    chunk: FloatArray, count: int, start_s: float, end_s: float, rng: np.random.Generator
) -> FloatArray:
    """``count`` arrival times in [start_s, end_s) from the minute's own ``chunk``."""
    have = chunk.size
    if count <= have:
        keep = np.sort(rng.choice(have, size=count, replace=False))
        kept: FloatArray = chunk[keep]
        return kept
    if have == 0:
        return start_s + rng.random(count) * (end_s - start_s)
    origins = rng.integers(0, have, size=count - have)
    gaps = np.append(chunk[1:], end_s) - chunk
    extra = chunk[origins] + rng.random(origins.size) * gaps[origins]
    return np.concatenate([chunk, extra])


def rescale_to_load(
    workload: Workload,
    mean_qpm: float,
    peak_qpm: float | None = None,
    *,
    seed: int | np.random.Generator = 0,
) -> Workload:
    """``workload`` with mean rate ``mean_qpm`` and, with ``peak_qpm``, busiest minute
    ``peak_qpm``, over the same duration (see the module docstring). The prompts are kept."""
    duration = workload.duration_s
    if duration <= 0.0 or len(workload) == 0:
        raise EvaluationError(f"workload {workload.name!r} is empty: nothing to rescale")
    if not (math.isfinite(mean_qpm) and mean_qpm > 0.0):
        raise EvaluationError(f"mean_qpm: must be > 0, got {mean_qpm!r}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    lengths = minute_lengths(duration)
    arrivals = workload.arrivals_s
    index = np.minimum((arrivals // 60.0).astype(np.int64), lengths.size - 1)
    counts = np.bincount(index, minlength=lengths.size).astype(np.float64)
    targets = target_rates(counts * 60.0 / lengths, lengths, mean_qpm, peak_qpm)
    wanted = whole_counts(targets * lengths / 60.0)
    bounds = np.searchsorted(index, np.arange(lengths.size + 1))
    pieces = [
        _fill_minute(
            arrivals[bounds[m] : bounds[m + 1]],
            int(wanted[m]),
            60.0 * m,
            60.0 * m + float(lengths[m]),
            rng,
        )
        for m in range(lengths.size)
    ]
    out = np.sort(np.concatenate(pieces))
    shape = f"mean {mean_qpm:.1f} QPM" + ("" if peak_qpm is None else f", peak {peak_qpm:.1f}")
    return Workload(
        workload.name,
        out,
        workload.prompts,
        f"{workload.source}; per-minute rate mapped to {shape}",
        horizon_s=duration,
    )
