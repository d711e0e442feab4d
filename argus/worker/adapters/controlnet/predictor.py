"""The worker's side of ControlNet parallelism: a ``NoisePredictor`` for ``denoise``.

:class:`ControlNetPredictor` replaces :meth:`DiffusionModel.predict_noise` for a request
that names ControlNets. Each step (Katz §5, Fig. 11):

1. build the UNet's input (both CFG branches, scaled) and hand it to the ControlNet session;
2. meanwhile run the UNet's time embedding, down blocks and mid block
   (:meth:`SplitUNet.encode`);
3. take the residuals, summed over the request's ControlNets, and run the up blocks
   (:meth:`SplitUNet.decode`); then classifier-free guidance.

Modes:

* ``sync``: step 3 waits for *this* step's residuals. The output equals diffusers'
  sequential ControlNet pipeline (tested); the speedup is bounded by how much of a step the
  down and mid blocks are (Katz's Gustafson analysis, §9.3).
* ``async`` (pipelined, for slow links, Katz §5): step t's up blocks use the residuals of
  step t−1, which were computed, and sent, while step t−1 ran, so the ControlNets and the
  transfer overlap the whole UNet. The first step of a run has no earlier residuals and is
  synchronous; the last step starts no ControlNet run, since nothing would use it. Katz finds
  adjacent steps' residuals nearly identical (cosine > 0.99) and no quality loss; here the
  images are close to the synchronous ones but not equal.

With CUDA graphs (the worker's default on a GPU) a synchronous step whose session runs in
this process on the UNet's device is one graph: the ControlNets, then the UNet with their
residuals, so its kernels leave the host as a plain step's do; other steps replay the UNet's
halves around the session's residuals.

The predictor opens its session on the first step it runs (that is when it sees the text
conditioning) and closes it after the last; :meth:`close` (or ``with``) closes it early
when a run fails midway. A resumed run (approximate caching, start at step K) works the same
way: its first step is step K.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from argus.contracts.controlnet import ControlUnit
from argus.worker.adapters.controlnet.errors import InvalidControlNetRequest
from argus.worker.adapters.controlnet.executor import (
    ControlNetExecutor,
    ControlNetSession,
    LocalSession,
    SessionSpec,
    StepInputs,
    summed_residuals,
)
from argus.worker.adapters.controlnet.models import base_family
from argus.worker.adapters.controlnet.unet_split import (
    Encoded,
    Residuals,
    SplitUNet,
    check_residuals,
)
from argus.worker.models.cuda_graphs import indexed
from argus.worker.models.pipelines import Conditioning, DiffusionModel


def same_device(one: torch.device, other: torch.device) -> bool:
    """Whether two devices are the same one: "cuda" without an index is the current GPU (a
    worker's executor is made for "cuda", its tensors are on "cuda:0")."""
    return indexed(one) == indexed(other)


class ControlNetMode(Enum):
    SYNC = "sync"  # every step waits for its own residuals: diffusers' output
    ASYNC = "async"  # step t uses step t−1's residuals: full overlap, nearly the same output

    @classmethod
    def parse(cls, text: str) -> ControlNetMode:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(f"ControlNet mode {text!r}: expected sync or async") from None


@dataclass
class PredictorStats:
    """Where a request's ControlNet time went, for the worker's timing breakdown."""

    open_s: float = 0.0  # opening the session: image decoding, cache lookups, loads
    wait_s: float = 0.0  # the up blocks waiting for residuals (the part not overlapped)
    steps: int = 0
    stale_steps: int = 0  # async: steps that used the previous step's residuals
    cache_hits: tuple[bool, ...] = ()  # per ControlNet: resident before this request


class ControlNetPredictor:
    """A ``NoisePredictor`` that runs a request's ControlNets beside the UNet's encoder."""

    def __init__(
        self,
        model: DiffusionModel,
        executor: ControlNetExecutor,
        units: Sequence[ControlUnit],
        *,
        mode: ControlNetMode = ControlNetMode.SYNC,
        request_id: str = "",
        step_timeout_s: float | None = 600.0,
    ) -> None:
        if not units:
            raise InvalidControlNetRequest("controlnets", "no ControlNet given")
        self.model = model
        self.executor = executor
        self.units = tuple(units)
        self.mode = mode
        self.request_id = request_id
        self.step_timeout_s = step_timeout_s
        self.split = SplitUNet(model.pipeline.unet)
        self.family = base_family(model.pipeline.unet.config)
        self.stats = PredictorStats()
        self._session: ControlNetSession | None = None
        self._pending: Future[Residuals] | None = None  # async: the previous step's run
        self._latest: Residuals | None = None  # the residuals the last step used

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        try:
            return self._predict(latents, t, cond, scheduler, step)
        except BaseException:
            self.close()  # a failed run ends its session at once, not at the deadline
            raise

    def _predict(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        x = DiffusionModel.unet_input(latents, t, cond, scheduler)
        session = self._session if self._session is not None else self._open(x, cond)
        last = step >= len(scheduler.timesteps) - 1
        if self._graphed_whole(session, x):
            assert isinstance(session, LocalSession)
            noise = self._whole_step(session, x, t, cond)
            self.stats.steps += 1
            if last:
                self.close()
            return DiffusionModel.guide(noise, cond)
        if self.mode is ControlNetMode.SYNC or self._latest is None:
            running = session.submit(step, x, t)
            encoded = self._encode(x, t, cond)
            residuals = self._wait(running)
        else:
            previous, self._pending = self._pending, None
            if not last:
                self._pending = session.submit(step, x, t)  # for step + 1
            encoded = self._encode(x, t, cond)
            residuals = self._wait(previous) if previous is not None else self._latest
            self.stats.stale_steps += 1
        self._latest = residuals
        self.stats.steps += 1
        noise = self._decode(encoded, residuals.to(x.device, x.dtype))
        if last:
            self.close()
        return DiffusionModel.guide(noise, cond)

    def _graphed_whole(self, session: ControlNetSession, x: torch.Tensor) -> bool:
        """Whether a step runs as one CUDA graph of the ControlNets and the UNet: the model
        has graphs, the mode is synchronous, and the session runs in this process on the
        UNet's device (a second GPU or the ControlNet service keeps the overlapped halves)."""
        return (
            self.model.graphs is not None
            and self.mode is ControlNetMode.SYNC
            and isinstance(session, LocalSession)
            and same_device(session.device, x.device)
        )

    def _whole_step(
        self, session: LocalSession, x: torch.Tensor, t: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The step's noise from one graph: the ControlNets' residuals, the down and mid
        blocks and the up blocks. The ControlNets are the graph's non-tensor inputs, so a
        graph serves only the ControlNets (and scales) it was captured with, and holds them
        while it lives; their control images and the conditioning are static inputs."""
        graphs = self.model.graphs
        assert graphs is not None
        inputs = session.step_inputs(x, t)
        split = self.split

        def whole(
            x: torch.Tensor,
            timestep: torch.Tensor,
            embeds: torch.Tensor,
            added: dict[str, torch.Tensor] | None,
            inputs: StepInputs,
        ) -> torch.Tensor:
            residuals = summed_residuals(*inputs).to(x.device, x.dtype)
            return split.decode(split.encode(x, timestep, embeds, added), residuals)

        timestep = torch.as_tensor(t, device=x.device)
        noise: torch.Tensor = graphs.run(
            "controlnet-step", whole, x, timestep, cond.embeds, cond.added, inputs
        )
        return noise

    def _encode(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> Encoded:
        """The down and mid blocks: replayed from the model's CUDA graphs when it has them."""
        graphs = self.model.graphs
        if graphs is None:
            return self.split.encode(x, t, cond.embeds, cond.added)
        timestep = torch.as_tensor(t, device=x.device)
        encoded: Encoded = graphs.run(
            "controlnet-encode", self.split.encode, x, timestep, cond.embeds, cond.added
        )
        return encoded

    def _decode(self, encoded: Encoded, residuals: Residuals) -> torch.Tensor:
        """The up blocks with the residuals added: replayed from the model's CUDA graphs, the
        residuals copied into the graph's static inputs, when it has them."""
        graphs = self.model.graphs
        if graphs is None:
            return self.split.decode(encoded, residuals)
        check_residuals(residuals, encoded)  # a replay runs no Python: check before it
        noise: torch.Tensor = graphs.run("controlnet-decode", self.split.decode, encoded, residuals)
        return noise

    def _open(self, x: torch.Tensor, cond: Conditioning) -> ControlNetSession:
        factor = self.model.vae_scale_factor
        added = cond.added or {}
        spec = SessionSpec(
            family=self.family,
            height=int(x.shape[-2]) * factor,
            width=int(x.shape[-1]) * factor,
            units=self.units,
            encoder_hidden_states=cond.embeds,
            text_embeds=added.get("text_embeds"),
            time_ids=added.get("time_ids"),
            request_id=self.request_id,
        )
        began = time.perf_counter()
        session = self.executor.open(spec)
        self.stats.open_s += time.perf_counter() - began
        self.stats.cache_hits = session.info.cache_hits
        self._session = session
        return session

    def _wait(self, running: Future[Residuals]) -> Residuals:
        began = time.perf_counter()
        residuals = running.result(timeout=self.step_timeout_s)
        self.stats.wait_s += time.perf_counter() - began
        return residuals

    def close(self) -> None:
        """End the session (idempotent): after the last step, or when a run fails midway."""
        session, self._session = self._session, None
        self._pending = None
        self._latest = None
        if session is not None:
            session.close()

    def __enter__(self) -> ControlNetPredictor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
