"""What the live router knows of each worker's edits: :class:`EditLoads`.

The edit balancers (:mod:`argus.router.edit_balance`) decide on a
:class:`~argus.router.edit_balance.WorkerSnapshot` per worker: its running batch, its queue,
the templates whose records it holds and how long its current step has left. The simulator
reads those from its simulated workers; the live router cannot see inside a worker, so it keeps
its own account of what it sent, here:

* **in flight**: every request this router sent to a worker and has not had answered, in the
  order sent, as an :class:`~argus.router.edit_balance.EditJob` (an inpainting edit: its mask
  ratio, steps and template key; any other request, a generation or img2img: ratio 1, no
  template), with when it became one of the worker's running batch. The first ``bound`` in
  flight are taken as running (the worker joins first come first, up to its
  ``--edit-batch``), the rest as waiting;
* **templates held**: a template is believed held by a worker once an edit of it on that worker
  was answered OK (its first run recorded it there), kept in a bounded LRU per worker (the
  worker's own store evicts too, by bytes; a belief it outlived makes one edit a full run,
  which the worker reports as ``evicted``, never an error).

The same cost model weighs an inpainting edit in the allocator's demand
(:func:`arrival_cost`: its share of a batched step against one full edit alone), so the
allocator plans each level's capacity for what edits cost the batching workers, not one full
request each.

A running edit's steps left are estimated from how long it has run and the batch's step time
(:func:`worker_snapshot`): the router sees no step events of a plain Generate call. The
template key (:func:`template_key`) is the worker's (``EditCache.key``) as far as the router
knows it. Pure: no clock (times come in), no lock (the router calls it under its own).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from argus.profiles.edit_cost import EditCostModel
from argus.router.edit_balance import EditJob, WorkerEdit, WorkerSnapshot


def template_key(
    digest: str, width: int, height: int, steps: int | None, guidance_scale: float | None
) -> str:
    """The record key of an inpainting edit as the router can build it: the template's digest
    (:attr:`~argus.request_limits.EditInput.template_digest`), its size, its steps and its CFG
    mode, as the worker's ``EditCache.key`` names them. ``steps`` or ``guidance_scale`` None
    (the worker's default) is named "default", one key per deployment's default.

    It omits the worker's model and scheduler (the level's, unknown to the request): beliefs
    are per worker, and a worker whose level's model changes at a plan is forgotten
    (:meth:`EditLoads.forget_templates`). A request's CFG mode is "cfg2" above a guidance of 1,
    "cfg1" at or below it, "cfg-default" without one (the worker resolves it from its model's
    default, which the router does not know)."""
    shown_steps = "default" if steps is None else str(steps)
    cfg = "cfg-default"
    if guidance_scale is not None:
        cfg = "cfg2" if guidance_scale > 1.0 else "cfg1"
    return ":".join((digest, f"{width}x{height}", shown_steps, cfg))


def time_scale(model: EditCostModel, full_alone_s: float, steps: int) -> float:
    """The factor that makes ``model``'s run of one edit in full, alone, over ``steps`` steps
    take ``full_alone_s``: a worker's learned service time of the request (its fixed part, text
    encoding and decoding, spread over the steps) gives the cost model its seconds on that
    worker. 1 when either is not a positive finite time."""
    reference = model.alone_s(1.0, max(steps, 1))
    if not (reference > 0.0 and math.isfinite(full_alone_s) and full_alone_s > 0.0):
        return 1.0
    return full_alone_s / reference


def arrival_cost(model: EditCostModel, bound: int, ratio: float) -> float:
    """An inpainting edit's weight in the allocator's demand, in full requests: its share of a
    batched step against one full edit alone, ``step_s(b, b·m) / b / step_s(1, 1)``, with ``b``
    the workers' batch bound and ``m`` its effective mask ratio (its mask ratio on a believed
    hit, 1 on a miss), priced by the edit cost model (InstGenIE §4.4). In (0, 1]: 1 with
    ``b = 1`` and ``m = 1``; below 1 with a batch (the step's fixed part is shared) or a hit
    (only the region's tokens run in the blocks). 1 where the model prices nothing."""
    bound = max(1, bound)
    ratio = min(1.0, max(0.0, ratio))
    full = model.step_s(1, 1.0)
    if not (full > 0.0 and math.isfinite(full)):
        return 1.0
    return min(1.0, model.step_s(bound, bound * ratio) / bound / full)


@dataclass(frozen=True)
class InFlightEdit:
    """One request a worker has not answered yet, as the router sent it."""

    job: EditJob
    hit: bool  # its template was believed held when it was sent: it runs at its mask ratio
    running_s: float | None  # how long it has been in the worker's running batch; None: waiting


@dataclass(frozen=True)
class WorkerEdits:
    """A worker's requests in flight from this router, in the order sent, and the templates
    it is believed to hold."""

    in_flight: tuple[InFlightEdit, ...] = ()
    templates: frozenset[Hashable] = frozenset()


NO_EDITS = WorkerEdits()


def worker_snapshot(
    edits: WorkerEdits, bound: int, model: EditCostModel, scale: float = 1.0
) -> WorkerSnapshot:
    """The balancers' view of a worker from the router's account: the edits that run (those
    with ``running_s``) with their steps left estimated as their steps less the whole steps of
    the running batch's step time (``scale`` × the model's) that fit in ``running_s`` (at least
    the one in progress), the head's step ending after what is left of its current step; the
    rest wait, in full steps. Its bound is the workers' ``bound``."""
    running = [e for e in edits.in_flight if e.running_s is not None]
    waiting = [e for e in edits.in_flight if e.running_s is None]
    ratios = [e.job.mask_ratio if e.hit else 1.0 for e in running]
    step_s = model.step_s(len(running), sum(ratios)) * scale
    shown_running = []
    for edit, ratio in zip(running, ratios, strict=True):
        assert edit.running_s is not None
        done = int(edit.running_s // step_s) if step_s > 0.0 else 0
        shown_running.append(WorkerEdit(edit.job, max(1, edit.job.steps - done), ratio))
    step_left_s = 0.0
    if running and step_s > 0.0:
        head = max(e.running_s or 0.0 for e in running)
        step_left_s = step_s - math.fmod(head, step_s)
    return WorkerSnapshot(
        tuple(shown_running),
        tuple(WorkerEdit(e.job, e.job.steps) for e in waiting),
        edits.templates,
        bound,
        step_left_s,
        scale,
    )


@dataclass
class _Sent:
    job: EditJob
    hit: bool
    started_at: float | None  # when it joined the running batch (None: still waiting)


class EditLoads:
    """The router's account of each worker's requests in flight and of the templates each
    holds (see the module docstring). Not thread-safe: the router calls it under its lock."""

    def __init__(self, bound: int, templates: int) -> None:
        if bound < 1 or templates < 0:
            raise ValueError(f"bound >= 1 and templates >= 0, got {bound}, {templates}")
        self.bound = bound  # the workers' batch bound
        self.templates = templates  # templates believed held per worker, at most
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._held: dict[str, OrderedDict[Hashable, None]] = {}

    def sent(self, worker: str, token: int, job: EditJob, now: float) -> bool:
        """``job`` went to ``worker`` under ``token`` (unique while in flight) at ``now``;
        returns whether its template was believed held there (it runs at its mask ratio)."""
        held = self._held.get(worker)
        hit = job.template is not None and held is not None and job.template in held
        if hit and held is not None:
            held.move_to_end(job.template)
        flight = self._sent.setdefault(worker, {})
        started = now if len(flight) < self.bound else None
        flight[token] = _Sent(job, hit, started)
        return hit

    def answered(self, worker: str, token: int, *, ok: bool, now: float) -> None:
        """The call ``token`` to ``worker`` ended at ``now``; ``ok``: with an image (an edit's
        template is believed held there from now on). The first waiting requests join the
        running batch in its place."""
        flight = self._sent.get(worker)
        if flight is None:
            return
        done = flight.pop(token, None)
        if done is None:
            return
        if ok and done.job.template is not None and self.templates > 0:
            held = self._held.setdefault(worker, OrderedDict())
            held[done.job.template] = None
            held.move_to_end(done.job.template)
            while len(held) > self.templates:
                held.popitem(last=False)
        for item in list(flight.values())[: self.bound]:
            if item.started_at is None:
                item.started_at = now

    def view(self, worker: str, now: float) -> WorkerEdits:
        """``worker``'s requests in flight and its templates, as a value."""
        flight = self._sent.get(worker, {})
        held = self._held.get(worker)
        return WorkerEdits(
            tuple(
                InFlightEdit(
                    s.job, s.hit, None if s.started_at is None else max(0.0, now - s.started_at)
                )
                for s in flight.values()
            ),
            frozenset(held) if held else frozenset(),
        )

    def keep(self, workers: Mapping[str, object]) -> None:
        """Forget the workers not in ``workers`` (they left the plan)."""
        self._sent = {w: f for w, f in self._sent.items() if w in workers}
        self._held = {w: h for w, h in self._held.items() if w in workers}

    def held_by_any(self, template: Hashable | None, workers: Iterable[str]) -> bool:
        """Whether one of ``workers`` is believed to hold ``template`` (None: never)."""
        if template is None:
            return False
        return any(template in self._held.get(worker, ()) for worker in workers)

    def forget_templates(self, worker: str) -> None:
        """``worker`` no longer holds what it recorded for its former model."""
        self._held.pop(worker, None)
