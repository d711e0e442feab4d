"""SLO-aware admission for the router (LegoDiffusion §5.3).

Pure control-plane code: no grpc. A request is priced by :func:`request_cost`: pixels ×
steps relative to the profile's reference request, so a level's profiled latency times the
cost is what the request takes there (a 2048 × 2048, 1000-step request costs 80 reference
requests). The service checks twice. Before classifying, :func:`earliest_completion_s` over
the live workers (each at the cheapest level it could serve the request at, with its queue)
refuses what cannot finish in time anyway, so a refusal never waits for the classifier.
After routing, :func:`admit` gets the chosen worker's predicted completion time
(``RouteDecision.score``: (queue + 1) × t_proc, scaled by the cost) and rejects at once what
cannot finish before the deadline instead of queueing it without bound.

The request-id ledger, which makes retries idempotent, is ``argus/router/ledger.py``.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from argus.types import ReferenceRequest


@dataclass(frozen=True)
class AdmissionDecision:
    """Whether a routed request may go to its worker."""

    admitted: bool
    predicted_s: float  # predicted completion time on the chosen worker, seconds
    budget_s: float  # time left before the request's deadline, seconds
    retry_after_s: float  # when rejected: the predicted excess, a hint for the client's retry


def predicted_completion_s(queue_length: int, t_proc_s: float) -> float:
    """Seconds until a request routed now to a worker would finish there: ``(queue_length + 1)
    × t_proc_s``, the requests ahead of it plus itself, each taking the level's profiled
    latency on that worker's class.

    This is the scheduler's Eq. 3 score (``RouteDecision.score``); the simulator calls it to
    predict what the router predicts, so both admit the same requests.
    """
    return (queue_length + 1) * t_proc_s


@dataclass(frozen=True)
class AdmissionRule:
    """How sure the router must be that a request finishes in time before admitting it.

    The prediction ``(queue + 1) × t_proc`` charges the request in service a whole
    ``t_proc`` although part of it has run, and it is a mean: under overload admission fills
    every queue up to the deadline, so a request admitted on the mean finishes late whenever
    the services ahead of it run long. With adapters (ControlNet, LoRA loads) service times at
    one level spread enough that 8% of the admitted requests came in late in simulation at
    1.5 × capacity. The rule predicts the completion from what is known and admits on a
    quantile:

    * the request in service has ``t_proc − elapsed`` left (at least 0), where ``elapsed`` is
      how long it has run (a worker serves its queue in order, so it started when the one
      before it finished, which the router sees);
    * the ``n = queue + 1`` services still to run, each with squared coefficient of variation
      ``service_scv``, add a standard deviation of ``t_proc·√(scv·n)``, and the completion must
      fit the budget at the ``confidence`` quantile of the normal with those moments.
    """

    service_scv: float = 0.05
    """Squared coefficient of variation of one request's service time at a level (Katz's
    adapter mix on the default profile gives 0.02 to 0.07, most of it the rare LoRA load)."""

    confidence: float = 0.9
    """Probability the admitted request's completion fits the budget, by the normal model."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.service_scv) and self.service_scv >= 0.0):
            raise ValueError(f"service_scv: must be a finite number >= 0, got {self.service_scv}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence: must be in [0.5, 1), got {self.confidence}")

    @functools.cached_property
    def _z(self) -> float:
        """The normal quantile of ``confidence``, once per rule (admission runs per request)."""
        return statistics.NormalDist().inv_cdf(self.confidence)

    def completion_s(
        self, queue_length: int, t_proc_s: float, head_elapsed_s: float = 0.0
    ) -> float:
        """The ``confidence`` quantile of the completion time of a request routed now to a
        worker with ``queue_length`` requests (the one in service included, which has run for
        ``head_elapsed_s``), each taking ``t_proc_s``."""
        n = queue_length + 1
        done = min(max(head_elapsed_s, 0.0), t_proc_s) if queue_length else 0.0
        spread = self._z * t_proc_s * math.sqrt(self.service_scv * n)
        return predicted_completion_s(queue_length, t_proc_s) - done + spread


def admit(
    predicted_s: float, budget_s: float, *, min_retry_after_s: float = 0.05
) -> AdmissionDecision:
    """Admit when ``predicted_s`` fits in ``budget_s``; otherwise reject with a retry hint.

    The hint is the predicted excess (the queue must drain that much before the request
    would fit), at least ``min_retry_after_s``.
    """
    if predicted_s <= budget_s:
        return AdmissionDecision(True, predicted_s, budget_s, 0.0)
    excess = max(predicted_s - max(budget_s, 0.0), min_retry_after_s)
    return AdmissionDecision(False, predicted_s, budget_s, excess)


def request_cost(
    width: int | None, height: int | None, steps: int | None, reference: ReferenceRequest
) -> float:
    """What one request costs in units of the profile's reference request: its pixels × its
    steps over the reference's. A field the request leaves to the worker's default is priced
    at the reference's value (cost 1 in that dimension): the profile's latencies are what the
    router knows of a default request."""
    pixels = (width or reference.width) * (height or reference.height)
    return (
        pixels / (reference.width * reference.height) * (steps or reference.steps) / reference.steps
    )


@dataclass(frozen=True)
class WorkerLoad:
    """One live worker as the pre-classification check sees it (a snapshot, under the
    router's lock)."""

    queue_length: int  # the router's requests waiting or running there
    t_proc_s: float  # this request's service time there: the cheapest level it can serve × cost
    head_elapsed_s: float = 0.0  # how long the request in service has run


def earliest_completion_s(
    rule: AdmissionRule, workers: Sequence[WorkerLoad], ahead: int = 0
) -> tuple[float, float]:
    """``(loaded, idle)``: the earliest completion of a request over ``workers`` by ``rule``
    with their queues, and with every queue empty (what no wait can beat). ``ahead`` requests
    already passed this check and are being classified: they will take about
    ``ahead / len(workers)`` services of the cheapest worker first. ``(inf, inf)`` without
    workers."""
    if not workers:
        return math.inf, math.inf
    idle = min(rule.completion_s(0, w.t_proc_s) for w in workers)
    loaded = min(rule.completion_s(w.queue_length, w.t_proc_s, w.head_elapsed_s) for w in workers)
    cheapest = min(w.t_proc_s for w in workers)
    return loaded + ahead * cheapest / len(workers), idle
