"""SYNTHETIC editing workload and its serving physics on a simulated cluster.

Workload (:func:`make_edit_workload`), every part SYNTHETIC:

* arrivals: a Poisson process at a given rate;
* templates: :data:`TEMPLATES` (970, the count in InstGenIE's production trace, §2.2: 34 M
  images from 970 templates, each reused 35,000 times on average) with Zipf popularity,
  P(rank k) ∝ k^(−s). The paper gives no skew; ``s`` = :data:`ZIPF_S` (1.0) is our assumption,
  under which the most popular template takes 13 % of the edits and the top 10 take 39 %;
* mask ratios: Beta with the paper's mean (Fig. 3: 0.11 in the production trace, 0.19 in the
  public one) and concentration α + β = :data:`BETA_CONCENTRATION` (4, our choice: the
  histograms are skewed to small ratios with a long tail; the paper gives no table), clipped
  to [:data:`MIN_RATIO`, 1];
* an optional share of text-to-image requests (no template, ratio 1: a full run).

Physics (:class:`EditCluster`): each worker runs a :class:`ContinuousBatch` (step-level
continuous batching, bound ``B``; or, with ``static=True``, the same policy code's static
batching, InstGenIE's baseline) and prices each step with the :class:`EditCostModel`
(``a + p·b + c·Σm``). An edit's effective ratio is fixed when it joins: its mask ratio if the
worker then holds the template's record (a hit), 1 otherwise (a miss, which records the
template when it finishes; the worker keeps at most ``cache_templates`` records, least recently
used out). Arrivals are placed by a balancer from :mod:`argus.router.edit_balance` on snapshots
of the workers taken at the arrival instant.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from argus.profiles.edit_cost import EditCostModel
from argus.router.edit_balance import EditBalancer, EditJob, WorkerEdit, WorkerSnapshot
from argus.worker.editing.scheduler import BatchEntry, ContinuousBatch, Running

TEMPLATES = 970  # InstGenIE §2.2: templates in the production trace
ZIPF_S = 1.0  # our assumption: the paper gives no popularity skew
MASK_MEANS = {"production": 0.11, "public": 0.19}  # InstGenIE Fig. 3
BETA_CONCENTRATION = 4.0  # α + β of the mask-ratio Beta (our choice)
MIN_RATIO = 0.01  # a region covers at least a token or so
STEPS = 50  # denoising steps of an edit (diffusers' default for SD-1.5 / SDXL)
BATCH_BOUND = 8  # InstGenIE §6.2's bound for SDXL and Flux (4 for SD-2.1)
CACHE_TEMPLATES = 64  # template records a worker holds (our assumption)


class StepPrice(Protocol):
    """What prices a step: the cost model's fit, or a measured curve's points
    (:meth:`argus.profiles.batch_curve.BatchCurve.step_s`)."""

    def step_s(self, batch: int, mask_sum: float) -> float: ...


@dataclass(frozen=True)
class EditRequest:
    """One request of the SYNTHETIC editing workload."""

    index: int
    arrival_s: float
    mask_ratio: float  # 1 for a text-to-image request
    template: int | None  # popularity rank (0 most popular); None for text to image
    steps: int = STEPS


@dataclass(frozen=True)
class EditWorkloadConfig:
    """How :func:`make_edit_workload` draws requests."""

    rate_per_s: float
    duration_s: float
    masks: str = "production"  # "production" (mean 0.11) or "public" (0.19)
    templates: int = TEMPLATES
    zipf_s: float = ZIPF_S
    text_to_image_share: float = 0.0  # share of requests that are generations
    steps: int = STEPS

    def __post_init__(self) -> None:
        if self.masks not in MASK_MEANS:
            known = ", ".join(MASK_MEANS)
            raise ValueError(f"unknown mask distribution {self.masks!r}; known: {known}")
        if not (self.rate_per_s > 0 and self.duration_s > 0):
            raise ValueError(
                f"rate and duration must be > 0, got {self.rate_per_s!r}, {self.duration_s!r}"
            )
        if not 0.0 <= self.text_to_image_share <= 1.0:
            raise ValueError(
                f"text_to_image_share must be in [0, 1], got {self.text_to_image_share!r}"
            )
        if self.templates < 1 or self.steps < 1:
            raise ValueError(
                f"templates and steps must be >= 1, got {self.templates}, {self.steps}"
            )


def zipf_weights(templates: int, s: float) -> np.ndarray:
    """Popularity of each template rank, summing to 1: ∝ (rank + 1)^(−s)."""
    weights: np.ndarray = np.arange(1, templates + 1, dtype=np.float64) ** (-s)
    normalized: np.ndarray = weights / weights.sum()
    return normalized


def beta_parameters(mean: float, concentration: float = BETA_CONCENTRATION) -> tuple[float, float]:
    """(α, β) of the Beta with ``mean`` and α + β = ``concentration``."""
    return mean * concentration, (1.0 - mean) * concentration


def draw_mask_ratios(masks: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` mask ratios of the named distribution (Beta, clipped to [MIN_RATIO, 1])."""
    alpha, beta = beta_parameters(MASK_MEANS[masks])
    ratios: np.ndarray = np.clip(rng.beta(alpha, beta, size=count), MIN_RATIO, 1.0)
    return ratios


def make_edit_workload(config: EditWorkloadConfig, seed: int) -> tuple[EditRequest, ...]:
    """The requests of one SYNTHETIC run, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(config.rate_per_s * config.duration_s))
    arrivals = np.sort(rng.uniform(0.0, config.duration_s, size=count))
    templates = rng.choice(
        config.templates, size=count, p=zipf_weights(config.templates, config.zipf_s)
    )
    ratios = draw_mask_ratios(config.masks, count, rng)
    generation = rng.random(count) < config.text_to_image_share
    return tuple(
        EditRequest(
            i,
            float(arrivals[i]),
            1.0 if generation[i] else float(ratios[i]),
            None if generation[i] else int(templates[i]),
            config.steps,
        )
        for i in range(count)
    )


def lru_hit_rate(templates: int, zipf_s: float, cache_templates: int) -> float:
    """Hit rate of one worker's LRU of ``cache_templates`` records when it sees the whole
    popularity (Che's approximation: template i stays for a characteristic time T with
    Σ(1 − e^(−p_i·T)) = C and hits with probability 1 − e^(−p_i·T)). A balancer blind to
    templates reaches about this on every worker; one that keeps templates on their holders
    reaches more. Capacity uses it."""
    weights = zipf_weights(templates, zipf_s)
    if cache_templates >= templates:
        return 1.0
    if cache_templates <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while np.sum(1.0 - np.exp(-weights * high)) < cache_templates:
        high *= 2.0
    for _ in range(100):
        mid = (low + high) / 2.0
        if np.sum(1.0 - np.exp(-weights * mid)) < cache_templates:
            low = mid
        else:
            high = mid
    return float(np.sum(weights * (1.0 - np.exp(-weights * high))))


def capacity_per_s(
    model: EditCostModel,
    *,
    workers: int,
    bound: int,
    steps: int,
    mean_ratio: float,
    hit_rate: float,
) -> float:
    """Edits a second the cluster serves with every batch full, each edit at the mean effective
    ratio ``h·m̄ + (1 − h)``: ``workers · B / (steps · t(B, B·m_eff))``."""
    effective = hit_rate * mean_ratio + (1.0 - hit_rate)
    return workers * bound / (steps * model.step_s(bound, bound * effective))


@dataclass(frozen=True)
class EditOutcome:
    """What happened to one request."""

    index: int
    arrival_s: float
    joined_s: float  # when it joined a running batch
    finished_s: float
    worker: int
    hit: bool  # ran on a held record
    mask_ratio: float

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def queueing_s(self) -> float:
        return self.joined_s - self.arrival_s


class _Worker:
    """One simulated worker: a continuous batch, an LRU of template records, a step clock."""

    def __init__(self, bound: int, cache_templates: int, static: bool) -> None:
        self.batch = ContinuousBatch(bound, static=static)
        self.records: OrderedDict[Hashable, None] = OrderedDict()
        self.cache_templates = cache_templates
        self.step_ends_s: float | None = None  # end of the step in progress; None: idle
        self.jobs: dict[int, EditRequest] = {}
        self.joined: dict[int, float] = {}  # when each running edit joined
        self.hits: dict[int, bool] = {}  # whether each running edit found its record
        self.steps = 0  # batched steps run
        self.rows = 0  # edits summed over those steps (mean batch = rows / steps)

    def snapshot(self, now: float) -> WorkerSnapshot:
        running = tuple(
            WorkerEdit(_job(self.jobs[int(r.entry.key)]), r.steps_left, r.effective_ratio)  # type: ignore[call-overload]
            for r in self.batch.running
        )
        waiting = tuple(
            WorkerEdit(_job(self.jobs[int(e.key)]), e.steps)  # type: ignore[call-overload]
            for e in self.batch.waiting
        )
        left = 0.0 if self.step_ends_s is None else max(0.0, self.step_ends_s - now)
        return WorkerSnapshot(running, waiting, frozenset(self.records), self.batch.bound, left)

    def effective_ratio(self, entry: BatchEntry) -> float:
        """At joining: the edit's ratio on a hit (the record touched), 1 on a miss."""
        template = self.jobs[int(entry.key)].template  # type: ignore[call-overload]
        hit = template is not None and template in self.records
        self.hits[int(entry.key)] = hit  # type: ignore[call-overload]
        if hit:
            self.records.move_to_end(template)
            return entry.mask_ratio
        return 1.0

    def finish(self, done: Running, worker: int, now: float) -> EditOutcome:
        """An edit ran its last step: a miss leaves its template recorded."""
        index = int(done.entry.key)  # type: ignore[call-overload]
        request = self.jobs.pop(index)
        hit = self.hits.pop(index)
        if not hit:
            self.record(request.template)
        joined = self.joined.pop(index)
        return EditOutcome(index, request.arrival_s, joined, now, worker, hit, request.mask_ratio)

    def record(self, template: int | None) -> None:
        if template is None or self.cache_templates <= 0:
            return
        self.records[template] = None
        self.records.move_to_end(template)
        while len(self.records) > self.cache_templates:
            self.records.popitem(last=False)


def _job(request: EditRequest) -> EditJob:
    return EditJob(request.mask_ratio, request.steps, request.template)


class EditCluster:
    """``workers`` simulated workers serving edits placed by a balancer; each batches
    continuously, or statically with ``static=True``."""

    def __init__(
        self,
        model: StepPrice,
        balancer: EditBalancer,
        *,
        workers: int = 8,
        bound: int = BATCH_BOUND,
        cache_templates: int = CACHE_TEMPLATES,
        static: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        self.model = model
        self.balancer = balancer
        self.workers = [_Worker(bound, cache_templates, static) for _ in range(workers)]

    def run(self, requests: Sequence[EditRequest]) -> list[EditOutcome]:
        """Serve ``requests`` (sorted by arrival) to the end; the outcomes in request order."""
        # (time, kind: 0 a worker's step ends / 1 an arrival, tie-break, worker or request)
        events: list[tuple[float, int, int, int]] = [
            (r.arrival_s, 1, r.index, r.index) for r in requests
        ]
        heapq.heapify(events)
        by_index = {r.index: r for r in requests}
        outcomes: dict[int, EditOutcome] = {}
        seq = len(requests)
        while events:
            now, kind, _, ident = heapq.heappop(events)
            if kind == 1:
                request = by_index[ident]
                snapshots = [w.snapshot(now) for w in self.workers]
                target = self.balancer.choose(_job(request), snapshots)
                worker = self.workers[target]
                worker.jobs[request.index] = request
                worker.batch.submit(BatchEntry(request.index, request.steps, request.mask_ratio))
                if worker.step_ends_s is not None:
                    continue  # it joins at the step's end
            else:
                target, worker = ident, self.workers[ident]
                for done in worker.batch.step():
                    outcomes[int(done.entry.key)] = worker.finish(done, target, now)  # type: ignore[call-overload]
            ends = self._boundary(target, now)
            if ends is not None:
                seq += 1
                heapq.heappush(events, (ends, 0, seq, target))
        return [outcomes[r.index] for r in requests]

    def _boundary(self, index: int, now: float) -> float | None:
        """A step boundary on worker ``index``: admit waiting edits, then start the next step;
        returns when it ends (None: the worker is idle)."""
        worker = self.workers[index]
        for running in worker.batch.join(worker.effective_ratio):
            worker.joined[int(running.entry.key)] = now  # type: ignore[call-overload]
        if len(worker.batch) == 0:
            worker.step_ends_s = None
        else:
            worker.step_ends_s = now + self.model.step_s(len(worker.batch), worker.batch.mask_sum())
            worker.steps += 1
            worker.rows += len(worker.batch)
        return worker.step_ends_s
