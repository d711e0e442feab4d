"""How the worker serves edits: the mask-aware activation cache's use by a request, and the
edit lane's step batch.

An edit (a call with an ``image``) runs img2img or inpainting on whichever level's model the
request names, with the same queue, progress, cancellation and deadlines as a generation;
after the decode the worker pastes the pixels outside the edited region back from the
template. Two things set edits apart, and :class:`WorkerEdits` holds both:

* **The activation cache** (:mod:`argus.worker.editing.activation_cache`). An inpainting edit
  without adapters (nor a latent-parallel peer) uses it: the first edit of a template records
  its transformer blocks' outputs, later ones compute their region's tokens only
  (:meth:`WorkerEdits.denoise_alone`, or inside the batch). A record on disk is read into
  memory while the edit waits in the queue (:meth:`WorkerEdits.queued`); a recording reaches
  the store off the request path, on the worker's writer thread.
* **The edit lane** (:mod:`argus.worker.editing.lane`, on when the worker batches edits). An
  edit without adapters is served in the lane's step batch (:meth:`WorkerEdits.run_batched`)
  instead of taking the GPU slot for itself; it waits for its image on the calling thread, and
  leaves the lane at once when its token says stop or its decode can no longer finish in time.

The worker keeps its counters, its writer thread and its decode: they reach this class as the
callables it is built with.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from argus.types import Level
from argus.worker.adapters.workflow import NO_ADAPTERS, AdapterPlan, WorkerAdapters
from argus.worker.decode_times import DecodeSkipped
from argus.worker.editing.activation_cache import EditCache, EditCacheUse
from argus.worker.editing.lane import EditLane
from argus.worker.editing.step_batch import BatchResult, StepBatcher
from argus.worker.gpu_queue import QUEUE_POLL_S
from argus.worker.models.pipelines import (
    CancelToken,
    DenoiseResult,
    DiffusionModel,
    GenerationSpec,
    StepHook,
)
from argus.worker.models.registry import ModelRegistry
from argus.worker.progress import Reporter

log = logging.getLogger(__name__)

Decode = Callable[
    [DiffusionModel, GenerationSpec, DenoiseResult, CancelToken, Reporter | None],
    tuple[Image.Image, float],
]
"""The worker's decode of a run in time: the VAE's image and its seconds, or it raises."""
DecodeFits = Callable[[GenerationSpec, CancelToken, int], None]
"""Raises :class:`DecodeSkipped` when the request's decode cannot finish before its deadline."""


@dataclass(frozen=True)
class BatchedEdit:
    """An edit served in the lane's step batch, up to its image (the worker answers it)."""

    result: DenoiseResult  # its latents, steps and the batch's encode and denoise seconds
    image: Image.Image  # the VAE's image
    vae_s: float  # seconds the VAE took
    joined_s: float  # when it joined the batch (perf_counter): the end of its queue wait


class WorkerEdits:
    """The worker's edits: the activation cache (``edit_cache``, None: off) and the lane
    (``lane``, None: one request at a time; ``decoder``, the lane's own decode thread, None:
    decodes on the device thread). ``count`` adds one to a worker counter; ``off_path`` runs
    work on the worker's writer thread (its flush waits for it); ``decode`` and
    ``decode_fits`` are the worker's decode and its deadline check."""

    def __init__(
        self,
        registry: ModelRegistry,
        edit_cache: EditCache | None,
        adapters: WorkerAdapters | None,
        lane: EditLane | None,
        decoder: ThreadPoolExecutor | None,
        *,
        count: Callable[[str], None],
        off_path: Callable[[Callable[[], None]], None],
        decode: Decode,
        decode_fits: DecodeFits,
    ) -> None:
        self.registry = registry
        self.edit_cache = edit_cache
        self.adapters = adapters
        self.lane = lane
        self._decoder = decoder
        self._count = count
        self._off_path = off_path
        self._decode = decode
        self._decode_fits = decode_fits
        self._batch_keys = itertools.count()

    # -- the activation cache of edits -----------------------------------------------------

    def key(self, model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan) -> str | None:
        """The activation cache's key of ``spec`` on ``model``; None when it cannot use it
        (no cache, not inpainting, adapters or a latent-parallel peer)."""
        if self.edit_cache is None or spec.edit is None or spec.edit.region is None:
            return None
        peer = self.adapters is not None and self.adapters.peer is not None
        return self.edit_cache.key(model, spec, adapters=bool(plan) or peer)

    def queued(
        self, spec: GenerationSpec, level: Level, plan: AdapterPlan
    ) -> tuple[str, bool] | None:
        """An inpainting edit joins the queue: start loading its template's record into host
        memory while it waits (InstGenIE §4.2). Returns its key and whether a record was
        there (a record gone by the run is counted ``evicted``); None when it cannot use the
        cache or no model is loaded yet."""
        if self.edit_cache is None or spec.edit is None or spec.edit.region is None:
            return None
        model = self.registry.get(level.model) or self.registry.active()
        if model is None:
            return None
        key = self.key(model, spec, plan)
        return None if key is None else (key, self.edit_cache.queued(key))

    def denoise_alone(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        plan: AdapterPlan,
        queued_edit: tuple[str, bool] | None,
        run: Callable[..., DenoiseResult],
    ) -> DenoiseResult:
        """A run without adapters that holds the GPU slot for itself: ``run()``, or for an
        inpainting edit ``run(predictor=...)`` replaying its template's recorded activations,
        or recording them (stored off the request path)."""
        key = self.key(model, spec, plan)
        if key is None or self.edit_cache is None:
            return run()
        was_present = queued_edit is not None and queued_edit == (key, True)
        use = self.edit_cache.begin(model, spec, key, was_present=was_present)
        result = run(predictor=use.predictor)
        self._off_path(functools.partial(self._store_record, use.finish))
        return result

    def _store_record(self, finish: Callable[[], None]) -> None:
        try:
            finish()
        except Exception:
            log.exception("storing an edit's recorded activations failed")
            self._count("failed_edit_records")

    # -- the edit lane (argus/worker/editing/lane.py) ---------------------------------------

    def batches(self, spec: GenerationSpec, plan: AdapterPlan) -> bool:
        """Whether ``spec`` is served by the edit lane: an edit without adapters (nor a
        latent-parallel peer), on a worker that batches edits."""
        if self.lane is None or spec.edit is None or plan:
            return False
        return self.adapters is None or self.adapters.peer is None

    def run_batched(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        cancel: CancelToken,
        report: Reporter | None,
        queued_edit: tuple[str, bool] | None,
        joined: threading.Event,
    ) -> BatchedEdit:
        """Serve an edit on ``model`` in the lane's step batch (on the device thread: its
        preparation, its steps, and its decode unless the decode thread takes it), waiting
        for its image on the calling thread. ``joined`` is set when it joins. A request whose
        token says stop, or whose decode can no longer finish in time, leaves the queue at
        once; once in the batch it leaves at the next step boundary (:class:`Cancelled`)."""
        assert self.lane is not None
        key = self.key(model, spec, NO_ADAPTERS)
        uses: list[EditCacheUse] = []
        progress: list[StepHook] = []

        def on_join() -> Any:  # on the device thread, under the model's lock
            joined.set()
            self._count("denoise_runs")
            if report is not None:
                progress.append(report.running(spec.start_step, spec.steps))
            if key is None or self.edit_cache is None:
                return None
            present = queued_edit is not None and queued_edit == (key, True)
            use = self.edit_cache.begin(model, spec, key, was_present=present, batched=True)
            uses.append(use)
            return use.rows

        def stepped(done: int, latents: torch.Tensor) -> None:
            for hook in progress:
                hook(done, latents)

        decoded: Future[tuple[Image.Image, float, BatchResult]] = Future()

        def finished(future: Future[BatchResult]) -> None:  # on the device thread, after the step
            error = future.exception()
            if error is not None:
                decoded.set_exception(error)
            elif self._decoder is not None:
                self._decoder.submit(decode, future.result())
            else:
                decode(future.result())

        def decode(batch: BatchResult) -> None:
            try:
                ran = DenoiseResult(batch.latents, steps_run=batch.steps_run)
                image, vae_s = self._decode(model, spec, ran, cancel, report)
                decoded.set_result((image, vae_s, batch))
            except BaseException as error:
                decoded.set_exception(error)

        name = ("edit", next(self._batch_keys))
        batcher, _ = self.lane.submit(
            model,
            spec,
            name,
            cancel=cancel,
            hooks=(stepped,) if report is not None else (),
            on_step=self._count_step,
            on_join=on_join,
            on_done=finished,
        )
        while True:
            try:
                image, vae_s, batch = decoded.result(timeout=QUEUE_POLL_S)
                break
            except FutureTimeout:
                if not joined.is_set():
                    self._leave_lane(batcher, name, cancel, spec)
        for use in uses:  # a recording reaches the store off the request path
            self._off_path(functools.partial(self._store_record, use.finish))
        result = DenoiseResult(
            batch.latents,
            steps_run=batch.steps_run,
            encode_s=batch.prepared_s - batch.joined_s,
            denoise_s=batch.finished_s - batch.prepared_s,
        )
        return BatchedEdit(result, image, vae_s, batch.joined_s)

    def _count_step(self, step: int) -> None:
        self._count("denoise_steps")

    def _leave_lane(
        self, batcher: StepBatcher, name: Any, cancel: CancelToken, spec: GenerationSpec
    ) -> None:
        """A request waiting in the lane leaves it at once when its token says stop, or with
        :class:`DecodeSkipped` when the time left is shorter than its predicted decode (as a
        request waiting for the slot does)."""
        reason = cancel.reason()
        if reason is not None:
            batcher.withdraw(name, reason)  # its future fails: the wait raises Cancelled
            return
        try:
            self._decode_fits(spec, cancel, 0)
        except DecodeSkipped:
            if batcher.withdraw(name, "expired"):  # it joined meanwhile: the batch decides
                raise

    # -- shutdown --------------------------------------------------------------------------

    def close_lane(self) -> None:
        """Stop the lane and its decode thread (before the device thread they use stops)."""
        if self.lane is not None:
            self.lane.close()
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)

    def close(self) -> None:
        """Close the activation store (after the writer thread stored its last records)."""
        if self.edit_cache is not None:
            self.edit_cache.store.close()
