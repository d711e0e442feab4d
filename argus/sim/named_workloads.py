"""The workload ``argus replay --trace NAME`` replays: a named arrival process or a trace file.

Defaults of :func:`workload_by_name` (the ``--trace`` names of ``argus replay``) are chosen for
an 8-GPU cluster that serves about 110 QPM at full quality and 220 QPM at its fastest level:

* ``azure``: the recorded hour, about 330 QPM on average: it overloads such a cluster unless
  ``--scale`` is about 0.5 or less.
* ``bursty``: 60 minutes in 10-minute periods of 7 minutes at 60 QPM then 3 minutes at
  180 QPM: the low phase fits at full quality, the bursts only with approximation (they stay
  below the fastest level's capacity, so a policy that scales in time can keep up).
* ``ramp``: 50 → 600 QPM over 800 minutes: crosses both capacities.
* ``gamma``: 150 QPM, CV 2, 60 minutes; ``poisson``: 150 QPM, 60 minutes. Both need
  approximation on average but fit at the fastest level; they differ only in burstiness.

These capacities are without adapters (``argus replay --adapters none``). With Katz's adapter
mix (``--adapters katz``, the replay default; :mod:`argus.sim.adapters`) every level is
slower: about 102 QPM at full quality and 180 QPM at the fastest level (tiny-sd; 156 at
ac-k25), so ``bursty``'s 180 QPM bursts reach the fastest level's capacity and queue.

``scale`` multiplies every rate. ``duration_min`` sets the length of a synthetic workload; for
a recorded trace it plays the trace's shape over that many minutes at the same load level
(time stretch ``d``, rate scale ``d``, both relative to the trace's own length). Stretching
magnifies the trace's structure too: what happened within a few seconds of the recorded hour
spans a minute of an 800-minute replay, so minute-to-minute rates vary more than in the
recording (per-minute standard deviation about 105 QPM around the mean of 331 at 800 minutes).
"""

from __future__ import annotations

from pathlib import Path

from argus.sim.arrivals import (
    BURSTY_HIGH_FRACTION,
    BURSTY_HIGH_QPM,
    BURSTY_LOW_QPM,
    BURSTY_PERIOD_MIN,
    DEFAULT_DURATION_MIN,
    GAMMA_CV,
    RAMP_DURATION_MIN,
    RAMP_END_QPM,
    RAMP_START_QPM,
    STEADY_QPM,
    azure_trace,
    bursty,
    gamma_arrivals,
    poisson,
    ramp,
    rescale,
)
from argus.sim.trace_files import load_workload
from argus.sim.workloads import (
    SeedLike,
    Workload,
    WorkloadError,
    load_prompt_file,
    positive_argument,
)

KNOWN_WORKLOADS = ("azure", "bursty", "ramp", "gamma", "poisson")


def _fit(workload: Workload, scale: float, duration_min: float | None, seed: SeedLike) -> Workload:
    """Apply ``--scale`` and ``--duration`` to a recorded trace (see the module docstring)."""
    stretch = 1.0
    if duration_min is not None:
        if workload.duration_s <= 0.0:
            raise WorkloadError(
                f"workload {workload.name!r} lasts 0 s: it cannot be stretched to "
                f"{duration_min:g} min"
            )
        stretch = duration_min * 60.0 / workload.duration_s
    if scale == 1.0 and stretch == 1.0:
        return workload
    return rescale(workload, rate_scale=scale * stretch, time_stretch=stretch, seed=seed)


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or Path(name).suffix != "" or Path(name).exists()


def workload_by_name(
    name: str,
    *,
    duration_min: float | None = None,
    scale: float = 1.0,
    seed: int = 0,
    prompts_path: str | Path | None = None,
) -> Workload:
    """The workload ``argus replay --trace NAME`` replays.

    ``name`` is one of :data:`KNOWN_WORKLOADS` or the path of a trace file. ``scale``
    multiplies the rate, ``duration_min`` sets the length (see the module docstring for the
    defaults and for what both do to a recorded trace); ``prompts_path`` replaces the prompts.
    """
    rate = positive_argument("scale", scale)
    minutes = None if duration_min is None else positive_argument("duration_min", duration_min)
    prompts = None if prompts_path is None else load_prompt_file(prompts_path)
    key = name.strip().lower()
    if key == "azure":
        return _fit(azure_trace(prompts=prompts), rate, minutes, seed)
    if key == "bursty":
        return bursty(
            minutes or DEFAULT_DURATION_MIN,
            BURSTY_LOW_QPM * rate,
            BURSTY_HIGH_QPM * rate,
            BURSTY_PERIOD_MIN,
            BURSTY_HIGH_FRACTION,
            seed,
            prompts=prompts,
        )
    if key == "ramp":
        return ramp(
            RAMP_START_QPM * rate,
            RAMP_END_QPM * rate,
            minutes or RAMP_DURATION_MIN,
            seed,
            prompts=prompts,
        )
    if key == "gamma":
        return gamma_arrivals(
            STEADY_QPM * rate, GAMMA_CV, minutes or DEFAULT_DURATION_MIN, seed, prompts=prompts
        )
    if key == "poisson":
        return poisson(STEADY_QPM * rate, minutes or DEFAULT_DURATION_MIN, seed, prompts=prompts)
    if _looks_like_path(name):
        return _fit(load_workload(name, prompts), rate, minutes, seed)
    raise WorkloadError(
        f"unknown workload {name!r}: expected one of {', '.join(KNOWN_WORKLOADS)}, "
        "or the path of a trace file"
    )
