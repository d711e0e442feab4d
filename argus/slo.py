"""The latency objective everyone judges requests by when none is given: one rule.

The allocator plans queueing headroom against it, the router counts violations and sets
deadlines with it, ``argus plan`` prints it, the simulator and the live replay judge runs by
it. Each used to compute "3 × the best level's latency" itself; a change to one would have
made the simulator judge by another objective than the services plan for. This module imports
only :mod:`argus.defaults` and the profile types, so every side may import it.
"""

from __future__ import annotations

from collections.abc import Iterable

from argus import defaults
from argus.types import ProfileSet


def default_slo_s(
    profiles: ProfileSet, classes: Iterable[str], factor: float | None = None
) -> float:
    """``factor`` (None: :data:`argus.defaults.SLO_FACTOR`, read now) × the best level's
    latency on the slowest of the GPU ``classes``, seconds.

    The services pass the profile's first class (``profiles.worker_classes[:1]``); the
    simulator the classes its cluster has, so a mixed cluster's objective is one its slowest
    GPUs can meet. ValueError when ``classes`` is empty."""
    unit = max((profiles.best_latency_s(c) for c in classes), default=None)
    if unit is None:
        raise ValueError("classes: no GPU class to take the SLO's unit from")
    return (defaults.SLO_FACTOR if factor is None else factor) * unit
