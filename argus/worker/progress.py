"""Where a request stands, told to its caller while it is served.

A caller that passes ``progress`` to :meth:`~argus.worker.engine.Worker.generate` hears
:class:`~argus.contracts.generate.Progress` events: queued with the requests ahead of it,
running from its start step, each step done (with a low-resolution preview of the latent when
the call asked for some), decoding. :class:`Reporter` turns one request's path through the
worker into those events. The sink runs on the denoising thread, so it must only hand the
event over (the servicer puts it on a queue); the GPU slot is held while it runs.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from argus.contracts.generate import Progress, Stage
from argus.contracts.progress import ProgressSink
from argus.worker.models.pipelines import StepHook


class Reporter:
    """Turns one request's path through the worker into :class:`Progress` events."""

    def __init__(self, sink: ProgressSink, arrived: float, previews: int, worker_id: str) -> None:
        self._sink = sink
        self._arrived = arrived
        self._previews = previews
        self._worker_id = worker_id
        self._position: int | None = None

    def _send(self, stage: Stage, **fields: Any) -> None:
        elapsed_ms = (time.perf_counter() - self._arrived) * 1e3
        self._sink(Progress(stage, worker_id=self._worker_id, elapsed_ms=elapsed_ms, **fields))

    def queued(self, position: int) -> None:
        if position != self._position:  # the wait polls; say only what changed
            self._position = position
            self._send(Stage.QUEUED, queue_position=position)

    def running(self, start_step: int, total_steps: int) -> StepHook:
        """Send RUNNING; returns the hook that sends each STEP (a step hook of the model)."""
        self._send(Stage.RUNNING, step=start_step, total_steps=total_steps)
        run = total_steps - start_step
        wanted = min(self._previews, run)

        def stepped(done: int, latents: torch.Tensor) -> None:
            preview = b""
            i = done - start_step  # steps of this run done, 1..run
            if wanted and (i * wanted) // run > ((i - 1) * wanted) // run:
                preview = latent_preview(latents)
            self._send(Stage.STEP, step=done, total_steps=total_steps, preview_png=preview)

        return stepped

    def decoding(self, total_steps: int) -> None:
        self._send(Stage.DECODING, step=total_steps, total_steps=total_steps)


def latent_preview(latents: torch.Tensor) -> bytes:
    """A PNG of the latent at its own resolution: its first three channels (the first one
    repeated when it has fewer) min-max scaled to 0..255 as RGB. A glimpse of the layout, not a
    decoded image: no VAE runs."""
    x = latents[0].detach().to("cpu", torch.float32)
    if x.shape[0] < 3:
        x = torch.cat([x, x[:1].expand(3 - x.shape[0], *x.shape[1:])])
    x = x[:3]
    low, high = float(x.min()), float(x.max())
    scaled = (x - low) / (high - low) if high > low else torch.zeros_like(x)
    pixels = (scaled * 255.0).round().to(torch.uint8).permute(1, 2, 0).numpy()
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), mode="RGB").save(out, format="PNG")
    return out.getvalue()
