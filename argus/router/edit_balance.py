"""Which worker gets an edit: the edit load balancers, over a snapshot of the workers' states
(pure; no grpc, no clock), so the simulator and the router run the same code.

* ``mask-aware`` (InstGenIE §4.4, Algorithm 2): the worker where the new edit would finish
  first, predicted with the edit cost model (:mod:`argus.profiles.edit_cost`) by playing the
  worker's running batch and queue forward step by step in batches (:func:`predict_finish_s`).
  A worker that holds the template's record runs the edit at its mask ratio, any other in full
  (a miss records the template), so the holder wins unless its queue makes it later.
* ``least-requests``: fewest edits running and waiting (InstGenIE's request-granularity
  baseline).
* ``least-tokens``: least masked work running and waiting, Σ mask ratio × the latent's tokens
  (the token-granularity baseline: it counts an edit's region, not whether it will miss).
* ``round-robin``: each worker in turn.
* ``mask-only`` (an ablation, not in the default set): mask-aware's prediction with no
  knowledge of the records: every waiting edit, the new one too, priced at its mask ratio, as
  if every worker held every template. It separates what the cost model buys from what
  sending a template to its holder buys.

Ties go to the lowest index after a rotating start, so an idle cluster spreads its edits.
:func:`make_balancer` picks one by name and rejects unknown names, quoting them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from argus.profiles.edit_cost import EditCostModel

BALANCERS = ("mask-aware", "least-requests", "least-tokens", "round-robin")
ABLATIONS = ("mask-only",)  # mask-aware's cost model blind to the workers' records
LATENT_TOKENS = 64 * 64  # a 512 × 512 image's latent; least-tokens scales by it


@dataclass(frozen=True)
class EditJob:
    """An edit (or a generation: ``template`` None, ratio 1) to place."""

    mask_ratio: float  # share of the image's tokens in the region
    steps: int  # denoising steps it runs
    template: Hashable = None  # the template's key (its digest); None: nothing to reuse


@dataclass(frozen=True)
class WorkerEdit:
    """An edit on a worker: running (``effective_ratio`` known) or waiting (None)."""

    job: EditJob
    steps_left: int  # steps still to run, the one in progress included
    effective_ratio: float | None = None


@dataclass(frozen=True)
class WorkerSnapshot:
    """What a balancer knows of one worker when an edit arrives."""

    running: tuple[WorkerEdit, ...] = ()  # the running batch
    waiting: tuple[WorkerEdit, ...] = ()  # its queue, first in first
    templates: frozenset[Hashable] = field(default_factory=frozenset)  # records it holds
    bound: int = 1  # its batch bound
    step_left_s: float = 0.0  # seconds until its current step ends (0: idle)
    scale: float = 1.0  # its steps take this many times the cost model's (a slower worker: > 1)

    @property
    def edits(self) -> int:
        return len(self.running) + len(self.waiting)


class EditBalancer(Protocol):
    name: str

    def choose(self, job: EditJob, workers: Sequence[WorkerSnapshot]) -> int:
        """The index of the worker that gets ``job``."""
        ...


def predict_finish_s(
    job: EditJob | None, worker: WorkerSnapshot, model: EditCostModel, *, records: bool = True
) -> float:
    """Seconds from now until ``job``, queued last on ``worker``, finishes (``job`` None: until
    the worker has nothing left). The running batch and the queue are played forward with the
    worker's own rules: first come first joins at step boundaries up to the bound, a waiting
    edit runs at its mask ratio if the worker holds its template's record by the time it joins
    (held now, or recorded meanwhile by an earlier miss that finished) and in full otherwise.
    With ``records`` False every waiting edit is priced at its mask ratio. Every step after the
    current one costs ``worker.scale`` × the model's (the live router's workers differ in speed;
    the simulator's run at 1)."""
    held = set(worker.templates)
    running: list[list[float]] = []  # [steps_left, effective ratio, index in order]
    order = list(worker.waiting) + ([WorkerEdit(job, job.steps)] if job is not None else [])
    target = len(order) - 1 if job is not None else None
    recording: dict[int, Hashable] = {}
    for k, edit in enumerate(worker.running):
        ratio = edit.effective_ratio if edit.effective_ratio is not None else 1.0
        running.append([float(edit.steps_left), ratio, float(-1 - k)])
        if ratio >= 1.0 and edit.job.template is not None:  # a miss: it records the template
            recording[-1 - k] = edit.job.template
    now = worker.step_left_s if running else 0.0
    if running:  # the current step ends first: count it
        for item in running:
            item[0] -= 1
    next_index = 0
    while True:
        finished = [item for item in running if item[0] <= 0]
        for item in finished:
            index = int(item[2])
            if index == target:
                return now
            if index in recording:
                held.add(recording.pop(index))
        running = [item for item in running if item[0] > 0]
        while next_index < len(order) and len(running) < worker.bound:
            edit = order[next_index]
            hit = edit.job.template is not None and (not records or edit.job.template in held)
            ratio = edit.job.mask_ratio if hit else 1.0
            if not hit and edit.job.template is not None:
                recording[next_index] = edit.job.template
            running.append([float(edit.steps_left), ratio, float(next_index)])
            next_index += 1
        if not running:
            return now
        steps = min(item[0] for item in running)
        step_s = model.step_s(len(running), sum(item[1] for item in running)) * worker.scale
        now += steps * step_s
        for item in running:
            item[0] -= steps


class _Rotating:
    """The lowest score wins; ties go to the first after a start that moves on each pick."""

    def __init__(self) -> None:
        self._start = 0

    def _pick(self, scores: Sequence[float]) -> int:
        if not scores:
            raise ValueError("no worker to choose from")
        n = len(scores)
        best = min(range(n), key=lambda k: (scores[(self._start + k) % n], k))
        chosen = (self._start + best) % n
        self._start = (chosen + 1) % n
        return chosen


class MaskAwareBalancer(_Rotating):
    """Algorithm 2: the least predicted completion of the new edit."""

    def __init__(self, model: EditCostModel, *, records: bool = True) -> None:
        super().__init__()
        self.model = model
        self.records = records
        self.name = "mask-aware" if records else "mask-only"

    def choose(self, job: EditJob, workers: Sequence[WorkerSnapshot]) -> int:
        return self._pick(
            [predict_finish_s(job, w, self.model, records=self.records) for w in workers]
        )


class LeastRequestsBalancer(_Rotating):
    name = "least-requests"

    def choose(self, job: EditJob, workers: Sequence[WorkerSnapshot]) -> int:
        return self._pick([float(w.edits) for w in workers])


class LeastTokensBalancer(_Rotating):
    name = "least-tokens"

    def __init__(self, latent_tokens: int = LATENT_TOKENS) -> None:
        super().__init__()
        self.latent_tokens = latent_tokens

    def choose(self, job: EditJob, workers: Sequence[WorkerSnapshot]) -> int:
        return self._pick([self.tokens(w) for w in workers])

    def tokens(self, worker: WorkerSnapshot) -> float:
        """Masked tokens running and waiting on ``worker``."""
        edits = worker.running + worker.waiting
        return float(sum(math.ceil(e.job.mask_ratio * self.latent_tokens) for e in edits))


class RoundRobinBalancer:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, job: EditJob, workers: Sequence[WorkerSnapshot]) -> int:
        if not workers:
            raise ValueError("no worker to choose from")
        chosen = self._next % len(workers)
        self._next = chosen + 1
        return chosen


def make_balancer(name: str, model: EditCostModel) -> EditBalancer:
    """The balancer called ``name`` (one of :data:`BALANCERS` or :data:`ABLATIONS`)."""
    if name == "mask-aware":
        return MaskAwareBalancer(model)
    if name == "mask-only":
        return MaskAwareBalancer(model, records=False)
    if name == "least-requests":
        return LeastRequestsBalancer()
    if name == "least-tokens":
        return LeastTokensBalancer()
    if name == "round-robin":
        return RoundRobinBalancer()
    known = ", ".join(BALANCERS + ABLATIONS)
    raise ValueError(f"unknown balancer {name!r}; known: {known}")
