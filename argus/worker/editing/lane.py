"""The worker's lane for edits: step-level continuous batching on the device (InstGenIE §4.3).

With ``argus worker --edit-batch N`` (N > 1) an edit without adapters does not take the GPU
slot for itself: it is handed to the lane, which keeps one
:class:`~argus.worker.editing.step_batch.StepBatcher` per model and size. Waiting edits join the
running batch at the next step boundary, up to the bound (compatible ones: same model,
resolution and guidance mode), and finished ones leave, so a new edit does not wait for the
edits ahead of it to finish. The bound of each model and size is N, or, with
``--edit-batch-table FILE``, the knee of that model's and size's measured latency-per-batch
curve, at most N (:mod:`argus.profiles.batch_curve`; 1 where the table has no curve). Every
other request (generations, edits with LoRAs or ControlNets) takes the GPU slot for itself.

**One device.** The lane's own thread takes the worker's GPU slot
(:class:`~argus.worker.gpu_queue.FifoSlot`) in its turn, like any request, and runs the batch's
steps on the worker's device thread until nothing is left to run. While a request outside the
lane waits for the slot the batch *drains*: nobody new joins, the running edits finish, the slot
goes to the waiting request, and the edits still waiting take a new turn behind it. So neither
side starves the other, and the GPU runs one thing at a time.

**Decoding** happens where the worker says (``--decode-thread``): on the device thread right
after the step an edit finished in (the batch waits for it: one computing thread), or on a
decode thread of its own, so the next step starts at once (InstGenIE's pre- and
post-processing off the loop). The VAE has its own lock (:func:`~argus.worker.models.pipelines.
vae_lock`), not the model's, and each thread checks its own request's cancel token, so the two
threads never stop each other's work.

The lane's steps are counted for the worker's metrics through :class:`LaneEvents`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from argus.worker.editing.step_batch import BatchResult, StepBatcher
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

log = logging.getLogger(__name__)


class Slot(Protocol):
    """The GPU slot the lane takes in its turn (the worker's FifoSlot)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def waiting(self) -> int: ...


class LaneEvents:
    """What the lane tells metrics (:class:`~argus.worker.metrics.WorkerMetrics`)."""

    def on_batch_step(self, rows: int) -> None:
        """One batched step ran with ``rows`` requests in it."""


class EditLane:
    """Step batches of edits on the worker's device thread (see the module's docstring)."""

    def __init__(
        self,
        bound: int,
        slot: Slot,
        device: Executor,
        events: LaneEvents | None = None,
        bounds: Callable[[str, int, int], int] | None = None,
    ) -> None:
        if bound < 2:
            raise ValueError(f"edit batch bound: a lane batches, so >= 2; got {bound}")
        # each (model name, width, height)'s bound: a measured table's (argus/profiles/
        # batch_curve.py), else ``bound`` for every one
        self._bounds = bounds or (lambda model, width, height: bound)
        self._slot = slot
        self._device = device
        self._events = events or LaneEvents()
        self._batchers: dict[tuple[int, int, int], StepBatcher] = {}  # (id(model), w, h)
        self._work = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="edit-lane", daemon=True)
        self._thread.start()

    def submit(
        self, model: DiffusionModel, spec: GenerationSpec, key: Hashable, **request: Any
    ) -> tuple[StepBatcher, Future[BatchResult]]:
        """Queue ``spec`` on ``model``'s batch (``request``: :meth:`StepBatcher.submit`'s
        keywords); returns the batcher (to withdraw the request from) and its result."""
        where = (id(model), spec.width, spec.height)
        with self._work:
            if self._closed:
                raise RuntimeError("the edit lane is closed")
            batcher = self._batchers.get(where)
            if batcher is None or batcher.model is not model:
                bound = self._bounds(model.name, spec.width, spec.height)
                batcher = self._batchers[where] = StepBatcher(model, bound, history=False)
            future = batcher.submit(spec, key=key, **request)
            self._work.notify_all()
        return batcher, future

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking edits; the lane's thread ends after its current turn."""
        with self._work:
            self._closed = True
            self._work.notify_all()
        self._thread.join(timeout_s)

    # -- the lane's thread -----------------------------------------------------------------

    def _busy(self) -> list[StepBatcher]:
        return [b for b in self._batchers.values() if not b.idle()]

    def _serve(self) -> None:
        while True:
            with self._work:
                while not self._closed and not self._busy():
                    self._work.wait()
                if self._closed:
                    return
            with self._slot:  # its turn for the device, first come first served
                try:
                    self._device.submit(self._drive).result()
                except Exception:  # the device executor is shut down: the worker is closing
                    log.exception("the edit lane's turn on the device failed")
                    return

    def _drive(self) -> None:
        """On the device thread, holding the slot: step each busy batcher until nothing runs
        in it (it drains while another request waits for the slot)."""
        with self._work:
            busy = self._busy()
        for batcher in busy:
            try:
                self._step_until_drained(batcher)
            except Exception as error:  # a fault outside a step: its requests fail, not the lane
                log.exception("an edit batch failed")
                batcher.abort_all(error)
        with self._work:  # idle batchers of models no longer served are dropped
            for key, batcher in list(self._batchers.items()):
                if batcher.idle():
                    del self._batchers[key]

    def _step_until_drained(self, batcher: StepBatcher) -> None:
        while True:
            batcher.draining = self._slot.waiting() > 0
            rows = batcher.step()
            if not rows:
                return
            self._events.on_batch_step(rows)
